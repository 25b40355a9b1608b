// CPU kernels of the loss-scaling family: fused non-finite check and unscale over a range of
// chunks (the ops tier spreads chunks over threads), and the scale update.
#include "kernels/loss_scale.h"

#include "kernels/cpu/simd.h"

namespace mixprec::kernels {
namespace {

// One pass over n elements, one instantiation per (input dtype, output dtype, writes or not), so
// the loop holds no dtype switch: each element is read once, tested for inf/NaN (the input, as
// torch tests it, not the product), multiplied by s in fp32 and rounded once to the output dtype.
// Returns whether any element was inf or NaN.
using SpanFn = bool (*)(const void* in, void* out, int64_t begin, int64_t n, float s);

// The portable path (any CPU): integer tests of the exponent bits, which compilers vectorize
// without fast-math.
template <DType In, DType Out, bool kWrite>
bool unscale_span_portable(const void* in, void* out, int64_t begin, int64_t n, float s) {
  uint32_t bad = 0;
  for (int64_t i = begin; i < begin + n; ++i) {
    const float x = cpu::load_one<In>(in, i);
    bad |= static_cast<uint32_t>(!cpu::is_finite(x));
    if constexpr (kWrite) cpu::store_one<Out>(out, i, x * s);
  }
  return bad != 0;
}

#if MIXPREC_HAVE_X86_V3
// AVX2/F16C: 16 elements per step, conversions in hardware, a running max of |x|'s bits for the
// check; the tail (< 8 elements) goes through the portable element code.
template <DType In, DType Out, bool kWrite>
MIXPREC_TARGET_V3 bool unscale_span_v3(const void* in, void* out, int64_t begin, int64_t n, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  __m256i worst = _mm256_setzero_si256();
  const int64_t end = begin + n;
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m256 a = cpu::v3::load8<In>(in, i), b = cpu::v3::load8<In>(in, i + 8);
    worst = _mm256_max_epu32(worst, _mm256_max_epu32(cpu::v3::abs_bits(a), cpu::v3::abs_bits(b)));
    if constexpr (kWrite) {
      cpu::v3::store8<Out>(out, i, _mm256_mul_ps(a, vs));
      cpu::v3::store8<Out>(out, i + 8, _mm256_mul_ps(b, vs));
    }
  }
  for (; i + 8 <= end; i += 8) {
    const __m256 a = cpu::v3::load8<In>(in, i);
    worst = _mm256_max_epu32(worst, cpu::v3::abs_bits(a));
    if constexpr (kWrite) cpu::v3::store8<Out>(out, i, _mm256_mul_ps(a, vs));
  }
  const bool bad = cpu::v3::any_non_finite(worst);
  return unscale_span_portable<In, Out, kWrite>(in, out, i, end - i, s) || bad;
}
#endif

template <DType In, DType Out, bool kWrite> SpanFn pick_isa() {
#if MIXPREC_HAVE_X86_V3
  if (cpu::use_x86_v3()) return &unscale_span_v3<In, Out, kWrite>;
#endif
  return &unscale_span_portable<In, Out, kWrite>;
}

SpanFn pick_span(DType in_type, DType out_type, bool write) {
  return cpu::with_dtype(in_type, [&](auto in) {
    return cpu::with_dtype(out_type, [&](auto out) {
      return write ? pick_isa<decltype(in)::value, decltype(out)::value, true>()
                   : pick_isa<decltype(in)::value, decltype(out)::value, false>();
    });
  });
}

}  // namespace

void non_finite_check_and_unscale_cpu(const UnscaleParams& p, int64_t chunk_begin, int64_t chunk_end) {
  const TensorGroup& g = *p.group;
  const bool write = g.num_lists == 2;
  // One group has one dtype per list, so the instantiation is chosen once per range of chunks.
  const SpanFn span = pick_span(g.dtypes[0], write ? g.dtypes[1] : g.dtypes[0], write);
  const float s = p.inv_scale != nullptr ? *p.inv_scale : 1.f;
  const bool bad_scale = p.inv_scale != nullptr && is_bad_inv_scale(s);
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const ChunkRef c = resolve_chunk(g, chunk);
    const bool bad = span(g.ptrs[0][c.tensor], write ? g.ptrs[1][c.tensor] : nullptr, c.begin, c.size, s);
    if (bad || bad_scale) {
      // Several threads may store the same 1.f; plain stores of one value are what the CUDA
      // kernel does too, and every reader runs after the parallel region has joined.
      if (p.found_inf != nullptr) *p.found_inf = 1.f;
      if (p.per_tensor_found != nullptr) p.per_tensor_found[g.index[c.tensor]] = 1.f;
    }
  }
}

void update_scale_cpu(const ScaleUpdateParams& p) { update_scale_step(p); }

}  // namespace mixprec::kernels
