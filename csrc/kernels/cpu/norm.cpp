// CPU kernels of the multi-tensor norm: per-chunk partials (fp32 lanes, vectorized, read straight
// from the tensors), then per-tensor and total norms reduced from the partials in a fixed order.
#include "kernels/norm.h"

#include <cmath>

#include "kernels/cpu/simd.h"

namespace mixprec::kernels {
namespace {

// Independent accumulators, lane l taking elements begin + 16k + l: two AVX2 registers' worth.
// Both paths below keep this order and, on x86-64 where both exist, neither contracts into FMAs
// (the baseline has none and the vector target leaves "fma" out), so they agree bit for bit.
constexpr int kLanes = 16;

MIXPREC_INLINE float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

template <NormType T> MIXPREC_INLINE float accumulate(float acc, float x) {
  if constexpr (T == NormType::kL2) return acc + x * x;
  else return nan_max(acc, std::fabs(x));
}

template <NormType T> MIXPREC_INLINE float reduce_lanes(const float* acc) {
  float r = acc[0];
  for (int l = 1; l < kLanes; ++l) r = T == NormType::kL2 ? r + acc[l] : nan_max(r, acc[l]);
  return r;
}

// The last `rest` (< kLanes) elements, from `at`, into lanes 0.. (the lanes a full step would use).
template <DType D, NormType T>
MIXPREC_INLINE void accumulate_tail(const void* in, int64_t at, int64_t rest, float* acc) {
  for (int64_t l = 0; l < rest; ++l) acc[l] = accumulate<T>(acc[l], cpu::load_one<D>(in, at + l));
}

// Portable path: read straight from the tensor, 16 lanes the compiler vectorizes (SLP).
template <DType D, NormType T> float norm_span_portable(const void* in, int64_t begin, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = begin;
  for (; i + kLanes <= begin + n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] = accumulate<T>(acc[l], cpu::load_one<D>(in, i + l));
  accumulate_tail<D, T>(in, i, begin + n - i, acc);
  return reduce_lanes<T>(acc);
}

#if MIXPREC_HAVE_X86_V3
template <NormType T> MIXPREC_TARGET_V3 MIXPREC_INLINE __m256 accumulate8(__m256 acc, __m256 x) {
  if constexpr (T == NormType::kL2) {
    return _mm256_add_ps(acc, _mm256_mul_ps(x, x));
  } else {
    // nan_max(acc, |x|): keep acc where it is NaN or larger, else take |x| (NaN included).
    const __m256 ax = _mm256_castsi256_ps(cpu::v3::abs_bits(x));
    const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(acc, ax, _CMP_GT_OQ), _mm256_cmp_ps(acc, acc, _CMP_UNORD_Q));
    return _mm256_blendv_ps(ax, acc, keep);
  }
}

// AVX2/F16C path: hardware conversions, no staging buffer.
template <DType D, NormType T> MIXPREC_TARGET_V3 float norm_span_v3(const void* in, int64_t begin, int64_t n) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  int64_t i = begin;
  for (; i + kLanes <= begin + n; i += kLanes) {
    lo = accumulate8<T>(lo, cpu::v3::load8<D>(in, i));
    hi = accumulate8<T>(hi, cpu::v3::load8<D>(in, i + 8));
  }
  alignas(32) float acc[kLanes];
  _mm256_store_ps(acc, lo);
  _mm256_store_ps(acc + 8, hi);
  accumulate_tail<D, T>(in, i, begin + n - i, acc);
  return reduce_lanes<T>(acc);
}
#endif

using NormSpanFn = float (*)(const void* in, int64_t begin, int64_t n);

template <DType D, NormType T> NormSpanFn pick_isa() {
#if MIXPREC_HAVE_X86_V3
  if (cpu::use_x86_v3()) return &norm_span_v3<D, T>;
#endif
  return &norm_span_portable<D, T>;
}

NormSpanFn pick_span(DType d, NormType type) {
  return cpu::with_dtype(d, [&](auto tag) {
    constexpr DType D = decltype(tag)::value;
    return type == NormType::kL2 ? pick_isa<D, NormType::kL2>() : pick_isa<D, NormType::kInf>();
  });
}

float reduce_partials(NormType type, const float* partials, int64_t begin, int64_t end) {
  double sum = 0.0;  // the few partials are summed in double: cheap, and order-independent enough
  float mx = 0.f;
  for (int64_t i = begin; i < end; ++i) {
    if (type == NormType::kL2) sum += partials[i];
    else mx = nan_max(mx, partials[i]);
  }
  return type == NormType::kL2 ? static_cast<float>(std::sqrt(sum)) : mx;
}

}  // namespace

void norm_partials_cpu(const NormParams& p, int64_t chunk_begin, int64_t chunk_end) {
  const TensorGroup& g = *p.group;
  const NormSpanFn span = pick_span(g.dtypes[0], p.type);
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const ChunkRef c = resolve_chunk(g, chunk);
    p.partials[g.first_chunk[c.tensor] + (chunk - g.chunk_prefix[c.tensor])] =
        span(g.ptrs[0][c.tensor], c.begin, c.size);
  }
}

void norm_finalize_cpu(const NormFinalizeParams& p) {
  if (p.per_tensor != nullptr) {
    const TensorGroup& all = *p.all;
    for (int64_t i = 0; i < all.size(); ++i)
      p.per_tensor[all.index[i]] =
          reduce_partials(p.type, p.partials, all.first_chunk[i], all.first_chunk[i] + num_chunks(all.numel[i]));
  }
  *p.total = reduce_partials(p.type, p.partials, 0, p.total_chunks);
}

}  // namespace mixprec::kernels
