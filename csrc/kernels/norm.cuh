// CUDA device code of the multi-tensor norm: per-chunk partials in one pass over the data, then
// per-tensor and total norms reduced from the partials in a fixed order, so results are
// deterministic run to run (no float atomics).
#pragma once

#include "kernels/multi_tensor.cuh"
#include "kernels/norm.h"

namespace mixprec::kernels {

__device__ __forceinline__ float norm_combine(NormType type, float acc, float x) {
  return type == NormType::kL2 ? fmaf(x, x, acc) : nan_max(acc, fabsf(x));
}

template <typename T> struct NormPartialOp {
  NormType type;
  float* partials;

  __device__ void operator()(const TensorTable<1>& table, const ChunkCtx& c) const {
    constexpr int N = vec_elems<T>();
    const T* in = chunk_ptr<T>(table, c, 0);
    float acc[kIlp] = {};  // one accumulator per vector in flight keeps the FMAs independent
    for_each_vector_group<N>(c.n, [&](int64_t base, int stride) {
      float x[kIlp][N];
#pragma unroll
      for (int u = 0; u < kIlp; ++u) load<T, N>(in, base + u * stride, c.n, c.vec_ok, x[u]);
#pragma unroll
      for (int u = 0; u < kIlp; ++u)
#pragma unroll
        for (int j = 0; j < N; ++j) acc[u] = norm_combine(type, acc[u], x[u][j]);
    });
    float a = acc[0];
#pragma unroll
    for (int u = 1; u < kIlp; ++u) a = type == NormType::kL2 ? a + acc[u] : nan_max(a, acc[u]);
    a = type == NormType::kL2 ? block_reduce_sum(a) : block_reduce_max(a);
    if (threadIdx.x == 0) partials[c.global_chunk] = a;
  }
};

// Reduces partials[begin, end) with the whole block in a fixed order.
__device__ __forceinline__ float reduce_partials(NormType type, const float* partials, int64_t begin, int64_t end) {
  float a = 0.f;
  for (int64_t i = begin + threadIdx.x; i < end; i += kBlockThreads)
    a = type == NormType::kL2 ? a + partials[i] : nan_max(a, partials[i]);
  return type == NormType::kL2 ? block_reduce_sum(a) : block_reduce_max(a);
}

__device__ __forceinline__ float finish_norm(NormType type, float a) { return type == NormType::kL2 ? sqrtf(a) : a; }

// One block per tensor of the table.
__global__ void __launch_bounds__(kBlockThreads)
    norm_per_tensor_kernel(const __grid_constant__ TensorTable<0> table, NormType type, const float* partials,
                           float* per_tensor) {
  const int t = blockIdx.x;
  const int64_t first = table.first_chunk[t];
  const float a = reduce_partials(type, partials, first, first + num_chunks(table.numel[t]));
  if (threadIdx.x == 0) per_tensor[table.arg_index[t]] = finish_norm(type, a);
}

__global__ void __launch_bounds__(kBlockThreads)
    norm_total_kernel(NormType type, const float* partials, int64_t total_chunks, float* total) {
  const float a = reduce_partials(type, partials, 0, total_chunks);
  if (threadIdx.x == 0) *total = finish_norm(type, a);
}

}  // namespace mixprec::kernels
