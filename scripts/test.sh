#!/usr/bin/env bash
# Runs every mixprec test: sets up (scripts/setup.sh), lints the Python (ruff), checks the C++ formatting
# (clang-format), then the GoogleTest suite built against the installed CMake package, then the Python
# tests. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VENV=${MIXPREC_VENV:-.venv}
# shellcheck disable=SC1091
source "$VENV/bin/activate"

# The Python linter first: it takes a second and fails before the long builds (config: pyproject.toml).
ruff check .
# The C++ and CUDA formatting (.clang-format, with the clang-format pinned in scripts/requirements.txt).
find csrc tests/cpp examples/cpp benchmarks/cpp -type f \( -name '*.h' -o -name '*.cpp' -o -name '*.cuh' -o -name '*.cu' \) \
  -print0 | xargs -0 clang-format --dry-run --Werror

prefix=$(python -c 'import mixprec, torch; print(mixprec.cmake_prefix_path + ";" + torch.utils.cmake_prefix_path)')
CPP_TEST_BUILD=${MIXPREC_CPP_TEST_BUILD_DIR:-build/tests-cpp}
cmake -S tests/cpp -B "$CPP_TEST_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$CPP_TEST_BUILD"  # also builds mixprec_conformance, the C++ half of test_conformance.py
ctest --test-dir "$CPP_TEST_BUILD" --output-on-failure
MIXPREC_CONFORMANCE_DRIVER="$(cd "$CPP_TEST_BUILD" && pwd)/mixprec_conformance"
export MIXPREC_CONFORMANCE_DRIVER

# The C++ example and benchmark, each its own CMake project built against the installed package as
# a LibTorch user's would be. The example trains briefly (on the CPU here) and fails if the loss
# does not fall; the benchmark is only built (timings come from GPU runs: benchmarks/cpp/adamw_step).
CPP_EXAMPLE_BUILD=${MIXPREC_CPP_EXAMPLE_BUILD_DIR:-build/examples-cpp}
cmake -S examples/cpp -B "$CPP_EXAMPLE_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$CPP_EXAMPLE_BUILD"
"$CPP_EXAMPLE_BUILD/train_amp" --steps 60
CPP_BENCH_BUILD=${MIXPREC_CPP_BENCH_BUILD_DIR:-build/benchmarks-cpp}
cmake -S benchmarks/cpp -B "$CPP_BENCH_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$CPP_BENCH_BUILD"

python -m pytest -q "$@"
