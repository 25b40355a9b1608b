// CUDA device code of the fused LAMB step: the moments pass (moments, per-chunk norm partials of
// w and u) and the apply pass (w -= lr * trust_ratio * u, u recomputed); see kernels/lamb.h.
#pragma once

#include "kernels/lamb.h"
#include "kernels/multi_tensor.cuh"
#include "kernels/optim_common.cuh"

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
    TP* param = chunk_ptr<TP>(table, ctx, kLambParam);
    TG* grad = chunk_ptr<TG>(table, ctx, kLambGrad);
    float* exp_avg = chunk_ptr<float>(table, ctx, kLambExpAvg);
    float* exp_avg_sq = chunk_ptr<float>(table, ctx, kLambExpAvgSq);
    void* master = master_chunk<kPath>(p.weights, table, ctx);  // fp32 masters or 16-bit remainders
    const int n = ctx.n;
    [[maybe_unused]] const uint32_t key =
        chunk_rounding_key<kPath>(p.weights, p.scalars, ctx);  // stochastic rounding only
    const bool vec = ctx.vec_ok;
    float w_sq = 0.f, u_sq = 0.f;
    for_each_vector_group<N, Ilp>(n, [&](int64_t base, int stride) {
      float g[Ilp][N], w[Ilp][N], m[Ilp][N], v[Ilp][N];
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
        load<TG, N>(grad, i, n, vec, g[u]);
        load_weight<false, kPath, TP, N>(p.weights, param, master, i, n, vec, w[u]);
        load<float, N>(exp_avg, i, n, vec, m[u]);
        load<float, N>(exp_avg_sq, i, n, vec, v[u]);
      }
      if constexpr (kStoreGrad) store_unscaled_grads<false>(grad, base, stride, n, vec, c.inv_scale, g);
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const float d = lamb_moments(c, g[u][j], w[u][j], m[u][j], v[u][j]);
          if constexpr (Apply) {
            w[u][j] -= c.lr * d;
          } else if (i + j < n) {  // lanes past the end hold zeros, but their u is 0/0 when eps == 0
            w_sq = fmaf(w[u][j], w[u][j], w_sq);
            u_sq = fmaf(d, d, u_sq);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
        store<float, N>(exp_avg, i, n, vec, m[u]);
        store<float, N>(exp_avg_sq, i, n, vec, v[u]);
        if constexpr (Apply) {
          store_weight<false, kPath, TP, N>(p.weights, key, ctx.begin, param, master, i, n, vec, w[u]);
        }
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
    TP* param = chunk_ptr<TP>(table, ctx, kLambParam);
    const float* exp_avg = chunk_ptr<float>(table, ctx, kLambExpAvg);
    const float* exp_avg_sq = chunk_ptr<float>(table, ctx, kLambExpAvgSq);
    void* master = master_chunk<kPath>(p.weights, table, ctx);  // fp32 masters or 16-bit remainders
    const int n = ctx.n;
    const uint32_t key = chunk_rounding_key<kPath>(p.weights, p.scalars, ctx);  // stochastic rounding only
    const bool vec = ctx.vec_ok;
    for_each_vector_group<N, Ilp>(n, [&](int64_t base, int stride) {
      float w[Ilp][N], m[Ilp][N], v[Ilp][N];
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
        load_weight<false, kPath, TP, N>(p.weights, param, master, i, n, vec, w[u]);
        load<float, N>(exp_avg, i, n, vec, m[u]);
        load<float, N>(exp_avg_sq, i, n, vec, v[u]);
      }
#pragma unroll
      for (int u = 0; u < Ilp; ++u)
#pragma unroll
        for (int j = 0; j < N; ++j) w[u][j] -= step_size * lamb_direction(c, m[u][j], v[u][j], w[u][j]);
#pragma unroll
      for (int u = 0; u < Ilp; ++u) {
        const int64_t i = base + u * stride;
        store_weight<false, kPath, TP, N>(p.weights, key, ctx.begin, param, master, i, n, vec, w[u]);
      }
    });
  }
};

}  // namespace mixprec::kernels
