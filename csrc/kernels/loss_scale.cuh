// CUDA device code of the loss-scaling family: the fused non-finite check and unscale over a
// tensor group, and the single-thread dynamic scale update (no host synchronization anywhere).
#pragma once

#include "kernels/loss_scale.h"
#include "kernels/multi_tensor.cuh"

#include <cstring>
#include <type_traits>

namespace mixprec::kernels {

// Two fp16 or bf16 values in one 32-bit word, worked on without unpacking where possible.
// kExponent masks both exponents; adding kCarry carries into a half's top bit exactly when its
// exponent is all ones (inf or NaN), and no half carries into the next (0x7c00 + 0x0400 and
// 0x7f80 + 0x0080 are 0x8000), so `acc |= (w & kExponent) + kCarry` tests two values in two
// instructions, and (acc & 0x80008000) says whether any was non-finite.
template <typename T> struct PairWord;
template <> struct PairWord<__half> {
  static constexpr uint32_t kExponent = 0x7c007c00u, kCarry = 0x04000400u;
  static __device__ __forceinline__ float2 unpack(uint32_t w) {
    __half2 h;
    memcpy(&h, &w, sizeof w);
    return __half22float2(h);
  }
  static __device__ __forceinline__ uint32_t pack(float2 f) {  // one cvt.rn.f16x2.f32
    const __half2 h = __float22half2_rn(f);
    uint32_t w;
    memcpy(&w, &h, sizeof w);
    return w;
  }
};
template <> struct PairWord<__nv_bfloat16> {
  static constexpr uint32_t kExponent = 0x7f807f80u, kCarry = 0x00800080u;
  static __device__ __forceinline__ float2 unpack(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  static __device__ __forceinline__ uint32_t pack(float2 f) {  // one cvt.rn.bf16x2.f32
    const __nv_bfloat162 h = __float22bfloat162_rn(f);
    uint32_t w;
    memcpy(&w, &h, sizeof w);
    return w;
  }
};
constexpr uint32_t kPairSignBits = 0x80008000u;

// One pass per chunk: read each gradient once, flag non-finite values (tested before scaling,
// as torch does) and a bad inv_scale (is_bad_inv_scale: torch does not test it), and when asked write g * inv_scale to
// the output list (in place or another dtype). The check-only form (NLists == 1, no scale) reads and never writes.
template <int NLists, typename TIn, typename TOut> struct UnscaleOp {
  float* found_inf;
  const float* inv_scale;
  float* per_tensor_found;

  // 2-byte grads checked, or scaled into their own dtype, move twice the elements per byte of
  // fp32's, and per element the generic path spends about eight instructions (unpack, a float
  // test, multiply, a 16-bit convert, repack) where the pair words below spend about four: on
  // the H200 that path ran at 85% of copy bandwidth (fp32: 92%), bound by instruction issue.
  static constexpr bool kPairWords = sizeof(TIn) == 2 && (NLists == 1 || std::is_same_v<TIn, TOut>);

  __device__ void operator()(const TensorTable<NLists>& table, const ChunkCtx& c) const {
    if constexpr (kPairWords) {
      run_pair_words(table, c);
    } else {
      run_generic(table, c);
    }
  }

  __device__ __forceinline__ void raise_flags(const ChunkCtx& c) const {
    // Each thread that saw a non-finite value raises the flags itself: every writer stores the
    // same value, so the race is benign, and no block-wide vote is needed. A vote
    // (__syncthreads_or) per chunk made every block drain its loads at each chunk's end: with
    // fp16's four vector iterations per chunk that bubble cost ~8% of copy bandwidth (82.7% ->
    // see benchmarks/RESULTS.md), and the read-only check lost more.
    if (found_inf != nullptr) *found_inf = 1.f;
    if (per_tensor_found != nullptr) per_tensor_found[c.arg_index] = 1.f;
  }

  // Whole aligned 16-byte vectors as pair words; a vector cut by the chunk's end, or a tensor not
  // 16-byte aligned, element by element through the generic load and store.
  __device__ __forceinline__ void run_pair_words(const TensorTable<NLists>& table, const ChunkCtx& c) const {
    using Pair = PairWord<TIn>;
    constexpr int N = 8;  // elements per 16-byte vector
    const TIn* in = chunk_ptr<TIn>(table, c, 0);
    TIn* out = NLists == 2 ? chunk_ptr<TIn>(table, c, NLists - 1) : nullptr;
    const float s = inv_scale != nullptr ? *inv_scale : 1.f;
    uint32_t acc = 0;
    bool bad = inv_scale != nullptr && is_bad_inv_scale(s);
    for_each_vector_group<N>(c.n, [&](int64_t base, int stride) {
      uint4 v[kIlp];
#pragma unroll
      for (int u = 0; u < kIlp; ++u) {
        const int64_t i = base + u * stride;
        if (c.vec_ok && i + N <= c.n) v[u] = *reinterpret_cast<const uint4*>(in + i);
      }
#pragma unroll
      for (int u = 0; u < kIlp; ++u) {
        const int64_t i = base + u * stride;
        if (c.vec_ok && i + N <= c.n) {
          uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
          for (int q = 0; q < 4; ++q) acc |= (w[q] & Pair::kExponent) + Pair::kCarry;
          if constexpr (NLists == 2) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              float2 f = Pair::unpack(w[q]);
              f.x *= s;
              f.y *= s;
              w[q] = Pair::pack(f);
            }
            __stwb(reinterpret_cast<uint4*>(out + i), make_uint4(w[0], w[1], w[2], w[3]));
          }
        } else if (i < c.n) {
          float x[N];
          load<TIn, N>(in, i, c.n, false, x);  // zero past the chunk's end: finite
#pragma unroll
          for (int j = 0; j < N; ++j) {
            bad |= !is_finite(x[j]);
            x[j] *= s;
          }
          if constexpr (NLists == 2) store<TIn, N>(out, i, c.n, false, x);
        }
      }
    });
    if (bad || (acc & kPairSignBits) != 0) raise_flags(c);
  }

  __device__ __forceinline__ void run_generic(const TensorTable<NLists>& table, const ChunkCtx& c) const {
    constexpr int N = vec_elems<TIn, TOut>();
    const TIn* in = chunk_ptr<TIn>(table, c, 0);
    const float s = inv_scale != nullptr ? *inv_scale : 1.f;
    bool bad = inv_scale != nullptr && is_bad_inv_scale(s);
    for_each_vector_group<N>(c.n, [&](int64_t base, int stride) {
      float x[kIlp][N];
#pragma unroll
      for (int u = 0; u < kIlp; ++u) load<TIn, N>(in, base + u * stride, c.n, c.vec_ok, x[u]);
#pragma unroll
      for (int u = 0; u < kIlp; ++u) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
          bad |= !is_finite(x[u][j]);
          x[u][j] *= s;
        }
      }
      if constexpr (NLists == 2) {
        TOut* out = chunk_ptr<TOut>(table, c, 1);
#pragma unroll
        for (int u = 0; u < kIlp; ++u) store<TOut, N>(out, base + u * stride, c.n, c.vec_ok, x[u]);
      }
    });
    if (bad) raise_flags(c);
  }
};

}  // namespace mixprec::kernels
