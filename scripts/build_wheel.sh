#!/usr/bin/env bash
# Build ddlscope's wheel into DIST_DIR (default ./dist) and print its path.
#
# It builds from a copy of the files a clone would have (tracked, plus new files git does not
# ignore), so a stale build/ folder or a local .venv never ends up in the wheel. pip builds it in
# an isolated environment with the build backend pyproject.toml names (setuptools), as `pip install .`
# does (BUILD_ISOLATION=0: with the setuptools of $PYTHON instead, offline).
# Usage: bash scripts/build_wheel.sh [DIST_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

DIST=$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
SRC=$(mktemp -d "${TMPDIR:-/tmp}/ddlscope-src.XXXXXX")
trap 'rm -rf "$SRC"' EXIT

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    # files deleted in the work tree but still tracked are skipped
    git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done \
        | tar --null -T - -cf - | tar -xf - -C "$SRC"
else
    tar --exclude=./.venv --exclude=./build --exclude=./dist --exclude='*.egg-info' -cf - . | tar -xf - -C "$SRC"
fi
rm -f "$DIST"/ddlscope-*.whl
ISOLATION=$( [ "${BUILD_ISOLATION:-1}" = 0 ] && echo --no-build-isolation || true )
"$PYTHON" -m pip wheel --quiet --no-deps $ISOLATION --wheel-dir "$DIST" "$SRC" >&2
ls "$DIST"/ddlscope-*.whl
