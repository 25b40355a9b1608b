// CUDA device code of the fused Adam/AdamW step: one streaming pass over grads, weights and
// moments; reads each operand once and writes each result once (see kernels/adam.h).
#pragma once

#include <type_traits>

#include "kernels/adam.h"
#include "kernels/multi_tensor.cuh"
#include "kernels/optim_common.cuh"
#include "kernels/optim_stream.cuh"
#include "kernels/quant8.h"

namespace mixprec::kernels {

// TP: model param storage, TG: grad storage, TS: moment storage (float or bf16); kStoreGrad:
// stores_unscaled_grads (an instance of its own, so steps without a grad_scale keep their registers).
// kPath: the weight path (WeightPath, optim_common.cuh). On the streaming skeleton (optim_stream.cuh),
// packed accesses (multi_tensor.cuh).
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
    // One loop per AdamFlagCase (adam.h: with every flag live the fp16 loop spills). max_exp_avg_sq
    // is a list of its own with amsgrad only (elsewhere the update ignores it).
    const auto stream = [&](auto flag_case) {
      constexpr int kCase = decltype(flag_case)::value;
      const bool amsgrad = kCase == kAdamAnyFlags && p.amsgrad;
      const StateRole moments[] = {{kAdamExpAvg}, {kAdamExpAvgSq}, {kAdamMaxExpAvgSq, amsgrad, amsgrad, false}};
      OptimStream<TP, TG, TS, N, Ilp, kPath, kStoreGrad, kStreamPacked>::run(
          table, ctx, p.weights, p.scalars, kAdamParam, kAdamGrad, c.inv_scale, moments,
          [&](int64_t, float& g, float& w, float& m, float& v, float& vm) { adam_update<kCase>(c, g, w, m, v, vm); });
    };
    switch (adam_flag_case(c)) {
      case kAdamDecoupledDecay:
        return stream(std::integral_constant<int, kAdamDecoupledDecay>{});
      case kAdamNoDecay:
        return stream(std::integral_constant<int, kAdamNoDecay>{});
      default:
        return stream(std::integral_constant<int, kAdamAnyFlags>{});
    }
  }
};

// Eight bytes of codes at i (zero past n): one 8-byte access when the vector is whole and aligned.
template <typename TC> __device__ __forceinline__ void load_codes(const TC* p, int64_t i, int n, bool vec, TC (&c)[8]) {
  if (vec && i + 8 <= n) {
    const uint2 word = *reinterpret_cast<const uint2*>(p + i);
    memcpy(c, &word, 8);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = i + j < n ? p[i + j] : TC{0};
  }
}

template <typename TC>
__device__ __forceinline__ void store_codes(TC* p, int64_t i, int n, bool vec, const TC (&c)[8]) {
  if (vec && i + 8 <= n) {
    uint2 word;
    memcpy(&word, c, 8);
    *reinterpret_cast<uint2*>(p + i) = word;
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (i + j < n) p[i + j] = c[j];
  }
}

// NaN-keeping max over the 32 lanes of a warp; every lane gets it.
__device__ __forceinline__ float warp_absmax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = q8_absmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// 8-bit moments (kernels/quant8.h): one warp per quantization block (32 lanes x 8 elements =
// kQuantBlock) dequantizes, updates, finds the block's new absmax by shuffles and requantizes, all in
// registers, so the pass reads and writes each operand once (1 + 1 bytes of moments per element).
template <typename TP, typename TG, bool kStoreGrad, int kPath> struct AdamQ8Op {
  static constexpr bool kPersistent = false;
  static constexpr int N = 8;
  static_assert(32 * N == kQuantBlock, "one warp covers one quantization block");
  AdamParams p;

  __device__ void operator()(const TensorTable<kAdamQ8Lists>& table, const ChunkCtx& ctx) const {
    if (step_skipped(p.scalars)) return;
    const AdamCoefficients c = adam_coefficients(p);
    TP* param = chunk_ptr<TP>(table, ctx, kAdamParam);
    TG* grad = chunk_ptr<TG>(table, ctx, kAdamGrad);
    int8_t* avg_codes = chunk_ptr<int8_t>(table, ctx, kAdamExpAvg);
    uint8_t* sq_codes = chunk_ptr<uint8_t>(table, ctx, kAdamExpAvgSq);
    float* avg_scales = static_cast<float*>(table.ptrs[kAdamExpAvgScale][ctx.t]) + ctx.begin / kQuantBlock;
    float* sq_scales = static_cast<float*>(table.ptrs[kAdamExpAvgSqScale][ctx.t]) + ctx.begin / kQuantBlock;
    void* master = master_chunk<kPath>(p.weights, table, ctx);
    const int n = ctx.n;
    const uint32_t key = chunk_rounding_key<kPath>(p.weights, p.scalars, ctx);
    const bool vec = ctx.vec_ok;
    const int lane = static_cast<int>(threadIdx.x & 31);
    // The loop bound is the warp's, so every lane reaches the shuffles.
    for (int block = static_cast<int>(threadIdx.x >> 5); block * kQuantBlock < n; block += kBlockThreads / 32) {
      const int64_t i = static_cast<int64_t>(block) * kQuantBlock + lane * N;
      float g[1][N], w[N], m[N], v[N];
      int8_t cm[N];
      uint8_t cv[N];
      load_packed<TG, N>(grad, i, n, vec, g[0]);
      load_weight<true, kPath, TP, N>(p.weights, param, master, i, n, vec, w);
      load_codes(avg_codes, i, n, vec, cm);
      load_codes(sq_codes, i, n, vec, cv);
      const float avg_scale = avg_scales[block], sq_scale = sq_scales[block];
      if constexpr (kStoreGrad) store_unscaled_grads<true>(grad, i, 0, n, vec, c.inv_scale, g);
      float avg_max = 0.f, sq_max = 0.f;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        m[j] = q8_decode_signed(cm[j], avg_scale);
        v[j] = q8_decode_sq(cv[j], sq_scale);
        float unused_max;
        adam_update(c, g[0][j], w[j], m[j], v[j], unused_max);
        v[j] = sqrtf(v[j]);  // sqrt(exp_avg_sq), the quantity coded
        if (i + j < n) {     // elements past the tensor's end take no part in the scale
          avg_max = q8_absmax(avg_max, m[j]);
          sq_max = q8_absmax(sq_max, v[j]);
        }
      }
      avg_max = warp_absmax(avg_max);
      sq_max = warp_absmax(sq_max);
      store_weight<true, kPath, TP, N>(p.weights, key, ctx.begin, param, master, i, n, vec, w);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        cm[j] = q8_encode_signed(m[j], avg_max);
        cv[j] = q8_encode_root(v[j], sq_max);
      }
      store_codes(avg_codes, i, n, vec, cm);
      store_codes(sq_codes, i, n, vec, cv);
      if (lane == 0) {
        avg_scales[block] = avg_max;
        sq_scales[block] = sq_max;
      }
    }
  }
};

}  // namespace mixprec::kernels
