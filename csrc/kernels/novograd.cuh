// CUDA device code of the fused NovoGrad step: the per-tensor moment update (one thread per
// tensor) and the element-wise pass, which streams grads, weights and first moments once each
// (see kernels/novograd.h for the update rule).
#pragma once

#include "kernels/novograd.h"
#include "kernels/optim_stream.cuh"

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
    const StateRole exp_avg[] = {{kNovoGradExpAvg}};
    OptimStream<TP, TG, float, N, Ilp, kPath, kStoreGrad>::run(
        table, ctx, p.weights, p.scalars, kNovoGradParam, kNovoGradGrad, c.inv_scale, exp_avg,
        [&](int64_t, float& g, float& w, float& m) { novograd_update<RegInsideMoment>(c, denom, g, w, m); });
  }
};

}  // namespace mixprec::kernels
