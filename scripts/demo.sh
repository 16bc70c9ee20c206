#!/usr/bin/env bash
# The main job on a fresh machine: set up, then plan the bundled example into runs/arith.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
./scripts/setup.sh project
.venv/bin/shardrun plan examples/arith/plan-only.yaml --write
