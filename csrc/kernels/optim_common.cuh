// CUDA device side of what every fused optimizer shares (kernels/optim_common.h): the write-back
// of unscaled gradients under a grad_scale, and the weight's loads and stores (WeightMode).
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

// An fp32 value as a state list of storage T holds it (rounded to nearest even; float: as is), for
// updates that go on with the stored value (SGD's fp16/bf16 momentum, kernels/sgd.h).
template <typename T> struct RoundTo {
  __device__ __forceinline__ float operator()(float x) const { return to_float<T>(from_float<T>(x)); }
};

// ---- the weight a step updates (WeightMode, kernels/optim_common.h) ---------------------------
// kPacked: through load_packed/store_packed (Adam's choice, see multi_tensor.cuh), else load/store.
template <bool kPacked, typename T, int N>
__device__ __forceinline__ void load_as(const T* p, int64_t i, int n, bool vec, float (&r)[N]) {
  if constexpr (kPacked) load_packed<T, N>(p, i, n, vec, r);
  else load<T, N>(p, i, n, vec, r);
}
template <bool kPacked, typename T, int N>
__device__ __forceinline__ void store_as(T* p, int64_t i, int n, bool vec, const float (&r)[N]) {
  if constexpr (kPacked) store_packed<T, N>(p, i, n, vec, r);
  else store<T, N>(p, i, n, vec, r);
}

// Raw 16-bit patterns: remainders and stochastically rounded params are bits already, which
// store<__nv_bfloat16> would turn into the canonical NaN where they read as one.
template <int N>
__device__ __forceinline__ void store_bits16(uint16_t* p, int64_t i, int n, bool vec, const uint16_t (&b)[N]) {
  if constexpr (N % 8 == 0) {
    if (vec && i + N <= n) {
      uint4* dst = reinterpret_cast<uint4*>(p + i);
#pragma unroll
      for (int k = 0; k < N / 8; ++k) {
        const uint16_t* q = b + 8 * k;
        __stwb(dst + k, make_uint4(q[0] | (uint32_t{q[1]} << 16), q[2] | (uint32_t{q[3]} << 16),
                                   q[4] | (uint32_t{q[5]} << 16), q[6] | (uint32_t{q[7]} << 16)));
      }
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < N; ++j)
    if (i + j < n) p[i + j] = b[j];
}

// The weight path a kernel instance is compiled for. Kernels of bf16 params come in three, so
// that the plain path (fp32 masters or none, rounding to nearest) holds no register for the lean
// ones: with run-time branches nvcc 13 spilled 5x more in SGD's bf16 step.
enum WeightPath : int { kPlainWeights = 0, kRemainderWeights = 1, kStochasticWeights = 2 };

// Calls f(std::integral_constant<int, path>{}) for the group's path (always plain unless TP is bf16).
template <typename TP, typename F> void dispatch_weight_path(const WeightMode& m, F&& f) {
  if constexpr (std::is_same_v<TP, __nv_bfloat16>) {
    if (m.remainder) return f(std::integral_constant<int, kRemainderWeights>{});
    if (m.stochastic) return f(std::integral_constant<int, kStochasticWeights>{});
  }
  f(std::integral_constant<int, kPlainWeights>{});
}

// The chunk's master pointer: float32 elements, or 16-bit remainders (offset by their own size).
template <int kPath, int NLists>
__device__ __forceinline__ void* master_chunk(const WeightMode& m, const TensorTable<NLists>& table,
                                              const ChunkCtx& ctx) {
  if constexpr (kPath == kRemainderWeights) return chunk_ptr<uint16_t>(table, ctx, m.master_list);
  else return chunk_ptr<float>(table, ctx, m.master_list);
}

// The fp32 weights of elements i.. of the chunk: the master (fp32, or rebuilt from the bf16
// param and its remainder; bf16 -> float is a shift, so every bit pattern arrives intact).
template <bool kPacked, int kPath, typename TP, int N>
__device__ __forceinline__ void load_weight(const WeightMode& m, const TP* param, const void* master, int64_t i, int n,
                                            bool vec, float (&w)[N]) {
  if constexpr (kPath == kRemainderWeights) {
    float low[N];
    load_as<kPacked, TP, N>(param, i, n, vec, w);
    load_as<kPacked, TP, N>(static_cast<const TP*>(master), i, n, vec, low);
#pragma unroll
    for (int j = 0; j < N; ++j) w[j] = rebuild_master(float_bits(w[j]) >> 16, float_bits(low[j]) >> 16);
    return;
  }
  if (m.has_master) load_as<kPacked, float, N>(static_cast<const float*>(master), i, n, vec, w);
  else load_as<kPacked, TP, N>(param, i, n, vec, w);
}

// A chunk's stochastic-rounding key (rounding_key of its tensor at this step); 0 when unused.
template <int kPath>
__device__ __forceinline__ uint32_t chunk_rounding_key(const WeightMode& m, const StepScalars& s, const ChunkCtx& ctx) {
  if constexpr (kPath == kStochasticWeights) return rounding_key(m.seed, step_count(s), ctx.arg_index);
  else return 0u;
}

// The updated weights back, as store_weights does on the CPU; `first` is element i's index in
// its tensor minus i (ctx.begin), which the stochastic rounding hashes.
template <bool kPacked, int kPath, typename TP, int N>
__device__ __forceinline__ void store_weight(const WeightMode& m, uint32_t key, int64_t first, TP* param, void* master,
                                             int64_t i, int n, bool vec, const float (&w)[N]) {
  if constexpr (kPath == kRemainderWeights) {
    uint16_t high[N], low[N];
#pragma unroll
    for (int j = 0; j < N; ++j) split_master(w[j], high[j], low[j]);
    store_bits16<N>(reinterpret_cast<uint16_t*>(param), i, n, vec, high);
    store_bits16<N>(static_cast<uint16_t*>(master), i, n, vec, low);
    return;
  } else if constexpr (kPath == kStochasticWeights) {
    uint16_t high[N];
#pragma unroll
    for (int j = 0; j < N; ++j) high[j] = bf16_round_stochastic(w[j], rounding_bits(key, first + i + j));
    store_bits16<N>(reinterpret_cast<uint16_t*>(param), i, n, vec, high);
    return;
  }
  store_as<kPacked, TP, N>(param, i, n, vec, w);
  if (m.has_master) store_as<kPacked, float, N>(static_cast<float*>(master), i, n, vec, w);
}

// Calls f(std::bool_constant<stores_unscaled_grads(s)>{}): the kernel instance for the step.
template <typename F> void dispatch_store_grads(const StepScalars& s, F&& f) {
  if (stores_unscaled_grads(s)) f(std::true_type{});
  else f(std::false_type{});
}

}  // namespace mixprec::kernels
