// CUDA device code of the fused NovoGrad step: the per-tensor moment update (one thread per
// tensor) and the element-wise pass, which streams grads, weights and first moments once each
// (see kernels/novograd.h for the update rule).
#pragma once

#include "kernels/multi_tensor.cuh"
#include "kernels/novograd.h"
#include "kernels/optim_common.cuh"

namespace mixprec::kernels {

constexpr int kNovoGradMomentThreads = 256;

__global__ void __launch_bounds__(kNovoGradMomentThreads) novograd_moment_kernel(const NovoGradMomentParams p) {
  // A skipped step leaves v as it was, like everything else.
  if (step_skipped(p.scalars)) return;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kNovoGradMomentThreads + threadIdx.x;
  if (i >= p.num_tensors) return;
  const float n = p.grad_norms[i] * grad_inv_scale(p.scalars);
  p.exp_avg_sq_norms[i] = novograd_moment(p.type, p.exp_avg_sq_norms[i], n, static_cast<float>(p.args.beta2),
                                          novograd_seeds(p.scalars, p.args.init_zero));
}

// TP: model param storage, TG: grad storage; the first moment is float32, the master float32 or a
// remainder.
template <typename TP, typename TG, bool kStoreGrad, int kPath>  // kStoreGrad, kPath: as AdamOp
struct NovoGradOp {
  NovoGradParams p;

  __device__ void operator()(const TensorTable<kNovoGradLists>& table, const ChunkCtx& ctx) const {
    if (step_skipped(p.scalars)) return;
    const NovoGradCoefficients c = novograd_coefficients(p);
    // Every thread of the block reads the same v: one broadcast load per block.
    const float denom = novograd_denom(c, p.exp_avg_sq_norms[ctx.arg_index]);
    if (c.reg_inside_moment) run<true>(table, ctx, c, denom);
    else run<false>(table, ctx, c, denom);
  }

  template <bool RegInsideMoment>
  __device__ __forceinline__ void run(const TensorTable<kNovoGradLists>& table, const ChunkCtx& ctx,
                                      const NovoGradCoefficients& c, float denom) const {
    // 16 bytes of the narrowest operand per vector, and as many vectors in flight as keep the
    // registers under the two-blocks-per-SM budget (three fp32 operands per element).
    constexpr int N = vec_elems<TP, TG, float>();
    constexpr int Ilp = N >= 8 ? 1 : 2;
    TP* param = chunk_ptr<TP>(table, ctx, kNovoGradParam);
    TG* grad = chunk_ptr<TG>(table, ctx, kNovoGradGrad);
    float* exp_avg = chunk_ptr<float>(table, ctx, kNovoGradExpAvg);
    void* master = master_chunk<kPath>(p.weights, table, ctx);  // fp32 masters or 16-bit remainders
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
        load<float, N>(exp_avg, i, n, vec, m[u]);
      }
      if constexpr (kStoreGrad) store_unscaled_grads<false>(grad, base, stride, n, vec, c.inv_scale, g);
#pragma unroll
      for (int u = 0; u < Ilp; ++u)
#pragma unroll
        for (int j = 0; j < N; ++j) novograd_update<RegInsideMoment>(c, denom, g[u][j], w[u][j], m[u][j]);
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
        store_weight<false, kPath, TP, N>(p.weights, key, ctx.begin, param, master, i, n, vec, w[u]);
        store<float, N>(exp_avg, i, n, vec, m[u]);
      }
    });
  }
};

}  // namespace mixprec::kernels
