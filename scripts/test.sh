#!/usr/bin/env bash
# Runs every mixprec test: sets up (scripts/setup.sh), then the GoogleTest suite built against
# the installed CMake package, then the Python tests. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VENV=${MIXPREC_VENV:-.venv}
# shellcheck disable=SC1091
source "$VENV/bin/activate"

prefix=$(python -c 'import mixprec, torch; print(mixprec.cmake_prefix_path + ";" + torch.utils.cmake_prefix_path)')
cmake -S tests/cpp -B build/tests-cpp -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build/tests-cpp
ctest --test-dir build/tests-cpp --output-on-failure

python -m pytest -q "$@"
