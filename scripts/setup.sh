#!/usr/bin/env bash
# Installs moeinf and its dependencies into the active Python environment (CPU build of torch).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --upgrade pip
# The CPU build of torch; an unpinned torch pulls a CUDA build of several GB.
python -m pip install "torch==2.13.0"
python -m pip install scikit-build-core pybind11 ninja
python -m pip install --no-build-isolation -e ".[serve,bench,test]"
