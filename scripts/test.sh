#!/usr/bin/env bash
# Set up everything the suite needs (idempotent), then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
./scripts/setup.sh project gym vllm
exec .venv/bin/python -m pytest "$@"
