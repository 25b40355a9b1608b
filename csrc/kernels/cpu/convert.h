// Torch-free CPU storage types and tile conversions for fp32, fp16 and bf16, written as plain
// branch-free loops over bits so that the compiler vectorizes them (SSE2 baseline, AVX2 clones).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/multi_tensor.h"

// Functions marked MIXPREC_CPU_CLONES are compiled twice, for baseline x86-64 and for x86-64-v3
// (AVX2, FMA, F16C), and the loader picks one at startup (GCC function multi-versioning).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MIXPREC_CPU_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define MIXPREC_CPU_CLONES
#endif
#define MIXPREC_INLINE inline __attribute__((always_inline))

namespace mixprec::kernels::cpu {

// Elements converted to fp32 at a time: small enough to stay in L1 beside the other operands.
constexpr int64_t kTile = 512;

MIXPREC_INLINE uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
MIXPREC_INLINE float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

MIXPREC_INLINE float half_to_float(uint16_t h) {
  // Shift exponent and mantissa into place and rebias; inf/NaN get the extra exponent bias and
  // subnormals are renormalized by one float subtraction (exact).
  const uint32_t shifted = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exp = shifted & 0x0f800000u;
  uint32_t u = shifted + 0x38000000u;                                   // (127 - 15) << 23
  u = exp == 0x0f800000u ? u + 0x38000000u : u;                         // inf / NaN
  const float sub = float_of(u + 0x00800000u) - float_of(0x38800000u);  // 2^-14
  u = exp == 0 ? bits_of(sub) : u;
  return float_of(u | (static_cast<uint32_t>(h & 0x8000u) << 16));
}

MIXPREC_INLINE uint16_t float_to_half(float f) {
  // Round to nearest even, overflow to inf, NaN stays NaN (quiet), subnormals via a magic add.
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t inf_nan = a > 0x7f800000u ? 0x7e00u : 0x7c00u;
  const float denorm = float_of(a) + float_of(0x3f000000u);  // 0.5: aligns the half subnormal ulp
  const uint32_t sub = bits_of(denorm) - 0x3f000000u;
  const uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;  // rebias (-112 << 23), RNE
  uint32_t r = a >= 0x47800000u ? inf_nan : (a < 0x38800000u ? sub : normal);
  return static_cast<uint16_t>(r | sign);
}

MIXPREC_INLINE float bf16_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

MIXPREC_INLINE uint16_t float_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
}

MIXPREC_INLINE bool is_finite(float f) { return (bits_of(f) & 0x7f800000u) != 0x7f800000u; }

template <DType D> struct Storage;
template <> struct Storage<DType::kFloat32> {
  using type = float;
};
template <> struct Storage<DType::kFloat16> {
  using type = uint16_t;
};
template <> struct Storage<DType::kBFloat16> {
  using type = uint16_t;
};

// Element i of a tensor of dtype D, as fp32; and an fp32 value rounded into element i.
template <DType D> MIXPREC_INLINE float load_one(const void* p, int64_t i) {
  const auto v = static_cast<const typename Storage<D>::type*>(p)[i];
  if constexpr (D == DType::kFloat32) return v;
  else if constexpr (D == DType::kFloat16) return half_to_float(v);
  else return bf16_to_float(v);
}

template <DType D> MIXPREC_INLINE void store_one(void* p, int64_t i, float f) {
  auto* q = static_cast<typename Storage<D>::type*>(p);
  if constexpr (D == DType::kFloat32) q[i] = f;
  else if constexpr (D == DType::kFloat16) q[i] = float_to_half(f);
  else q[i] = float_to_bf16(f);
}

template <DType D> MIXPREC_INLINE void load_tile_as(const void* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load_one<D>(src, i);
}

template <DType D> MIXPREC_INLINE void store_tile_as(const float* src, int64_t n, void* dst) {
  for (int64_t i = 0; i < n; ++i) store_one<D>(dst, i, src[i]);
}

// Calls f(DTypeTag<d>{}): turns a run-time dtype into a template argument,
// so that kernels are instantiated per dtype and the inner loops hold no dtype switch.
template <DType D> struct DTypeTag {
  static constexpr DType value = D;
};

template <class F> MIXPREC_INLINE decltype(auto) with_dtype(DType d, F&& f) {
  switch (d) {
    case DType::kFloat16:
      return f(DTypeTag<DType::kFloat16>{});
    case DType::kBFloat16:
      return f(DTypeTag<DType::kBFloat16>{});
    default:
      return f(DTypeTag<DType::kFloat32>{});
  }
}

MIXPREC_INLINE int64_t element_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }

// Loads n (<= kTile) elements at element offset `at` of a tensor of dtype d into fp32.
MIXPREC_INLINE void load_tile(DType d, const void* base, int64_t at, int64_t n, float* dst) {
  const char* src = static_cast<const char*>(base) + at * element_size(d);
  switch (d) {
    case DType::kFloat32:
      load_tile_as<DType::kFloat32>(src, n, dst);
      break;
    case DType::kFloat16:
      load_tile_as<DType::kFloat16>(src, n, dst);
      break;
    case DType::kBFloat16:
      load_tile_as<DType::kBFloat16>(src, n, dst);
      break;
  }
}

MIXPREC_INLINE void store_tile(DType d, const float* src, void* base, int64_t at, int64_t n) {
  char* dst = static_cast<char*>(base) + at * element_size(d);
  switch (d) {
    case DType::kFloat32:
      store_tile_as<DType::kFloat32>(src, n, dst);
      break;
    case DType::kFloat16:
      store_tile_as<DType::kFloat16>(src, n, dst);
      break;
    case DType::kBFloat16:
      store_tile_as<DType::kBFloat16>(src, n, dst);
      break;
  }
}

}  // namespace mixprec::kernels::cpu
