// CUDA device code of the loss-scaling family: the fused non-finite check and unscale over a
// tensor group, and the single-thread dynamic scale update (no host synchronization anywhere).
#pragma once

#include "kernels/loss_scale.h"
#include "kernels/multi_tensor.cuh"

namespace mixprec::kernels {

// One pass per chunk: read each gradient once, flag non-finite values (tested before scaling,
// as torch does), and when asked write g * inv_scale to the output list (in place or another
// dtype). The check-only form (NLists == 1, no scale) reads and never writes. Chunk: elements per
// chunk (the launcher's default, or a multiple of it: see loss_scale.cu).
template <int NLists, typename TIn, typename TOut, int64_t Chunk = kChunkElems>
struct UnscaleOp {
  static constexpr int64_t kChunk = Chunk;
  float* found_inf;
  const float* inv_scale;
  float* per_tensor_found;

  __device__ void operator()(const TensorTable<NLists>& table, const ChunkCtx& c) const {
    constexpr int N = vec_elems<TIn, TOut>();
    const TIn* in = chunk_ptr<TIn>(table, c, 0);
    const float s = inv_scale != nullptr ? *inv_scale : 1.f;
    bool bad = false;
    for_each_vector_group<N>(c.n, [&](int64_t base, int stride) {
      float x[kIlp][N];
#pragma unroll
      for (int u = 0; u < kIlp; ++u) load<TIn, N>(in, base + u * stride, c.n, c.vec_ok, x[u]);
#pragma unroll
      for (int u = 0; u < kIlp; ++u) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
          bad |= !is_finite(x[u][j]);
          x[u][j] *= s;
        }
      }
      if constexpr (NLists == 2) {
        TOut* out = chunk_ptr<TOut>(table, c, 1);
#pragma unroll
        for (int u = 0; u < kIlp; ++u) store<TOut, N>(out, base + u * stride, c.n, c.vec_ok, x[u]);
      }
    });
    // Each thread that saw a non-finite value raises the flags itself: every writer stores the
    // same value, so the race is benign, and no block-wide vote is needed. A vote
    // (__syncthreads_or) per chunk made every block drain its loads at each chunk's end: with
    // fp16's four vector iterations per chunk that bubble cost ~8% of copy bandwidth (82.7% ->
    // see benchmarks/RESULTS.md), and the read-only check lost more.
    if (bad) {
      if (found_inf != nullptr) *found_inf = 1.f;
      if (per_tensor_found != nullptr) per_tensor_found[c.arg_index] = 1.f;
    }
  }
};

}  // namespace mixprec::kernels
