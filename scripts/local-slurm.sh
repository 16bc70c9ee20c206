#!/usr/bin/env bash
# A real Slurm on one machine for shardrun's tests: munged, slurmctld, slurmd, and slurmdbd backed by MariaDB so
# that `sacct` works. By default a single node on 127.0.0.1; with --nodes N, N nodes, each slurmd in its own network,
# UTS and mount namespace joined by a bridge (see "Nodes in namespaces" below). Everything (config, spool, logs,
# database) lives in one state directory; nothing is written to /etc. Run as root: the daemons run as root, and
# Debian's packages are installed where programs are missing.
#
#   eval "$(scripts/local-slurm.sh start)"    # stdout carries only `export ...` lines
#   scripts/local-slurm.sh start --nodes 2 --gpus-per-node 2 --state /tmp/shardrun-slurm-nodes --port-base 25817
#   scripts/local-slurm.sh status             # exit 0 when every daemon runs and Slurm answers
#   scripts/local-slurm.sh stop [--purge]     # cancels jobs, stops the daemons; --purge also deletes the state
set -euo pipefail

ME=local-slurm
usage() {
  cat <<EOF
usage: scripts/local-slurm.sh start|stop|status [options]

  start      install what is missing (apt-get), write the config, start the daemons, wait until every node is
             idle and sacct answers, print the environment (export lines) on stdout. A cluster already running
             from the same state directory with the same settings is left alone; changed settings restart the
             daemons (and rebuild the nodes' namespaces).
  stop       cancel the cluster's jobs and stop its daemons; remove the namespaces, veths and bridge it made.
             Nothing running is not an error.
  status     say which daemons run (each node's slurmd, namespace and address); exit 0 only when all of them do
             and slurmctld answers.

options (each has an environment variable; the option wins):
  --state DIR       state directory               SHARDRUN_SLURM_STATE      (default /tmp/shardrun-slurm)
  --port-base P     slurmctld P, slurmd P+1,      SHARDRUN_SLURM_PORT_BASE  (default 23817)
                    slurmdbd P+2, MariaDB P+3
  --cpus N          CPUs a node advertises        SHARDRUN_SLURM_CPUS       (default 8; may exceed the real count,
                                                                             so that several jobs run at once)
  --mem-mb N        RealMemory of a node in MB    SHARDRUN_SLURM_MEM_MB     (default: MemTotal - 1024)
  --nodes N         how many nodes (1 to 99)      SHARDRUN_SLURM_NODES      (default 1: one node on 127.0.0.1,
                                                                             no namespaces)
  --gpus-per-node G fake GPUs of a node (GRES     SHARDRUN_SLURM_GPUS_PER_NODE (default 0): sbatch --gpus-per-node
                    gpu, no device behind them)                              schedules, CUDA_VISIBLE_DEVICES is set
  --timeout S       seconds to wait for a daemon  SHARDRUN_SLURM_TIMEOUT    (default 120)
  --no-install      fail instead of running apt-get when a program is missing
  --purge           (stop) also delete the state directory
  -h, --help        this help

Nodes in namespaces (N >= 2): nodes sr1..srN, node k at 10.A.B.(10+k) where 10.A.B.0/24 comes from the port base
(A = P / 256, B = P % 256: 23817 gives 10.93.9.0/24); the bridge sr<P>br in the root namespace holds 10.A.B.1,
where slurmctld answers; node k's network namespace is shardrun-<P>-srk, joined to the bridge by the veth sr<P>vk
(eth0 inside). Each node has its own hostname and sees STATE/etc/hosts as /etc/hosts (every node's name, the
controller's); start also prints SHARDRUN_SLURM_NODE_ADDRS=sr1=10.A.B.11,sr2=... A shell on node srk as its jobs
see it: nsenter -a -t PID bash, PID from STATE/run/slurmd-srk.pid (ip netns exec shardrun-<P>-srk: its network).

Logs: STATE/log/ (slurmd-srK.log per node). The environment is also written to STATE/env.sh. See docs/slurm.md
("Testing on one machine").
EOF
}

STATE=${SHARDRUN_SLURM_STATE:-/tmp/shardrun-slurm}
PORT_BASE=${SHARDRUN_SLURM_PORT_BASE:-23817}
CPUS=${SHARDRUN_SLURM_CPUS:-8}
MEM_MB=${SHARDRUN_SLURM_MEM_MB:-}
TIMEOUT=${SHARDRUN_SLURM_TIMEOUT:-120}
NODES=${SHARDRUN_SLURM_NODES:-1}
GPUS=${SHARDRUN_SLURM_GPUS_PER_NODE:-0}
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
    --nodes) NODES=${2:?--nodes needs a number}; shift ;;
    --gpus-per-node) GPUS=${2:?--gpus-per-node needs a number}; shift ;;
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
for v in PORT_BASE CPUS TIMEOUT NODES GPUS ${MEM_MB:+MEM_MB}; do
  case "${!v}" in '' | *[!0-9]*) die "$v must be a whole number, got '${!v}'" ;; esac
done
NODES=$((10#$NODES)) GPUS=$((10#$GPUS)) PORT_BASE=$((10#$PORT_BASE))
if [ "$NODES" -lt 1 ] || [ "$NODES" -gt 99 ]; then die "--nodes must be 1 to 99, got $NODES"; fi
[ "$PORT_BASE" -le 65532 ] || die "--port-base must be at most 65532, got $PORT_BASE"
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
)

# ---------------------------------------------------------------- nodes in namespaces (--nodes N, N >= 2)

# What a start with N >= 2 made, one line each, written before it is made so that stop finds it all (and removes
# nothing else):   bridge NAME ADDR      node NAME ADDR NETNS VETH
# A single-node cluster has no such file; its slurmd runs in the root namespace with the pid file run/slurmd.pid.
NODES_REC=$STATE/run/nodes
NET_PREFIX=10.$((PORT_BASE / 256)).$((PORT_BASE % 256))  # distinct port bases, distinct /24s
CTL_ADDR=$NET_PREFIX.1
BRIDGE=sr${PORT_BASE}br

# planned_nodes: the record of the requested settings
planned_nodes() {
  local k
  echo "bridge $BRIDGE $CTL_ADDR"
  for ((k = 1; k <= NODES; k++)); do
    echo "node sr$k $NET_PREFIX.$((10 + k)) shardrun-$PORT_BASE-sr$k sr${PORT_BASE}v$k"
  done
}

# recorded_nodes: "NAME ADDR NETNS VETH" of each node of the running (or last) multi-node cluster
recorded_nodes() { if [ -f "$NODES_REC" ]; then sed -n 's/^node //p' "$NODES_REC"; fi; }

# slurmd_pidfile NODE: single node: run/slurmd.pid; nodes in namespaces: SlurmdPidFile's %n
slurmd_pidfile() { if [ -n "${1:-}" ]; then echo "$STATE/run/slurmd-$1.pid"; else echo "$STATE/run/slurmd.pid"; fi; }

# kill_netns NETNS: end what still runs in the namespace (job processes slurmd left behind), TERM then KILL
kill_netns() {
  local pids=() i
  [ -e "/run/netns/$1" ] || return 0
  mapfile -t pids < <(ip netns pids "$1" 2>/dev/null)
  [ ${#pids[@]} -gt 0 ] || return 0
  log "ending processes left in $1: ${pids[*]}"
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do
    mapfile -t pids < <(ip netns pids "$1" 2>/dev/null)
    [ ${#pids[@]} -gt 0 ] || return 0
    sleep 0.2
  done
  kill -KILL "${pids[@]}" 2>/dev/null || true
}

# teardown_net: remove the namespaces, veths and bridge that the record names (only those), then the record
teardown_net() {
  local kind name addr ns veth bridge='' pid
  [ -f "$NODES_REC" ] || return 0
  # every slurmd is told at once, then each is waited for
  while read -r -u 3 name addr ns veth; do
    pid=$(alive "$(slurmd_pidfile "$name")" slurmd) || continue
    log "stopping slurmd of $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
  done 3< <(recorded_nodes)
  while read -r -u 3 kind name addr ns veth; do
    case "$kind" in
      bridge) bridge=$name ;;
      node)
        halt "$(slurmd_pidfile "$name")" slurmd
        kill_netns "$ns"
        ! ip link show "$veth" >/dev/null 2>&1 || ip link del "$veth" || true
        [ ! -e "/run/netns/$ns" ] || { log "removing network namespace $ns"; ip netns del "$ns" || true; }
        ;;
    esac
  done 3<"$NODES_REC"
  if [ -n "$bridge" ] && ip link show "$bridge" >/dev/null 2>&1; then
    log "removing bridge $bridge"
    ip link del "$bridge" || true
  fi
  rm -f "$NODES_REC"
}

# check_net: refuse names and addresses that something other than this cluster holds
check_net() {
  local kind name addr ns veth route ours="is not this cluster's (another cluster's port base?); use --port-base"
  while read -r -u 3 kind name addr ns veth; do
    [ "$kind" = node ] || continue
    [ ! -e "/run/netns/$ns" ] || die "the network namespace $ns exists but $ours"
    ! ip link show "$veth" >/dev/null 2>&1 || die "the network interface $veth exists but $ours"
  done 3< <(planned_nodes)
  ! ip link show "$BRIDGE" >/dev/null 2>&1 || die "the network interface $BRIDGE exists but $ours"
  route=$(ip -4 -o route show root "$NET_PREFIX.0/24" 2>/dev/null | head -n1)
  [ -z "$route" ] || die "the subnet $NET_PREFIX.0/24 of port base $PORT_BASE is in use ($route); use --port-base"
}

# ensure_bridge: the bridge with the controller's address, up
ensure_bridge() {
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge || die "could not create the bridge $BRIDGE"
  fi
  { ip addr replace "$CTL_ADDR/24" dev "$BRIDGE" && ip link set "$BRIDGE" up; } || die "could not set up $BRIDGE"
}

# start_node NAME ADDR NETNS VETH: a fresh network namespace joined to the bridge, then slurmd in it with its own
# hostname (UTS namespace) and, in a private mount namespace, STATE/etc/hosts bind-mounted over /etc/hosts
start_node() {
  local name=$1 addr=$2 ns=$3 veth=$4
  kill_netns "$ns"
  ! ip link show "$veth" >/dev/null 2>&1 || ip link del "$veth"
  [ ! -e "/run/netns/$ns" ] || ip netns del "$ns"
  {
    ip netns add "$ns" &&
      ip link add "$veth" type veth peer name eth0 netns "$ns" &&
      ip link set "$veth" master "$BRIDGE" up &&
      ip -n "$ns" addr add "$addr/24" dev eth0 &&
      ip -n "$ns" link set eth0 up &&
      ip -n "$ns" link set lo up
  } || die "could not set up the network namespace $ns"
  mkdir -p "$STATE/spool/d-$name"
  # nsenter: the network namespace (not `ip netns exec`, whose fresh /sys lacks the cgroup mount slurmd wants);
  # unshare: the hostname, and a mount namespace slave to the root one (mounts made there later are seen here, the
  # bind mount made here is not seen there)
  # shellcheck disable=SC2016 # $1, $2 and $@ are sh's
  launch "slurmd-$name" nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation slave -- \
    sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"' node "$name" "$STATE/etc/hosts" \
    slurmd -f "$CONF" -N "$name"
}

# ---------------------------------------------------------------- status

do_status() {
  local entry pid down=0 name addr ns veth
  for entry in "${DAEMONS[@]}"; do
    set -- $entry
    if pid=$(alive "$2" "$1"); then echo "$1 running (pid $pid)"; else echo "$1 not running"; down=1; fi
  done
  if [ -f "$NODES_REC" ]; then
    read -r _ name addr <"$NODES_REC"  # the record's names: status needs no --port-base
    if ip link show "$name" 2>/dev/null | grep -q ',UP'; then
      echo "bridge $name up ($addr/24, slurmctld's address for the nodes)"
    else
      echo "bridge $name missing or down"; down=1
    fi
    while read -r -u 3 name addr ns veth; do
      if pid=$(alive "$(slurmd_pidfile "$name")" slurmd); then
        echo "node $name: slurmd running (pid $pid), address $addr, network namespace $ns, veth $veth," \
          "Slurm state $(scontrol -o show node "$name" 2>/dev/null | sed -n 's/.* State=\([^ ]*\).*/\1/p')"
      else
        echo "node $name: slurmd not running (address $addr, network namespace $ns)"; down=1
      fi
    done 3< <(recorded_nodes)
  elif pid=$(alive "$(slurmd_pidfile)" slurmd); then
    echo "slurmd running (pid $pid)"
  else
    echo "slurmd not running"; down=1
  fi
  if [ "$down" = 0 ] && scontrol ping 2>/dev/null | grep -q 'is UP'; then
    CTLD_PORT=$(sed -n 's/^SlurmctldPort=//p' "$CONF")  # the config's ports, whatever --port-base says
    echo "local Slurm runs from $STATE (SLURM_CONF=$CONF, ports $CTLD_PORT-$((CTLD_PORT + 3)))"
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
  halt "$(slurmd_pidfile)" slurmd
  teardown_net  # each node's slurmd, what runs in its namespace, the namespaces, veths, bridge
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
if [ "$NODES" -gt 1 ]; then PROGRAMS+=(ip nsenter unshare mount) PACKAGES+=(iproute2 util-linux mount); fi

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
  local ctl=$1 mem=$2 changed=0 title gres='' name addr ns veth k nodelines='' partition files paths gpus=''
  [ "$GPUS" = 0 ] || gres=" Gres=gpu:$GPUS"
  if [ "$NODES" = 1 ]; then
    title="a single-node test cluster"
    nodelines="NodeName=$ctl NodeAddr=127.0.0.1 NodeHostname=$ctl CPUs=$CPUS RealMemory=$mem$gres State=UNKNOWN"
    partition=$ctl
    paths="SlurmctldHost=$ctl(127.0.0.1)"
    files="SlurmdSpoolDir=$STATE/spool/d
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log"
  else
    title="a test cluster of $NODES nodes in network namespaces"
    while read -r -u 3 name addr ns veth; do
      nodelines+="${nodelines:+$'\n'}NodeName=$name NodeAddr=$addr NodeHostname=$name"
      nodelines+=" CPUs=$CPUS RealMemory=$mem$gres State=UNKNOWN"
    done 3< <(sed -n 's/^node //p' <<<"$(planned_nodes)")
    partition=sr[1-$NODES]
    paths="SlurmctldHost=$ctl($CTL_ADDR)"
    files="# one slurmd per node, all on this machine: %n is the node's name
SlurmdSpoolDir=$STATE/spool/d-%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log"
  fi
  [ "$GPUS" = 0 ] || gpus="# fake GPUs: gres.conf names device files in STATE/dev that nothing opens
GresTypes=gpu
AccountingStorageTRES=gres/gpu
"
  update "$CONF" 644 <<EOF && changed=1
# written by scripts/local-slurm.sh: $title (edits are overwritten)
ClusterName=shardrun
$paths
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again this many seconds after it ended (Slurm's default is 120)
AuthInfo=socket=$MUNGE_SOCK,cred_expire=5
StateSaveLocation=$STATE/spool/ctld
$files
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
${gpus}SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
# accept more CPUs and memory than the machine has
SlurmdParameters=config_overrides
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=300
$nodelines
PartitionName=debug Nodes=$partition Default=YES MaxTime=INFINITE State=UP
EOF
  # fake GPUs: per node, one character device per GPU (a copy of /dev/null that nothing opens)
  if [ "$GPUS" = 0 ]; then
    rm -f "$STATE/etc/gres.conf"
  else
    local gresnodes
    if [ "$NODES" = 1 ]; then gresnodes=$ctl; else gresnodes=$(seq -f 'sr%g' 1 "$NODES"); fi
    for name in $gresnodes; do
      mkdir -p "$STATE/dev/$name"
      for ((k = 0; k < GPUS; k++)); do
        [ -c "$STATE/dev/$name/gpu$k" ] || mknod -m 666 "$STATE/dev/$name/gpu$k" c 1 3 || die "mknod failed"
      done
    done
    {
      echo "AutoDetect=off"
      for name in $gresnodes; do echo "NodeName=$name Name=gpu File=$STATE/dev/$name/gpu[0-$((GPUS - 1))]"; done
    } | update "$STATE/etc/gres.conf" 644 && changed=1
  fi
  # the nodes' /etc/hosts: every node's name and the controller's, at their bridge addresses
  if [ "$NODES" -gt 1 ]; then
    {
      echo "# written by scripts/local-slurm.sh: /etc/hosts inside the nodes' namespaces"
      echo "127.0.0.1 localhost"
      echo "::1 localhost ip6-localhost ip6-loopback"
      [ "$ctl" = localhost ] || echo "$CTL_ADDR $ctl"
      sed -n 's/^node \([^ ]*\) \([^ ]*\) .*/\2 \1/p' <<<"$(planned_nodes)"
    } | update "$STATE/etc/hosts" 644 && changed=1
  fi
  # slurmdbd reads slurmdbd.conf next to SLURM_CONF and refuses it unless only its owner can read it
  update "$STATE/etc/slurmdbd.conf" 600 <<EOF && changed=1
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
  [ "$changed" = 1 ]
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
  local node mem changed=0 name addr ns veth addrs=
  mkdir -p "$STATE"/{etc,munge,db,spool/ctld,spool/d,log,run} "$MUNGE_DIR"
  chmod 755 "$STATE" "$MUNGE_DIR"
  install_missing
  node=$(hostname -s 2>/dev/null || true)
  case "$node" in '' | *[!A-Za-z0-9-]*) node=localhost ;; esac
  [ "$NODES" = 1 ] || case "$node" in sr[0-9]*) die "this machine's name $node is a node name of the cluster" ;; esac
  mem=${MEM_MB:-$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 - 1024))}
  [ -s "$STATE/db/password" ] || (umask 077 && head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$STATE/db/password")
  write_config "$node" "$mem" && changed=1

  start_munge
  start_mariadb
  if [ "$changed" = 1 ]; then  # new settings: the Slurm daemons start again with them
    halt "$(slurmd_pidfile)" slurmd
    while read -r -u 3 name addr ns veth; do halt "$(slurmd_pidfile "$name")" slurmd; done 3< <(recorded_nodes)
    halt "$STATE/run/slurmctld.pid" slurmctld
    halt "$STATE/run/slurmdbd.pid" slurmdbd
  fi
  # the namespaces, veths and bridge of other settings go; new ones are recorded before they are made
  if [ "$NODES" = 1 ] || { [ -f "$NODES_REC" ] && [ "$(cat "$NODES_REC")" != "$(planned_nodes)" ]; }; then
    teardown_net
  fi
  if [ "$NODES" -gt 1 ]; then
    if [ ! -f "$NODES_REC" ]; then
      check_net
      planned_nodes >"$NODES_REC"
    fi
    ensure_bridge
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
  if [ "$NODES" = 1 ]; then
    if ! alive "$STATE/run/slurmd.pid" slurmd >/dev/null; then
      port_free "$SLURMD_PORT"
      launch slurmd slurmd -f "$CONF" -N "$node"
    fi
    await "idle node $node" "$STATE/log/slurmd.log" node_ready "$node"
  else
    while read -r -u 3 name addr ns veth; do
      alive "$(slurmd_pidfile "$name")" slurmd >/dev/null || start_node "$name" "$addr" "$ns" "$veth"
    done 3< <(recorded_nodes)
    while read -r -u 3 name addr ns veth; do
      await "idle node $name" "$STATE/log/slurmd-$name.log" node_ready "$name"
      addrs+="${addrs:+,}$name=$addr"
    done 3< <(recorded_nodes)
  fi
  await "sacct" "$STATE/log/slurmdbd.log" sacct -n -X -S now-1hour -o JobID

  printf 'export SLURM_CONF=%s\nexport SHARDRUN_SLURM_STATE=%s\n' "$CONF" "$STATE" >"$STATE/env.sh"
  if [ "$NODES" = 1 ]; then
    log "ready: node $node, $CPUS CPUs, ${mem} MB, partition debug, ports $CTLD_PORT-$DB_PORT, state $STATE"
  else
    printf 'export SHARDRUN_SLURM_NODE_ADDRS=%s\n' "$addrs" >>"$STATE/env.sh"
    log "ready: $NODES nodes ($addrs; slurmctld at $CTL_ADDR), $CPUS CPUs, ${mem} MB and $GPUS GPUs each," \
      "partition debug, ports $CTLD_PORT-$DB_PORT, state $STATE"
  fi
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
