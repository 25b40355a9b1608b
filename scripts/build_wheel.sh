#!/usr/bin/env bash
# Builds a mixprec wheel for the torch of the Python that runs it (default: .venv, made by
# scripts/setup.sh), into dist/ or the folder given. The wheel works with that torch version only:
# mixprec's C++ library is compiled against torch's ABI, and `import mixprec` refuses another.
#
# Usage: scripts/build_wheel.sh [OUT_DIR]        (PYTHON=/path/to/python to pick the environment)
# Knobs as scripts/setup.sh: MIXPREC_CUDA, MIXPREC_CUDA_ARCHITECTURES, MIXPREC_BUILD_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-${MIXPREC_VENV:-.venv}/bin/python}
OUT=${1:-dist}
if ! "$PY" -c 'import torch, scikit_build_core' 2>/dev/null; then
  echo "build_wheel: $PY lacks torch or scikit-build-core; run scripts/setup.sh first or set PYTHON" >&2
  exit 2
fi
torch_version=$("$PY" -c 'import torch; print(torch.__version__)')
build_dir_arg=()
[ -n "${MIXPREC_BUILD_DIR:-}" ] && build_dir_arg=(-C "build-dir=$MIXPREC_BUILD_DIR")
echo "[build_wheel] building against torch $torch_version into $OUT/"
"$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$OUT" "${build_dir_arg[@]}" \
  -C "cmake.define.MIXPREC_CUDA_ARCHITECTURES=${MIXPREC_CUDA_ARCHITECTURES:-80;90}" \
  -C "cmake.define.MIXPREC_CUDA=${MIXPREC_CUDA:-AUTO}" .
version=$("$PY" -c 'import re, pathlib; print(re.search(r"__version__ = \"([^\"]+)\"", pathlib.Path("python/mixprec/__init__.py").read_text()).group(1))')
wheel=$(ls -t "$OUT"/mixprec-"$version"-*.whl | head -n 1)
echo "[build_wheel] $wheel (for torch $torch_version only)"
