#!/usr/bin/env bash
# The package as a user gets it: install ddlscope's wheel into a fresh virtual environment that
# already has torch 2.13.0 (the oldest torch pyproject.toml allows; the CPU wheel here), check that
# pip kept that torch, and run the main job from a folder outside the source tree.
#
# Usage: bash scripts/check_wheel.sh [WHEEL]   (no WHEEL: scripts/build_wheel.sh builds one)
# Environment: QUICKSTART_ARGS: options added to the main job, `ddlscope quickstart` (default none:
# exactly as the README runs it, about 3 minutes on 2 idle cores; "--model tiny_cnn" for a quick
# check in seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PYTHON=${PYTHON:-python3}
TORCH_OLDEST=${TORCH_OLDEST:-2.13.0}  # the bottom of pyproject.toml's torch range (and scripts/setup.sh's torch)
QUICKSTART_ARGS=${QUICKSTART_ARGS-}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/ddlscope-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
WHEEL=${1:-$(bash scripts/build_wheel.sh "$WORK/dist")}
WHEEL=$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")

"$PYTHON" -m venv "$WORK/venv"
V="$WORK/venv/bin"
"$V/python" -m pip install --quiet --upgrade pip
"$V/python" -m pip install --quiet "torch==$TORCH_OLDEST"
"$V/python" -m pip install --quiet "$WHEEL"
"$V/python" -m pip check

mkdir "$WORK/elsewhere" && cd "$WORK/elsewhere"   # no ddlscope/ and no examples/ here
env -u PYTHONPATH "$V/python" - "$REPO" "$TORCH_OLDEST" <<'EOF'
import sys
from pathlib import Path

import ddlscope, hivemind, torch

repo, torch_wanted = Path(sys.argv[1]).resolve(), sys.argv[2]
where = Path(ddlscope.__file__).resolve()
assert repo not in where.parents, f"ddlscope imported from the source tree ({where}), not from the wheel"
assert torch.__version__.split("+")[0] == torch_wanted, f"installing the wheel replaced torch {torch_wanted} with {torch.__version__}"
print(f"wheel install: ddlscope {ddlscope.__version__} from {where.parent}, torch {torch.__version__}, hivemind {hivemind.__version__}")
EOF

export PATH="$V:$PATH"
ddlscope examples
ddlscope examples --copy copied >/dev/null
ls copied/cluster-2x4xa100.toml copied/peers-tbs.toml >/dev/null
# a path examples/NAME that is not here is read from the shipped copy (the README's commands)
ddlscope sweep examples/peers-tbs.toml --dry-run >/dev/null
# shellcheck disable=SC2086  # QUICKSTART_ARGS is a list of options
ddlscope quickstart --no-progress $QUICKSTART_ARGS
ls ddlscope-results/reports/quickstart-*/report.html >/dev/null
echo "wheel check passed: $(basename "$WHEEL")"
