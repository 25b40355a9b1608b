// CUDA device code of the fused LAMB step: the moments pass (moments, per-chunk norm partials of
// w and u) and the apply pass (w -= lr * trust_ratio * u, u recomputed); see kernels/lamb.h.
#pragma once

#include "kernels/lamb.h"
#include "kernels/optim_stream.cuh"

namespace mixprec::kernels {

// 16 bytes of the narrowest operand per vector; one vector group in flight when vectors are wide
// (fp16/bf16: 8 elements, so the fp32 moments take two 16-byte loads each), two otherwise, which
// keeps registers under the 64 that two blocks per SM allow.
template <typename TP, typename TG> struct LambShape {
  static constexpr int N = vec_elems<TP, TG, float>();
  static constexpr int Ilp = 1;
};

// Pass 1. TP: model param storage, TG: grad storage; moments float32, masters float32 or
// remainders (WeightMode). Apply: the one-pass step (no trust ratio), a template argument so that
// each variant keeps only the registers it needs (the two-pass one neither writes weights nor
// needs lr).
template <typename TP, typename TG, bool Apply, bool kStoreGrad, int kPath>  // kStoreGrad, kPath: as AdamOp
struct LambMomentsOp {
  LambParams p;

  __device__ void operator()(const TensorTable<kLambLists>& table, const ChunkCtx& ctx) const {
    if (step_skipped(p.scalars)) return;  // nothing changes, not even the partials' consumers run
    const LambCoefficients c = lamb_coefficients(p);
    constexpr int N = LambShape<TP, TG>::N;
    constexpr int Ilp = LambShape<TP, TG>::Ilp;
    const int n = ctx.n;
    float w_sq = 0.f, u_sq = 0.f;
    const StateRole moments[] = {{kLambExpAvg}, {kLambExpAvgSq}};
    OptimStream<TP, TG, float, N, Ilp, kPath, kStoreGrad, Apply ? 0 : kStreamKeepWeight>::run(
        table, ctx, p.weights, p.scalars, kLambParam, kLambGrad, c.inv_scale, moments,
        [&](int64_t i, float& g, float& w, float& m, float& v) {
          const float d = lamb_moments(c, g, w, m, v);
          if constexpr (Apply) {
            w -= c.lr * d;
          } else if (i < n) {  // lanes past the end hold zeros, but their u is 0/0 when eps == 0
            w_sq = fmaf(w, w, w_sq);
            u_sq = fmaf(d, d, u_sq);
          }
        });
    if constexpr (Apply) return;
    // Every thread of the block reaches both reductions.
    w_sq = block_reduce_sum(w_sq);
    u_sq = block_reduce_sum(u_sq);
    if (threadIdx.x == 0) {
      p.param_partials[ctx.global_chunk] = w_sq;
      p.update_partials[ctx.global_chunk] = u_sq;
    }
  }
};

// Pass 2: reads the new moments and the weight, never the gradient.
template <typename TP, int kPath> struct LambApplyOp {
  LambParams p;

  __device__ void operator()(const TensorTable<kLambLists>& table, const ChunkCtx& ctx) const {
    if (step_skipped(p.scalars)) return;
    const LambCoefficients c = lamb_coefficients(p);
    const float step_size = lamb_step_size(c.lr, p.param_norms[ctx.arg_index], p.update_norms[ctx.arg_index]);
    constexpr int N = LambShape<TP, float>::N;
    constexpr int Ilp = LambShape<TP, float>::Ilp;
    // Moments read, never written; the gradient never read.
    const StateRole moments[] = {{kLambExpAvg, true, false}, {kLambExpAvgSq, true, false}};
    OptimStream<TP, float, float, N, Ilp, kPath, false, kStreamNoGrad>::run(
        table, ctx, p.weights, p.scalars, kLambParam, kLambGrad, 1.f, moments,
        [&](int64_t, float&, float& w, float& m, float& v) { w -= step_size * lamb_direction(c, m, v, w); });
  }
};

}  // namespace mixprec::kernels
