// Hand-vectorized 8-lane fp32/fp16/bf16 loads and stores for x86-64 CPUs with AVX2 and F16C, and
// the run-time choice between them and the portable scalar code of convert.h.
#pragma once

#include <cstdlib>
#include <cstring>

#include "kernels/cpu/convert.h"

// The vector paths are compiled into every x86-64 build (GCC or Clang) through target attributes,
// so the default build still runs on any x86-64 CPU and picks them at run time. "fma" is left out
// on purpose: without it the compiler cannot contract a*b+c, so the vector and the portable paths
// round alike and give bit-identical results on one machine.
#if defined(__x86_64__) && defined(__GNUC__)
#define MIXPREC_HAVE_X86_V3 1
#include <cpuid.h>
#include <immintrin.h>
#define MIXPREC_TARGET_V3 __attribute__((target("avx2,f16c")))
#else
#define MIXPREC_HAVE_X86_V3 0
#endif

namespace mixprec::kernels::cpu {

// Whether the AVX2/F16C paths run: decided once per process from the CPU. MIXPREC_CPU_SIMD=0 in
// the environment forces the portable path (the tests use it to cover that path on any machine).
inline bool use_x86_v3() {
#if MIXPREC_HAVE_X86_V3
  static const bool on = [] {
    const char* env = std::getenv("MIXPREC_CPU_SIMD");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    // avx2 through the compiler's check (it also asks the OS about the AVX register state);
    // F16C from CPUID leaf 1 directly, since not every compiler's check knows its name.
    __builtin_cpu_init();
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
    return __builtin_cpu_supports("avx2") && f16c;
  }();
  return on;
#else
  return false;
#endif
}

#if MIXPREC_HAVE_X86_V3
namespace v3 {

// Eight elements from p[i..i+8) as fp32. fp16 widens in hardware (exact, subnormals included);
// bf16 is the top half of an fp32, so a zero-extend and a shift.
template <DType D> MIXPREC_TARGET_V3 MIXPREC_INLINE __m256 load8(const void* p, int64_t i) {
  if constexpr (D == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (D == DType::kFloat16) return _mm256_cvtph_ps(h);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Eight fp32 values into p[i..i+8), rounded once to nearest even (fp16 in hardware: overflow to
// inf, NaN stays NaN; bf16 by the same integer rounding as convert.h's float_to_bf16).
template <DType D> MIXPREC_TARGET_V3 MIXPREC_INLINE void store8(void* p, int64_t i, __m256 v) {
  if constexpr (D == DType::kFloat32) {
    _mm256_storeu_ps(static_cast<float*>(p) + i, v);
  } else {
    __m128i h;
    if constexpr (D == DType::kFloat16) {
      h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    } else {
      const __m256i u = _mm256_castps_si256(v);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      const __m256i rounded =
          _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
      const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
      const __m256i nan =
          _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
      const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
      // Pack the 32-bit lanes (all <= 0xffff) to 16 bits; the pack works per 128-bit half, so the
      // quadwords are put back in order before the low half is taken.
      h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), h);
  }
}

// |x| as integer bits, for a running unsigned max: the max is >= 0x7f800000 iff some element was
// inf or NaN. Exact for every input, two instructions per vector.
MIXPREC_TARGET_V3 MIXPREC_INLINE __m256i abs_bits(__m256 x) {
  return _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff));
}

MIXPREC_TARGET_V3 MIXPREC_INLINE bool any_non_finite(__m256i max_abs_bits) {
  const __m256i bad = _mm256_cmpgt_epi32(max_abs_bits, _mm256_set1_epi32(0x7f7fffff));
  return _mm256_movemask_epi8(bad) != 0;
}

}  // namespace v3
#endif

}  // namespace mixprec::kernels::cpu
