#!/usr/bin/env bash
# A real single-node Slurm on 127.0.0.1 for shardrun's tests: munged, slurmctld, slurmd, and slurmdbd backed by
# MariaDB so that `sacct` works. Everything (config, spool, logs, database) lives in one state directory; nothing is
# written to /etc. Run as root: the daemons run as root, and Debian's packages are installed where programs are
# missing.
#
#   eval "$(scripts/local-slurm.sh start)"    # stdout carries only `export ...` lines
#   scripts/local-slurm.sh status             # exit 0 when every daemon runs and Slurm answers
#   scripts/local-slurm.sh stop [--purge]     # cancels jobs, stops the daemons; --purge also deletes the state
set -euo pipefail

ME=local-slurm
usage() {
  cat <<EOF
usage: scripts/local-slurm.sh start|stop|status [options]

  start      install what is missing (apt-get), write the config, start the daemons, wait until the node is idle
             and sacct answers, print the environment (export lines) on stdout. A cluster already running from
             the same state directory with the same settings is left alone; changed settings restart the daemons.
  stop       cancel the cluster's jobs and stop its daemons. Nothing running is not an error.
  status     say which daemons run; exit 0 only when all of them do and slurmctld answers.

options (each has an environment variable; the option wins):
  --state DIR       state directory               SHARDRUN_SLURM_STATE      (default /tmp/shardrun-slurm)
  --port-base P     slurmctld P, slurmd P+1,      SHARDRUN_SLURM_PORT_BASE  (default 23817)
                    slurmdbd P+2, MariaDB P+3
  --cpus N          CPUs the node advertises      SHARDRUN_SLURM_CPUS       (default 8; may exceed the real count,
                                                                             so that several jobs run at once)
  --mem-mb N        RealMemory of the node in MB  SHARDRUN_SLURM_MEM_MB     (default: MemTotal - 1024)
  --timeout S       seconds to wait for a daemon  SHARDRUN_SLURM_TIMEOUT    (default 120)
  --no-install      fail instead of running apt-get when a program is missing
  --purge           (stop) also delete the state directory
  -h, --help        this help

Logs: STATE/log/. The environment is also written to STATE/env.sh. See docs/slurm.md ("Testing on one machine").
EOF
}

STATE=${SHARDRUN_SLURM_STATE:-/tmp/shardrun-slurm}
PORT_BASE=${SHARDRUN_SLURM_PORT_BASE:-23817}
CPUS=${SHARDRUN_SLURM_CPUS:-8}
MEM_MB=${SHARDRUN_SLURM_MEM_MB:-}
TIMEOUT=${SHARDRUN_SLURM_TIMEOUT:-120}
INSTALL=1
PURGE=0
ACTION=

while [ $# -gt 0 ]; do
  case "$1" in
    start | stop | status) [ -z "$ACTION" ] || { echo "$ME: one action only" >&2; exit 2; }; ACTION=$1 ;;
    --state) STATE=${2:?--state needs a directory}; shift ;;
    --port-base) PORT_BASE=${2:?--port-base needs a number}; shift ;;
    --cpus) CPUS=${2:?--cpus needs a number}; shift ;;
    --mem-mb) MEM_MB=${2:?--mem-mb needs a number}; shift ;;
    --timeout) TIMEOUT=${2:?--timeout needs a number}; shift ;;
    --no-install) INSTALL=0 ;;
    --purge) PURGE=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "$ME: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
[ -n "$ACTION" ] || { usage >&2; exit 2; }

log() { echo "[$ME] $*" >&2; }
die() { echo "[$ME] error: $*" >&2; exit 1; }
for v in PORT_BASE CPUS TIMEOUT ${MEM_MB:+MEM_MB}; do
  case "${!v}" in '' | *[!0-9]*) die "$v must be a whole number, got '${!v}'" ;; esac
done
[ "$(id -u)" = 0 ] || die "run as root (the daemons run as root and missing packages are installed with apt-get)"
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

if [ ! -d "$STATE" ]; then
  case "$ACTION" in
    stop) log "nothing to stop: no state directory $STATE"; exit 0 ;;
    status) echo "local Slurm from $STATE is not running (no state directory)"; exit 3 ;;
  esac
  mkdir -p "$STATE"
fi
STATE=$(cd "$STATE" && pwd -P)
case "$STATE" in *[[:space:]\'\"\\\$\`]*) die "the state directory must not contain spaces or quotes: $STATE" ;; esac
CONF=$STATE/etc/slurm.conf
export SLURM_CONF=$CONF
# munged refuses a socket unless every directory above it is traversable by all, which pytest's and mktemp's 0700
# temporary directories are not; so the socket always lives under /run, in a directory named after the state.
MUNGE_DIR=/run/shardrun-munge-$(printf %s "$STATE" | sha256sum | cut -c1-12)
MUNGE_SOCK=$MUNGE_DIR/munge.socket
DB_SOCK=$STATE/db/mariadb.sock
CTLD_PORT=$PORT_BASE SLURMD_PORT=$((PORT_BASE + 1)) DBD_PORT=$((PORT_BASE + 2)) DB_PORT=$((PORT_BASE + 3))

# ---------------------------------------------------------------- processes by pid file

# alive PIDFILE PROGRAM: print the pid when the pid file names a live process of that program (Debian's
# slurmctld is slurmctld-wlm through an alternatives link). A stale pid file never matches another program.
alive() {
  local pid exe
  pid=$(head -n1 "$1" 2>/dev/null | tr -dc 0-9) || return 1
  exe=$(readlink "/proc/${pid:-none}/exe" 2>/dev/null) || return 1
  case "${exe##*/}" in "$2" | "$2"-wlm) echo "$pid" ;; *) return 1 ;; esac
}

# halt PIDFILE PROGRAM: SIGTERM, wait for the process to go, SIGKILL after TIMEOUT seconds.
halt() {
  local pid i
  if pid=$(alive "$1" "$2"); then
    log "stopping $2 (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < TIMEOUT * 5; i++)); do [ -e "/proc/$pid" ] || break; sleep 0.2; done
    [ ! -e "/proc/$pid" ] || { log "$2 ignored SIGTERM; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; }
  fi
  rm -f "$1"
}

# await WHAT LOGFILE COMMAND...: retry COMMAND until it succeeds; after TIMEOUT seconds fail with the log's tail.
await() {
  local what=$1 logf=$2 deadline=$((SECONDS + TIMEOUT))
  shift 2
  until "$@" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "no $what after ${TIMEOUT}s; the end of $logf:"
      tail -n 30 "$logf" >&2 2>/dev/null || true
      exit 1
    fi
    sleep 0.2
  done
}

# launch LOGNAME COMMAND...: start a daemon with no inherited stdin/stdout or lock descriptor (fd 9).
launch() {
  local name=$1
  shift
  "$@" </dev/null >"$STATE/log/$name.out" 2>&1 9>&- || { cat "$STATE/log/$name.out" >&2; die "$name did not start"; }
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null || die "port $1 is taken by another program; use --port-base"; }

# update FILE MODE: stdin -> FILE when it differs; succeeds only when FILE changed.
update() {
  local new
  new=$(cat)
  [ -f "$1" ] && [ "$(cat "$1")" = "$new" ] && return 1
  (umask 077 && printf '%s\n' "$new" >"$1.tmp") && chmod "$2" "$1.tmp" && mv -f "$1.tmp" "$1"
}

DAEMONS=(
  "munged $MUNGE_DIR/munged.pid"
  "mariadbd $STATE/db/mariadbd.pid"
  "slurmdbd $STATE/run/slurmdbd.pid"
  "slurmctld $STATE/run/slurmctld.pid"
  "slurmd $STATE/run/slurmd.pid"
)

# ---------------------------------------------------------------- status

do_status() {
  local entry pid down=0
  for entry in "${DAEMONS[@]}"; do
    set -- $entry
    if pid=$(alive "$2" "$1"); then echo "$1 running (pid $pid)"; else echo "$1 not running"; down=1; fi
  done
  if [ "$down" = 0 ] && scontrol ping 2>/dev/null | grep -q 'is UP'; then
    echo "local Slurm runs from $STATE (SLURM_CONF=$CONF, ports $CTLD_PORT-$DB_PORT)"
    return 0
  fi
  echo "local Slurm from $STATE is not running"
  return 3
}

# ---------------------------------------------------------------- stop

do_stop() {
  local jobs i entry
  if [ -f "$CONF" ] && alive "$STATE/run/slurmctld.pid" slurmctld >/dev/null; then
    jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
      log "cancelling jobs $jobs"
      scancel $jobs 2>/dev/null || true
      for ((i = 0; i < TIMEOUT * 5; i++)); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
    fi
  fi
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    entry=${DAEMONS[i]}
    set -- $entry
    halt "$2" "$1"
  done
  rm -rf "$MUNGE_DIR"
  if [ "$PURGE" = 1 ]; then
    # only a directory this script set up: --state / --purge must not delete anything else
    grep -qs '^# written by scripts/local-slurm.sh' "$CONF" || die "not purging $STATE: it holds no config of ours"
    rm -rf "$STATE"
    log "removed $STATE"
  fi
  log "stopped"
}

# ---------------------------------------------------------------- start

munge_ok() { munge -n -S "$MUNGE_SOCK" | unmunge -S "$MUNGE_SOCK"; }
db() { mariadb --no-defaults -S "$DB_SOCK" -uroot "$@"; }
ctld_up() { scontrol ping | grep -q 'is UP'; }
node_ready() {  # node_ready NODE: idle, mixed or allocated; a drained or down node is told to resume
  case "$(scontrol -o show node "$1" | sed -n 's/.* State=\([^ ]*\).*/\1/p')" in
    IDLE | MIXED | ALLOCATED) return 0 ;;
    *DRAIN* | DOWN*) scontrol update nodename="$1" state=resume; return 1 ;;
    *) return 1 ;;
  esac
}

PROGRAMS=(munged munge unmunge slurmctld slurmd slurmdbd sbatch srun squeue sinfo scontrol scancel sacct sacctmgr
  mariadbd mariadb mariadb-install-db)
PACKAGES=(munge slurmctld slurmd slurmdbd slurm-client mariadb-server-core mariadb-client-core)

install_missing() {
  local missing=() p rc=0
  for p in "${PROGRAMS[@]}"; do command -v "$p" >/dev/null || missing+=("$p"); done
  [ ${#missing[@]} -gt 0 ] || return 0
  [ "$INSTALL" = 1 ] && command -v apt-get >/dev/null ||
    die "missing ${missing[*]}; install the Debian packages ${PACKAGES[*]}"
  log "installing ${PACKAGES[*]} (missing: ${missing[*]}); log in $STATE/log/apt.log"
  # the packages' scripts would start system-wide daemons configured in /etc; ours run from the state directory
  local policy=/usr/sbin/policy-rc.d ours=0
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && ours=1; fi
  {
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update &&
      DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends \
        "${PACKAGES[@]}"
  } >"$STATE/log/apt.log" 2>&1 || rc=$?
  [ "$ours" = 0 ] || rm -f "$policy"
  [ "$rc" = 0 ] || { tail -n 20 "$STATE/log/apt.log" >&2; die "apt-get failed"; }
  for p in "${PROGRAMS[@]}"; do command -v "$p" >/dev/null || die "$p is still missing after installing"; done
}

write_config() {
  local node=$1 mem=$2 changed=1
  update "$CONF" 644 <<EOF || changed=0
# written by scripts/local-slurm.sh: a single-node test cluster (edits are overwritten)
ClusterName=shardrun
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again this many seconds after it ended (Slurm's default is 120)
AuthInfo=socket=$MUNGE_SOCK,cred_expire=5
StateSaveLocation=$STATE/spool/ctld
SlurmdSpoolDir=$STATE/spool/d
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
# no cgroups in a container: plain process tracking, no task binding, no memory enforcement
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MailProg=/bin/true
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE_SOCK
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
# accept more CPUs and memory than the machine has
SlurmdParameters=config_overrides
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=300
NodeName=$node NodeAddr=127.0.0.1 NodeHostname=$node CPUs=$CPUS RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
  # slurmdbd reads slurmdbd.conf next to SLURM_CONF and refuses it unless only its owner can read it
  update "$STATE/etc/slurmdbd.conf" 600 <<EOF || [ "$changed" = 1 ]
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdAddr=127.0.0.1
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$STATE/db/password")
StorageLoc=slurm_acct_db
EOF
}

start_munge() {
  alive "$MUNGE_DIR/munged.pid" munged >/dev/null && return 0
  [ -s "$STATE/munge/munge.key" ] || (umask 077 && head -c 1024 /dev/urandom >"$STATE/munge/munge.key")
  chmod 400 "$STATE/munge/munge.key"
  rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
  launch munged munged --socket="$MUNGE_SOCK" --key-file="$STATE/munge/munge.key" \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/seed"
  await munged "$STATE/log/munged.log" munge_ok
}

start_mariadb() {
  if ! alive "$STATE/db/mariadbd.pid" mariadbd >/dev/null; then
    port_free "$DB_PORT"
    if [ ! -d "$STATE/db/data/mysql" ]; then
      rm -rf "$STATE/db/data"
      mariadb-install-db --no-defaults --user=root --datadir="$STATE/db/data" --skip-test-db \
        --auth-root-authentication-method=socket >"$STATE/log/mariadb-install.log" 2>&1 ||
        { tail -n 20 "$STATE/log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
    fi
    # mariadbd does not daemonize itself: setsid and & detach it from this script
    setsid mariadbd --no-defaults --user=root --datadir="$STATE/db/data" --socket="$DB_SOCK" --port="$DB_PORT" \
      --bind-address=127.0.0.1 --skip-name-resolve --skip-log-bin --pid-file="$STATE/db/mariadbd.pid" \
      --log-error="$STATE/log/mariadbd.err" --innodb-use-native-aio=0 --innodb-buffer-pool-size=64M \
      --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 9>&- &
    await MariaDB "$STATE/log/mariadbd.err" db -e 'SELECT 1'
  fi
  # slurmdbd connects over TCP with a password (kept in the state directory, readable by root only)
  db <<EOF || die "could not create MariaDB's slurm user"
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$STATE/db/password")';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$(cat "$STATE/db/password")';
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
EOF
}

do_start() {
  local node mem changed=0
  mkdir -p "$STATE"/{etc,munge,db,spool/ctld,spool/d,log,run} "$MUNGE_DIR"
  chmod 755 "$STATE" "$MUNGE_DIR"
  install_missing
  node=$(hostname -s 2>/dev/null || true)
  case "$node" in '' | *[!A-Za-z0-9-]*) node=localhost ;; esac
  mem=${MEM_MB:-$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 - 1024))}
  [ -s "$STATE/db/password" ] || (umask 077 && head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$STATE/db/password")
  write_config "$node" "$mem" && changed=1

  start_munge
  start_mariadb
  if [ "$changed" = 1 ]; then  # new settings: the Slurm daemons start again with them
    halt "$STATE/run/slurmd.pid" slurmd
    halt "$STATE/run/slurmctld.pid" slurmctld
    halt "$STATE/run/slurmdbd.pid" slurmdbd
  fi
  if ! alive "$STATE/run/slurmdbd.pid" slurmdbd >/dev/null; then
    port_free "$DBD_PORT"
    launch slurmdbd slurmdbd
    await slurmdbd "$STATE/log/slurmdbd.log" sacctmgr -n list cluster
  fi
  sacctmgr -n -P list cluster format=cluster | grep -qx shardrun || sacctmgr -i add cluster shardrun >/dev/null ||
    die "sacctmgr could not add the cluster"
  if ! alive "$STATE/run/slurmctld.pid" slurmctld >/dev/null; then
    port_free "$CTLD_PORT"
    launch slurmctld slurmctld -i -f "$CONF"  # -i: start even when a saved state cannot be read
  fi
  await slurmctld "$STATE/log/slurmctld.log" ctld_up
  if ! alive "$STATE/run/slurmd.pid" slurmd >/dev/null; then
    port_free "$SLURMD_PORT"
    launch slurmd slurmd -f "$CONF" -N "$node"
  fi
  await "idle node $node" "$STATE/log/slurmd.log" node_ready "$node"
  await "sacct" "$STATE/log/slurmdbd.log" sacct -n -X -S now-1hour -o JobID

  printf 'export SLURM_CONF=%s\nexport SHARDRUN_SLURM_STATE=%s\n' "$CONF" "$STATE" >"$STATE/env.sh"
  log "ready: node $node, $CPUS CPUs, ${mem} MB, partition debug, ports $CTLD_PORT-$DB_PORT, state $STATE"
  cat "$STATE/env.sh"
}

# one start or stop at a time per state directory (two test sessions may start the same cluster at once)
exec 9>"$STATE/.lock"
flock 9
case "$ACTION" in
  start) do_start ;;
  stop) do_stop ;;
  status) do_status ;;
esac
