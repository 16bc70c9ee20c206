#!/usr/bin/env bash
# Set up everything the suite needs (idempotent), then run the whole test suite. Extra arguments go to pytest.
#   ./scripts/test.sh             the whole suite (real NeMo Gym, vLLM CPU build, local Slurm)
#   ./scripts/test.sh --fast      the tier with no real Gym, Slurm or vLLM, less the fault-injection loops (marked
#                                 slow); project venv only
#   ./scripts/test.sh -m slurm    any pytest selection
#
# Tests run on $SHARDRUN_TEST_WORKERS pytest-xdist workers (default 2; 0: in this process), tests that share a
# cluster or a costly fixture on one worker (tests/conftest.py: xdist_group); `-n` among the arguments overrides it.
# The 25 slowest tests are printed at the end of every run (docs/architecture.md, Tests: the suite's time budget);
# `--durations` among the arguments overrides it.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
parallel=(-n "${SHARDRUN_TEST_WORKERS:-2}" --dist loadgroup)
durations=(--durations=25)
for arg in "$@"; do
  case "$arg" in
    -n | -n* | --numprocesses*) parallel=() ;;
    --durations*) durations=() ;;
  esac
done
if [ "${1:-}" = "--fast" ]; then
  shift
  ./scripts/setup.sh project
  echo "[test.sh] set-up took ${SECONDS} s" >&2
  exec .venv/bin/python -m pytest "${parallel[@]}" "${durations[@]}" -m "not gym and not vllm and not slurm and not slow" "$@"
fi
# gyms: every supported NeMo Gym version (the vs-Gym tests run against each); browser: Chromium and chromedriver
# (tests/analysis/test_report_browser.py opens a report in it)
./scripts/setup.sh project gyms vllm browser
echo "[test.sh] set-up took ${SECONDS} s" >&2
exec .venv/bin/python -m pytest "${parallel[@]}" "${durations[@]}" "$@"
