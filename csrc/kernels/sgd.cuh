// CUDA device code of the fused SGD step: one streaming pass that reads grad, weight and momentum
// once and writes weight (and model copy) and momentum once (see kernels/sgd.h).
#pragma once

#include "kernels/multi_tensor.cuh"
#include "kernels/optim_common.cuh"
#include "kernels/sgd.h"

namespace mixprec::kernels {

// TP: model param storage, TG: grad storage, TS: momentum storage (float, or TP as Apex's and
// torch's fp16/bf16 SGD keep it); the master float32 or a remainder (WeightMode). kStoreGrad: as AdamOp.
template <typename TP, typename TG, typename TS, bool kStoreGrad, int kPath> struct SgdOp {  // kPath: as AdamOp
  SgdParams p;

  __device__ void operator()(const TensorTable<kSgdLists>& table, const ChunkCtx& ctx) const {
    // A skipped step touches nothing: params, master, momentum and the step count stay as they were.
    if (step_skipped(p.scalars)) return;
    const SgdCoefficients c = sgd_coefficients(p);
    // 16 bytes of the narrowest operand per vector. SGD streams at most three inputs, so each
    // thread keeps more vectors in flight than Adam does; 4 fp32 vectors would spill at the
    // 64-register cap of two blocks per SM, 3 do not.
    constexpr int N = vec_elems<TP, TG, TS>();
    constexpr int Ilp = N >= 8 ? 2 : 3;
    TP* param = chunk_ptr<TP>(table, ctx, kSgdParam);
    TG* grad = chunk_ptr<TG>(table, ctx, kSgdGrad);
    TS* momentum = chunk_ptr<TS>(table, ctx, kSgdMomentum);
    void* master = master_chunk<kPath>(p.weights, table, ctx);  // fp32 masters or 16-bit remainders
    // The first step overwrites the buffer without reading it (torch.optim.SGD's semantics), so it
    // saves that read and never sees what the buffer held.
    const bool read_momentum = c.use_momentum && !c.first_step;
    const int n = ctx.n;
    const uint32_t key = chunk_rounding_key<kPath>(p.weights, p.scalars, ctx);  // stochastic rounding only
    const bool vec = ctx.vec_ok;
    for_each_vector_group<N, Ilp>(n, [&](int64_t base, int stride) {
      float g[Ilp][N], w[Ilp][N], m[Ilp][N];
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
        load<TG, N>(grad, i, n, vec, g[u]);
        load_weight<false, kPath, TP, N>(p.weights, param, master, i, n, vec, w[u]);
        if (read_momentum) load<TS, N>(momentum, i, n, vec, m[u]);
        else
#pragma unroll
          for (int j = 0; j < N; ++j) m[u][j] = 0.f;
      }
      if constexpr (kStoreGrad) store_unscaled_grads<false>(grad, base, stride, n, vec, c.inv_scale, g);
#pragma unroll
      for (int u = 0; u < Ilp; ++u)
#pragma unroll
        for (int j = 0; j < N; ++j) sgd_update(c, g[u][j], w[u][j], m[u][j], RoundTo<TS>{});
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
        store_weight<false, kPath, TP, N>(p.weights, key, ctx.begin, param, master, i, n, vec, w[u]);
        if (c.use_momentum) store<TS, N>(momentum, i, n, vec, m[u]);
      }
    });
  }
};

}  // namespace mixprec::kernels
