// CUDA device side of what every fused optimizer shares (kernels/optim_common.h): the write-back
// of unscaled gradients under a grad_scale.
#pragma once

#include <type_traits>

#include "kernels/multi_tensor.cuh"
#include "kernels/optim_common.h"

namespace mixprec::kernels {

// stores_unscaled_grads on CUDA, called right after a vector group's loads: g * inv_scale (the
// product the update forms, so the same bits) goes back to memory from a temporary, and no
// register holds it past the update. (Stored after the update with the other results, the
// unscaled grads stayed live across it: nvcc 13 then spilled 260 more bytes in SGD's fp16 step.)
// kPacked: the grads' accesses go through store_packed (Adam's choice, see multi_tensor.cuh).
template <bool kPacked, typename TG, int N, int Ilp>
__device__ __forceinline__ void store_unscaled_grads(TG* grad, int64_t base, int stride, int n, bool vec,
                                                     float inv_scale, const float (&g)[Ilp][N]) {
#pragma unroll
  for (int u = 0; u < Ilp; ++u) {
    float unscaled[N];
#pragma unroll
    for (int j = 0; j < N; ++j) unscaled[j] = g[u][j] * inv_scale;
    if constexpr (kPacked) store_packed<TG, N>(grad, base + u * stride, n, vec, unscaled);
    else store<TG, N>(grad, base + u * stride, n, vec, unscaled);
  }
}

// Calls f(std::bool_constant<stores_unscaled_grads(s)>{}): the kernel instance for the step.
template <typename F> void dispatch_store_grads(const StepScalars& s, F&& f) {
  if (stores_unscaled_grads(s)) f(std::true_type{});
  else f(std::false_type{});
}

}  // namespace mixprec::kernels
