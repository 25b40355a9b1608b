// CUDA kernels of the bias gradient (kernels/bias_grad.h). Pass 1: a block owns a tile of columns
// (32 lanes x one 16-byte vector each) and a split of the rows; 8 row groups of 32 lanes walk
// the split's rows (each warp reads 512 contiguous bytes of one row), their fp32 sums are added
// in shared memory and written as the split's partials. Pass 2 (column_sum.cuh) adds each
// column's partials in a fixed order and rounds once, so the result is deterministic.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/bias_grad.h"
#include "kernels/column_sum.cuh"
#include "kernels/multi_tensor.cuh"

namespace mixprec::kernels {
namespace {

constexpr int kLanes = 32;     // threads across a column tile
constexpr int kRowGroups = 8;  // threads down the rows
constexpr int kMaxVector = 8;  // elements in a 16-byte vector of 2-byte values
// Each thread of pass 1 reads at least this many rows: with 4 loads in flight per thread, fewer
// would not hide the memory latency, and more splits only lengthen pass 2. (An H200 measured
// 14.6 us for a 4096 x 1280 fp16 sum with 4 rows per thread and one pass-2 thread per column
// walking 106 splits; torch's sum(0) took 13.6.)
constexpr int kMinRowsPerThread = 16;
constexpr int kBlocksPerSM = 4;  // the grid pass 1 aims for

template <typename T>
__global__ void __launch_bounds__(kLanes* kRowGroups) bias_grad_partials_kernel(const BiasGradParams p, bool vec_ok) {
  constexpr int V = vec_elems<T>();
  const int lane = threadIdx.x, group = threadIdx.y;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kLanes * V;
  const int64_t col = tile + static_cast<int64_t>(lane) * V;
  const int64_t per_split = (p.rows + p.splits - 1) / p.splits;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * per_split;
  const int64_t row_end = std::min<int64_t>(p.rows, row_begin + per_split);
  const int n = static_cast<int>(p.cols);  // the ops tier keeps cols below 2^31
  const T* g = static_cast<const T*>(p.grad);

  float acc[V] = {};
  if (col < p.cols) {
#pragma unroll 4
    for (int64_t r = row_begin + group; r < row_end; r += kRowGroups) {
      float v[V];
      load<T, V>(g + r * p.cols, col, n, vec_ok, v);  // zero past the last column
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += v[j];
    }
  }
  __shared__ float sums[kRowGroups][kLanes * kMaxVector];
#pragma unroll
  for (int j = 0; j < V; ++j) sums[group][lane * V + j] = acc[j];
  __syncthreads();
  const int t = group * kLanes + lane;  // the block's 256 threads cover the tile's kLanes * V columns
  if (t < kLanes * V && tile + t < p.cols) {
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < kRowGroups; ++k) s += sums[k][t];
    p.partials[static_cast<int64_t>(blockIdx.y) * p.cols + tile + t] = s;
  }
}

int64_t column_tiles(DType dtype, int64_t cols) {
  const int64_t per_tile = kLanes * vector_elems(dtype);
  return (cols + per_tile - 1) / per_tile;
}

}  // namespace

int64_t bias_grad_cuda_splits(DType dtype, int64_t rows, int64_t cols) {
  if (rows == 0 || cols == 0) return 1;
  const int64_t want = (static_cast<int64_t>(kBlocksPerSM) * current_sm_count() + column_tiles(dtype, cols) - 1) /
                       column_tiles(dtype, cols);
  const int64_t most = std::max<int64_t>(1, rows / (kRowGroups * kMinRowsPerThread));
  return std::clamp<int64_t>(want, 1, std::min<int64_t>(most, 65535));  // gridDim.y's limit
}

void bias_grad_cuda(const BiasGradParams& p, Stream stream) {
  if (p.cols == 0) return;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vec_ok = reinterpret_cast<uintptr_t>(p.grad) % 16 == 0 && (p.cols * sizeof(T)) % 16 == 0;
    const dim3 grid(static_cast<unsigned>(column_tiles(p.dtype, p.cols)), static_cast<unsigned>(p.splits));
    bias_grad_partials_kernel<T><<<grid, dim3(kLanes, kRowGroups), 0, stream>>>(p, vec_ok);
    MIXPREC_CUDA_CHECK(cudaGetLastError());
    ColumnFinish finish;
    finish.partials = p.partials;
    finish.splits = p.splits;
    finish.cols = p.cols;
    finish.out[0] = p.out;
    launch_column_finish<T>(finish, 1, stream);
  });
}

}  // namespace mixprec::kernels
