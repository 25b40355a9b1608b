// CUDA device code of the fused Adagrad step: one streaming pass that reads grad, weight and the
// squared-gradient sum once and writes weight (and model copy) and sum once (see kernels/adagrad.h).
#pragma once

#include "kernels/adagrad.h"
#include "kernels/multi_tensor.cuh"
#include "kernels/optim_common.cuh"

namespace mixprec::kernels {

// TP: model param storage, TG: grad storage; the sum is float32, the master float32 or a remainder.
template <typename TP, typename TG, bool kStoreGrad, int kPath>  // kStoreGrad, kPath: as AdamOp
struct AdagradOp {
  AdagradParams p;

  __device__ void operator()(const TensorTable<kAdagradLists>& table, const ChunkCtx& ctx) const {
    // A skipped step touches nothing: params, master, sums and the step count stay as they were.
    if (step_skipped(p.scalars)) return;
    const AdagradCoefficients c = adagrad_coefficients(p);
    // Fewer vectors in flight than SGD: IEEE division and square root take registers of their
    // own, and more than 8 elements a thread spill at the 64-register cap of two blocks per SM.
    constexpr int N = vec_elems<TP, TG, float>();
    constexpr int Ilp = N >= 8 ? 1 : 2;
    TP* param = chunk_ptr<TP>(table, ctx, kAdagradParam);
    TG* grad = chunk_ptr<TG>(table, ctx, kAdagradGrad);
    float* sum = chunk_ptr<float>(table, ctx, kAdagradStateSum);
    void* master = master_chunk<kPath>(p.weights, table, ctx);  // fp32 masters or 16-bit remainders
    const int n = ctx.n;
    const uint32_t key = chunk_rounding_key<kPath>(p.weights, p.scalars, ctx);  // stochastic rounding only
    const bool vec = ctx.vec_ok;
    for_each_vector_group<N, Ilp>(n, [&](int64_t base, int stride) {
      float g[Ilp][N], w[Ilp][N], h[Ilp][N];
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
        load<TG, N>(grad, i, n, vec, g[u]);
        load_weight<false, kPath, TP, N>(p.weights, param, master, i, n, vec, w[u]);
        load<float, N>(sum, i, n, vec, h[u]);
      }
      if constexpr (kStoreGrad) store_unscaled_grads<false>(grad, base, stride, n, vec, c.inv_scale, g);
#pragma unroll
      for (int u = 0; u < Ilp; ++u)
#pragma unroll
        for (int j = 0; j < N; ++j) adagrad_update(c, g[u][j], w[u][j], h[u][j]);
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
        store_weight<false, kPath, TP, N>(p.weights, key, ctx.begin, param, master, i, n, vec, w[u]);
        store<float, N>(sum, i, n, vec, h[u]);
      }
    });
  }
};

}  // namespace mixprec::kernels
