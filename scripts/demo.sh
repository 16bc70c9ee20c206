#!/usr/bin/env bash
# The main job on a fresh machine: install what is needed, collect the bundled example (examples/arith: 36 tasks
# x 4 repeats in 4 shards on the local executor, at most 2 at once) with a REAL policy -- each warm worker starts
# the vLLM CPU build serving SmolLM2-135M-Instruct -- then merge the shards, print the reward profile summary and
# whether the per-task mean rewards have a spread (scripts/demo_spread.py), write the HTML report and print how
# long it all took.
#
# Usage: scripts/demo.sh [--stand-in | --policy-url URL [--model NAME] [--api-key-env VAR]] [--run-dir DIR] [OVERRIDE ...]
#   --stand-in         no policy needed (about a minute): collect examples/arith/config.yaml into runs/arith against
#                      the STAND-IN endpoint, the tests' fake server (tests/fakes/policy_server.py) on 127.0.0.1:$SHARDRUN_STAND_IN_PORT
#                      (default 18000): canned answers, right for a fixed share of (prompt, seed) pairs; NOT a model
#   --policy-url URL   use an existing OpenAI-compatible endpoint (.../v1) instead of starting vLLM per shard
#   --model NAME       model name to send there (default: the first id its /models lists)
#   --api-key-env VAR  NAME of the environment variable holding that endpoint's key
#   --run-dir DIR      where the run goes (default runs/demo-<timestamp>; an existing run dir is resumed)
#   OVERRIDE           Hydra overrides for the run config, e.g. num_repeats=2 cluster.array_parallelism=1
# Venvs and models are cached in $SHARDRUN_CACHE (default ~/.cache/shardrun): a second run starts at once.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
CONFIG=examples/arith/config-vllm.yaml
policy_url="" model="" key_env="" run_dir="" stand_in=""
overrides=()
while [ $# -gt 0 ]; do
  case "$1" in
    --policy-url) policy_url=${2:?--policy-url needs a URL}; shift 2 ;;
    --model) model=${2:?--model needs a name}; shift 2 ;;
    --api-key-env) key_env=${2:?--api-key-env needs a variable name}; shift 2 ;;
    --run-dir) run_dir=${2:?--run-dir needs a directory}; shift 2 ;;
    --stand-in) stand_in=1; shift ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) overrides+=("$1"); shift ;;
  esac
done
if [ -n "$stand_in" ] && [ -n "$policy_url" ]; then echo "--stand-in and --policy-url exclude each other" >&2; exit 2; fi
if [ -n "$stand_in" ]; then
  CONFIG=examples/arith/config.yaml  # the same run with a pre-hosted policy (run_dir runs/arith)
  run_dir=${run_dir:-runs/arith}
fi
run_dir=${run_dir:-runs/demo-$(date +%Y%m%d-%H%M%S)}
say() { printf '\n=== %s\n' "$*"; }
start=$(date +%s)
elapsed() { local s=$(( $(date +%s) - $1 )); printf '%d min %02d s' $(( s / 60 )) $(( s % 60 )); }

if [ -n "$stand_in" ]; then
  port=${SHARDRUN_STAND_IN_PORT:-18000}  # fixed: the URL is part of the plan, so a second run resumes the same run dir
  say "set-up: shardrun, NeMo Gym ${SHARDRUN_GYM_VERSION:-(the default version)} (policy: a STAND-IN, not a model)"
  ./scripts/setup.sh project gym
  mkdir -p "$(dirname "$run_dir")"
  stand_in_log="${run_dir%/}.stand-in.log"
  say "stand-in endpoint: tests/fakes/policy_server.py on http://127.0.0.1:$port/v1 (log: $stand_in_log)"
  echo "NOT a model: the tests' fake server answers each arithmetic question right for a fixed share (0.5) of"
  echo "(prompt, seed) pairs and calls the offered tool; rewards show the pipeline works, not how good a policy is"
  .venv/bin/python tests/fakes/policy_server.py --port "$port" --model stand-in-not-a-model >"$stand_in_log" 2>&1 &
  stand_in_pid=$!
  trap 'kill "$stand_in_pid" 2>/dev/null || true' EXIT
  .venv/bin/python - "$port" "$stand_in_pid" <<'PY' || { cat "$stand_in_log" >&2; exit 1; }
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
for _ in range(300):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        sys.exit(0)
    except OSError:
        if not os.path.exists(f"/proc/{pid}"):
            sys.exit(f"the stand-in endpoint exited (port {port} taken? set SHARDRUN_STAND_IN_PORT)")
        time.sleep(0.1)
sys.exit(f"the stand-in endpoint did not answer on port {port}")
PY
  overrides=("policy.base_url=http://127.0.0.1:$port/v1" "policy.model_name=stand-in-not-a-model" "${overrides[@]}")
elif [ -n "$policy_url" ]; then
  say "set-up: shardrun, NeMo Gym ${SHARDRUN_GYM_VERSION:-(the default version)} (policy: $policy_url)"
  ./scripts/setup.sh project gym
  policy_url=${policy_url%/}
  if [ -z "$model" ]; then
    model=$(.venv/bin/python - "$policy_url" "$key_env" <<'PY'
import json, os, sys, urllib.request
url, key = sys.argv[1], os.environ.get(sys.argv[2], "") if sys.argv[2] else ""
req = urllib.request.Request(url + "/models", headers={"Authorization": f"Bearer {key}"} if key else {})
print(json.load(urllib.request.urlopen(req, timeout=30))["data"][0]["id"])
PY
) || { echo "cannot list models at $policy_url/models; pass --model NAME" >&2; exit 2; }
  fi
  overrides=("~policy.vllm" "policy.base_url=$policy_url" "policy.model_name=$model"
             ${key_env:+"policy.api_key_env=$key_env"} "${overrides[@]}")
else
  say "set-up: shardrun, NeMo Gym ${SHARDRUN_GYM_VERSION:-(the default version)}, vLLM CPU build, SmolLM2-135M-Instruct (cached after the first run)"
  ./scripts/setup.sh project gym vllm models
fi

say "collect: shardrun submit $CONFIG run_dir=$run_dir ${overrides[*]}"
t0=$(date +%s)
.venv/bin/shardrun submit "$CONFIG" "run_dir=$run_dir" "${overrides[@]}"
echo "collected in $(elapsed "$t0")"

say "merge and profile: shardrun merge-and-profile $run_dir"
.venv/bin/shardrun merge-and-profile "$run_dir"

say "spread: the per-task mean rewards of $run_dir/merged/*_reward_profiling.jsonl"
spread=0
.venv/bin/python scripts/demo_spread.py "$run_dir"/merged/*_reward_profiling.jsonl || spread=$?

say "report: shardrun report $run_dir"
.venv/bin/shardrun report "$run_dir"

say "done in $(elapsed "$start"), set-up included: $run_dir/merged/report.html"
[ "$spread" -eq 0 ] || echo "warning: the profile has no spread (see 'spread' above)" >&2
