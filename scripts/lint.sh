#!/usr/bin/env bash
# The code checks CI runs before the tests: lint, format, types, and the stage contract of docs/architecture.md.
#   ./scripts/lint.sh        sets up the project venv if needed, then runs each check and fails on the first finding
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
./scripts/setup.sh project
step() { echo "[lint] $*" >&2; "$@"; }
step .venv/bin/ruff check .
step .venv/bin/ruff format --check .
step .venv/bin/mypy
step .venv/bin/lint-imports
