// CUDA device code of the fused Adam/AdamW step: one streaming pass over grads, weights and
// moments; reads each operand once and writes each result once (see kernels/adam.h).
#pragma once

#include "kernels/adam.h"
#include "kernels/multi_tensor.cuh"
#include "kernels/optim_common.cuh"

namespace mixprec::kernels {

// TP: model param storage, TG: grad storage, TS: moment storage (float or bf16); kStoreGrad:
// stores_unscaled_grads (an instance of its own, so steps without a grad_scale keep their registers).
// kPath: the weight path (WeightPath, optim_common.cuh).
template <typename TP, typename TG, typename TS, bool kStoreGrad, int kPath> struct AdamOp {
  static constexpr bool kPersistent = false;  // see multi_tensor_kernel: a chunk loop would spill
  AdamParams p;

  __device__ void operator()(const TensorTable<kAdamLists>& table, const ChunkCtx& ctx) const {
    // A skipped step touches nothing: params, master, moments and the step count stay as they were.
    if (step_skipped(p.scalars)) return;
    const AdamCoefficients c = adam_coefficients(p);
    // 16 bytes of the narrowest operand per vector; two vectors in flight per list when they are
    // 16 bytes wide (fp32 everywhere), one when fp32 lists take two words each.
    constexpr int N = vec_elems<TP, TG, TS, float>();
    constexpr int Ilp = N >= 8 ? 1 : 2;
    TP* param = chunk_ptr<TP>(table, ctx, kAdamParam);
    TG* grad = chunk_ptr<TG>(table, ctx, kAdamGrad);
    TS* exp_avg = chunk_ptr<TS>(table, ctx, kAdamExpAvg);
    TS* exp_avg_sq = chunk_ptr<TS>(table, ctx, kAdamExpAvgSq);
    TS* max_exp_avg_sq = chunk_ptr<TS>(table, ctx, kAdamMaxExpAvgSq);
    void* master = master_chunk<kPath>(p.weights, table, ctx);  // fp32 masters or 16-bit remainders
    const int n = ctx.n;
    const uint32_t key = chunk_rounding_key<kPath>(p.weights, p.scalars, ctx);  // stochastic rounding only
    const bool vec = ctx.vec_ok;
    for_each_vector_group<N, Ilp>(n, [&](int64_t base, int stride) {
      float g[Ilp][N], w[Ilp][N], m[Ilp][N], v[Ilp][N], vm[Ilp][N];
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
        load_packed<TG, N>(grad, i, n, vec, g[u]);
        load_weight<true, kPath, TP, N>(p.weights, param, master, i, n, vec, w[u]);
        load_packed<TS, N>(exp_avg, i, n, vec, m[u]);
        load_packed<TS, N>(exp_avg_sq, i, n, vec, v[u]);
        if (p.amsgrad) load_packed<TS, N>(max_exp_avg_sq, i, n, vec, vm[u]);
      }
      if constexpr (kStoreGrad) store_unscaled_grads<true>(grad, base, stride, n, vec, c.inv_scale, g);
#pragma unroll
      for (int u = 0; u < Ilp; ++u)
#pragma unroll
        for (int j = 0; j < N; ++j) adam_update(c, g[u][j], w[u][j], m[u][j], v[u][j], vm[u][j]);
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
        store_weight<true, kPath, TP, N>(p.weights, key, ctx.begin, param, master, i, n, vec, w[u]);
        store_packed<TS, N>(exp_avg, i, n, vec, m[u]);
        store_packed<TS, N>(exp_avg_sq, i, n, vec, v[u]);
        if (p.amsgrad) store_packed<TS, N>(max_exp_avg_sq, i, n, vec, vm[u]);
      }
    });
  }
};

}  // namespace mixprec::kernels
