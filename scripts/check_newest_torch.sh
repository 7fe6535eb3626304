#!/usr/bin/env bash
# The newest torch pyproject.toml allows: a fresh virtual environment with torch 2.14.1 (where the
# index has it: a CUDA build, about 5.5 GB with its nvidia wheels, which also runs on CPU), ddlscope's
# wheel installed on top (pip must keep that torch), then the tests of the parts that lean hardest on
# torch and hivemind: DDP, FSDP2 and the pipeline schedules against `single`, two torchrun nodes, the
# model zoo, the MoE layers against hivemind's, a single and a collaborative (hivemind) run.
# The tests import the source tree's ddlscope (the same code as the wheel).
#
# Usage: bash scripts/check_newest_torch.sh [WHEEL]   (no WHEEL: scripts/build_wheel.sh builds one)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_NEWEST=${TORCH_NEWEST:-2.14.1}  # the top of pyproject.toml's torch range; another: widen the range first
TESTS=(tests/test_distributed.py tests/test_models.py tests/test_moe_layers.py
       tests/test_integration.py::test_single_run_records_every_step
       tests/test_integration.py::test_collaborative_run_averages_with_both_peers)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ddlscope-torch.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
WHEEL=${1:-$(bash scripts/build_wheel.sh "$WORK/dist")}

"$PYTHON" -m venv "$WORK/venv"
V="$WORK/venv/bin"
"$V/python" -m pip install --quiet --upgrade pip
"$V/python" -m pip install --quiet "torch==$TORCH_NEWEST"
"$V/python" -m pip install --quiet "$WHEEL" "pytest>=8"
"$V/python" -m pip check
"$V/python" -c "import sys, torch; v = torch.__version__.split('+')[0]; sys.exit(0 if v == sys.argv[1] else f'installing the wheel replaced torch {sys.argv[1]} with {torch.__version__}'); " "$TORCH_NEWEST"
"$V/python" -c "import torch, hivemind; print(f'newest torch: torch {torch.__version__}, hivemind {hivemind.__version__}')"
"$V/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
