#!/usr/bin/env bash
# Set up ddlscope in ./.venv: PyTorch 2.13.0 (the CPU wheel here; a CUDA build where your index
# provides one), hivemind, and ddlscope itself with its test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "ddlscope needs Python >= 3.11")'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# torch first, pinned, so that nothing later pulls a different (multi-GB CUDA) build
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"
python -c 'import torch, hivemind, ddlscope; print(f"ddlscope {ddlscope.__version__}: torch {torch.__version__}, hivemind {hivemind.__version__}")'
