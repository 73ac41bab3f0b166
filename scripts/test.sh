#!/usr/bin/env bash
# The test suite (CPU; tests marked gpu skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q "$@"
