#!/usr/bin/env bash
# Set up everything the suite needs (idempotent), then run the whole test suite. Extra arguments go to pytest.
#   ./scripts/test.sh             the whole suite (real NeMo Gym, vLLM CPU build, local Slurm)
#   ./scripts/test.sh --fast      the tier with no real Gym, Slurm or vLLM, less the fault-injection loops (marked
#                                 slow); project venv only
#   ./scripts/test.sh -m slurm    any pytest selection
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
if [ "${1:-}" = "--fast" ]; then
  shift
  ./scripts/setup.sh project
  exec .venv/bin/python -m pytest -m "not gym and not vllm and not slurm and not slow" "$@"
fi
./scripts/setup.sh project gyms vllm  # gyms: every supported NeMo Gym version (the vs-Gym tests run against each)
exec .venv/bin/python -m pytest "$@"
