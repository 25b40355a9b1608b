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
CPP_TEST_BUILD=${MIXPREC_CPP_TEST_BUILD_DIR:-build/tests-cpp}
cmake -S tests/cpp -B "$CPP_TEST_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$CPP_TEST_BUILD"
ctest --test-dir "$CPP_TEST_BUILD" --output-on-failure

python -m pytest -q "$@"
