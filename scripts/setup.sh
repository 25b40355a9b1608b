#!/usr/bin/env bash
# Sets up a machine for mixprec and builds it: Debian packages where missing, a virtual
# environment (.venv), pip packages, and mixprec itself installed into the venv. Idempotent:
# a second run reuses everything and rebuilds only what changed (ccache, persistent build tree).
#
# Environment knobs:
#   MIXPREC_VENV                 venv folder (default .venv)
#   MIXPREC_TORCH_SPEC           pip requirement for torch when none in range is importable
#   MIXPREC_CUDA_ARCHITECTURES   CUDA architectures to build (default 80;90)
#   MIXPREC_CUDA                 AUTO (default), ON or OFF: build CUDA kernels (OFF skips even the nvcc check)
#   MIXPREC_BUILD_DIR            CMake build tree (default build/<wheel tag>, from pyproject.toml)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${MIXPREC_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_RANGE_CHECK='import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if (2, 11) <= v < (2, 15) else 1)'

START=$SECONDS
log() { printf '[setup %4ss] %s\n' "$((SECONDS - START))" "$*"; }

# --- 1. Debian packages: compiler, CMake, Ninja, ccache, GoogleTest, venv -------------------
missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v ccache >/dev/null || missing+=(ccache)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
"$PY" -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- 2. The virtual environment, reusing an installed torch in range ------------------------
if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c "$TORCH_RANGE_CHECK" 2>/dev/null; then
    log "creating $VENV on top of the installed torch"
    "$PY" -m venv --system-site-packages "$VENV"
  else
    log "creating $VENV"
    "$PY" -m venv "$VENV"
  fi
fi
VPY="$VENV/bin/python"

# --- 3. torch 2.11 to 2.14, and the build and test tools -------------------------------------
if ! "$VPY" -c "$TORCH_RANGE_CHECK" 2>/dev/null; then
  if [ -z "${MIXPREC_TORCH_SPEC:-}" ]; then
    # Without a GPU the CPU build suffices (and 2.13 is the release with a CPU wheel at hand);
    # with one, any release in range.
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
      MIXPREC_TORCH_SPEC="torch>=2.11,<2.15"
    else
      MIXPREC_TORCH_SPEC="torch>=2.11,<2.14"
    fi
  fi
  log "installing $MIXPREC_TORCH_SPEC (about 1-2 minutes from a local cache, longer to download)"
  "$VPY" -m pip install -q --progress-bar on "$MIXPREC_TORCH_SPEC"
fi
log "installing the build and test tools (scripts/requirements.txt)"
"$VPY" -m pip install -q -r scripts/requirements.txt
# The libraries of the real-model and integration tests (mixprec[bench] and mixprec[integrations]:
# tests/python/test_real_models.py, test_integrations_*.py), with torch pinned to the one installed:
# timm needs torchvision, whose newest release would otherwise replace torch. Optional: where they
# cannot be installed (no network), those tests skip and say why.
log "installing the real-model and integration test libraries (transformers, timm, lightning, accelerate)"
"$VPY" -m pip install -q "transformers>=4.45" "timm>=1.0" "lightning>=2.0" "accelerate>=0.26" \
  "torch==$("$VPY" -c 'import torch; print(torch.__version__)')" \
  || log "warning: transformers/timm/lightning/accelerate not installed; their tests will skip"

# --- 4. Build and install mixprec into the venv ----------------------------------------------
log "building mixprec (torch $("$VPY" -c 'import torch; print(torch.__version__)')): a first build takes" \
    "about 5 minutes on 2 cores (more with CUDA kernels), a rebuild seconds to a minute (ccache)"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
build_dir_arg=()
[ -n "${MIXPREC_BUILD_DIR:-}" ] && build_dir_arg=(-C "build-dir=$MIXPREC_BUILD_DIR")
# pip -v streams the build's output; only Ninja's "[done/total] what" lines are shown, as progress.
# The whole log is kept for when the build fails.
build_log=$(mktemp -t mixprec-build.XXXXXX.log)
if ! "$VPY" -m pip install -v --no-build-isolation --no-deps "${build_dir_arg[@]}" \
    -C "cmake.define.MIXPREC_CUDA_ARCHITECTURES=${MIXPREC_CUDA_ARCHITECTURES:-80;90}" \
    -C "cmake.define.MIXPREC_CUDA=${MIXPREC_CUDA:-AUTO}" . 2>&1 |
    tee "$build_log" | { grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\] ' || true; }; then
  tail -n 60 "$build_log"
  log "the build failed; its whole log: $build_log"
  exit 1
fi
rm -f "$build_log"
log "ready: source $VENV/bin/activate"
