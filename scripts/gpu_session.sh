#!/usr/bin/env bash
# One batched session on a GPU machine (the H200 device tool): build for one architecture, run
# every test including the CUDA ones, the benchmarks and a compute-sanitizer pass, logging under
# $OUT (default ./out). Uses the machine's python3 and its torch; nothing is downloaded.
#   usage: scripts/gpu_session.sh [build] [cpp] [tests] [bench] [sanitize] [e2e] [dist] [models] [compare]
#          [lean] [apex]   (default: all but models, compare, lean and apex)
#   env: TEST_PATHS, PYTEST_ARGS (tests); BENCH_SCRIPTS (bench: which of loss_scale optimizer cpp
#   overhead xent layers grid, default all but grid), BENCH_OPT_ARGS; SANITIZE_K; E2E_ARGS (e2e); DIST_ARGS
#   (dist: the distributed CUDA tests, gloo ranks sharing the GPUs and NCCL on 2+, then
#   benchmarks/e2e_distributed.py at 1 rank and at every GPU); STEP_TIMEOUT
#   (s, per step); MODELS_ARGS (models: benchmarks/real_models.py); COMPARE_ARGS (compare: `mixprec
#   compare --modes all` on its embedded task, with its plot and table); LEAN_ARGS (lean:
#   benchmarks/lean_capacity.py after e2e_gpt2.py's lean variants); apex: scripts/run_apex_l0.sh. "grid" reruns
#   loss_scale_ops.py with one block per chunk for persistent ops (MIXPREC_PERSISTENT_GRID=chunks),
#   to compare with the default resident-sized grid.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-build cpp tests bench sanitize e2e dist}
PY=${PYTHON:-python3}
ARCH=${MIXPREC_CUDA_ARCHITECTURES:-90}

run() {  # run NAME CMD...: log to $OUT/NAME.log, print the tail, keep going on failure
  local name=$1; shift
  local t0=$SECONDS
  timeout "${STEP_TIMEOUT:-3000}" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc ($((SECONDS - t0)) s)"
  tail -n 25 "$OUT/$name.log"
  return $rc
}

{ nvidia-smi -L; $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } 2>&1

if [[ $steps == *build* ]]; then
  export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
  run build $PY -m pip install --no-build-isolation --no-deps -v -C build-dir=build/gpu-sm$ARCH \
    -C cmake.define.MIXPREC_CUDA=ON -C "cmake.define.MIXPREC_CUDA_ARCHITECTURES=$ARCH" . || exit 1
fi
if [[ $steps == *cpp* ]]; then
  prefix=$(cd /tmp && $PY -c 'import mixprec, torch; print(mixprec.cmake_prefix_path + ";" + torch.utils.cmake_prefix_path)')
  # The GPU machine has no GoogleTest package: build it from a carried source tree when present
  # (.gtest-src, a copy of Debian's /usr/src/googletest; ignored by git, carried by the device tool).
  gtest=""; [ -d .gtest-src ] && gtest="-DMIXPREC_GTEST_SOURCE_DIR=$PWD/.gtest-src"
  run cpp bash -c "cmake -S tests/cpp -B /tmp/mixprec-cpptests -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH='$prefix' $gtest && cmake --build /tmp/mixprec-cpptests && \
    ctest --test-dir /tmp/mixprec-cpptests --output-on-failure"
  run cppexample bash -c "cmake -S examples/cpp -B /tmp/mixprec-example -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH='$prefix' && cmake --build /tmp/mixprec-example && /tmp/mixprec-example/train_amp && \
    cmake -S benchmarks/cpp -B /tmp/mixprec-cppbench -G Ninja -DCMAKE_PREFIX_PATH='$prefix' && \
    cmake --build /tmp/mixprec-cppbench"
fi
if [[ $steps == *tests* ]]; then
  run tests $PY -m pytest ${TEST_PATHS:-tests/python} -v -rs --timeout=900 -p no:cacheprovider ${PYTEST_ARGS:-}
fi
if [[ $steps == *bench* ]]; then
  # One log for every benchmark: the device tool returns at most 8 files.
  scripts=${BENCH_SCRIPTS:-loss_scale optimizer cpp overhead xent layers}
  run bench bash -c "
    [[ '$scripts' == *loss_scale* ]] && $PY benchmarks/loss_scale_ops.py --out $OUT/loss_scale_ops.json
    [[ '$scripts' == *grid* ]] && MIXPREC_PERSISTENT_GRID=chunks $PY benchmarks/loss_scale_ops.py --out $OUT/loss_scale_ops_chunks.json
    [[ '$scripts' == *optimizer* ]] && $PY benchmarks/optimizer_step.py --out $OUT/optimizer_step.json ${BENCH_OPT_ARGS:-}
    [[ '$scripts' == *cpp* && -x /tmp/mixprec-cppbench/adamw_step ]] && /tmp/mixprec-cppbench/adamw_step && /tmp/mixprec-cppbench/adamw_step --o2
    [[ '$scripts' == *xent* ]] && $PY benchmarks/cross_entropy.py --out $OUT/cross_entropy.json
    [[ '$scripts' == *layers* ]] && $PY benchmarks/layer_kernels.py --out $OUT/layer_kernels.json
    [[ '$scripts' == *overhead* && -f benchmarks/amp_overhead.py ]] && $PY benchmarks/amp_overhead.py --profile --out $OUT/amp_overhead.json
    true"
fi
if [[ $steps == *sanitize* ]]; then
  run sanitize compute-sanitizer --tool memcheck --error-exitcode 3 \
    $PY -m pytest ${TEST_PATHS:-tests/python} -q -x -m cuda -k "${SANITIZE_K:-loss_scale or update_scale or norm or adam}" -p no:cacheprovider
fi
if [[ $steps == *e2e* ]]; then
  run e2e $PY benchmarks/e2e_gpt2.py --out "$OUT/e2e.json" ${E2E_ARGS:-}
fi
if [[ $steps == *dist* ]]; then
  # NVLink multicast off in every rank (the lent machines lack it); the scripts set it too.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  run dist bash -c "$PY -m pytest tests/python/test_distributed_ddp.py tests/python/test_distributed_fsdp.py \
      -m cuda -q -rs -p no:cacheprovider -n 8 -p xdist; \
    $PY benchmarks/e2e_distributed.py --out $OUT/e2e_distributed.json ${DIST_ARGS:-}"
fi
if [[ $steps == *models* ]]; then
  run models $PY benchmarks/real_models.py --json "$OUT/real_models.json" --markdown "$OUT/real_models.md" ${MODELS_ARGS:-}
fi
if [[ $steps == *compare* ]]; then
  run compare $PY -m mixprec compare --modes all --out "$OUT/compare" --no-progress ${COMPARE_ARGS:-}
fi
if [[ $steps == *lean* ]]; then
  # Issue 24's bars: GPT-2 large in bf16 with torch.amp, O2 and the lean modes (peak memory, speed),
  # then the deepest width-1600 model each trains.
  run lean bash -c "$PY benchmarks/e2e_gpt2.py --sizes large --out $OUT/e2e_lean.json --variants \
      torch-bf16,mixprec-o2-bf16,mixprec-o2-bf16-rem,mixprec-o2-bf16-rem-bf16m,mixprec-o2-bf16-rem-q8,mixprec-o3-bf16-sr; \
    $PY benchmarks/lean_capacity.py --out $OUT/lean_capacity.json ${LEAN_ARGS:-}"
fi
if [[ $steps == *apex* ]]; then
  # Apex's own L0 tests through the alias (the git-ignored .apex-tests/ must be carried).
  run apex env OUT="$OUT" PY="$PY" scripts/run_apex_l0.sh
fi
