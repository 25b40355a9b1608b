// CPU kernels of the FP8 family: the saturating cast with its fused amax (flat spans, or tiles of
// rows that also write the transpose) and the scale update. The CI reference for the CUDA kernels.
#include "kernels/fp8.h"

#include "kernels/cpu/convert.h"
#include "kernels/cpu/simd.h"

namespace mixprec::kernels {
namespace {

// One instantiation per (input dtype, format, writes or not): no switch in the loop, which the
// compiler vectorizes (the encoding is branch-free integer and float arithmetic).
template <DType D, Fp8Format F, bool kWrite>
MIXPREC_INLINE uint32_t span_body(const void* x, uint8_t* out, int64_t begin, int64_t end, float s) {
  uint32_t worst = 0;
  for (int64_t i = begin; i < end; ++i) {
    const float v = cpu::load_one<D>(x, i);
    const uint32_t b = fp8_abs_bits(v);
    worst = b > worst ? b : worst;
    if constexpr (kWrite) out[i] = fp8_encode_as<F>(v * s);
  }
  return worst;
}

using SpanFn = uint32_t (*)(const void*, uint8_t*, int64_t, int64_t, float);

template <DType D, Fp8Format F, bool kWrite>
uint32_t span_portable(const void* x, uint8_t* out, int64_t begin, int64_t end, float s) {
  return span_body<D, F, kWrite>(x, out, begin, end, s);
}

#if MIXPREC_HAVE_X86_V3
// The same loop compiled for AVX2/F16C, picked at run time where the CPU has them.
template <DType D, Fp8Format F, bool kWrite>
MIXPREC_TARGET_V3 uint32_t span_v3(const void* x, uint8_t* out, int64_t begin, int64_t end, float s) {
  return span_body<D, F, kWrite>(x, out, begin, end, s);
}
#endif

template <DType D, Fp8Format F, bool kWrite> SpanFn pick_isa() {
#if MIXPREC_HAVE_X86_V3
  if (cpu::use_x86_v3()) return &span_v3<D, F, kWrite>;
#endif
  return &span_portable<D, F, kWrite>;
}

SpanFn pick_span(DType d, Fp8Format f, bool write) {
  return cpu::with_dtype(d, [&](auto tag) {
    constexpr DType kD = decltype(tag)::value;
    if (!write) return pick_isa<kD, Fp8Format::kE4M3, false>();
    return f == Fp8Format::kE4M3 ? pick_isa<kD, Fp8Format::kE4M3, true>() : pick_isa<kD, Fp8Format::kE5M2, true>();
  });
}

}  // namespace

uint32_t fp8_quantize_span_cpu(const Fp8QuantizeParams& p, int64_t begin, int64_t end) {
  const bool write = p.out != nullptr;
  return pick_span(p.x_dtype, p.format, write)(p.x, p.out, begin, end, write ? *p.scale : 1.f);
}

uint32_t fp8_quantize_tiles_cpu(const Fp8QuantizeParams& p, int64_t tile_begin, int64_t tile_end) {
  // A tile is kFp8CpuTileRows rows: each row is cast as a flat span (vectorized), then the tile's
  // codes are written to out_t column block by column block, so the strided writes of the
  // transpose stay within a few cache lines per row of out_t.
  const SpanFn span = pick_span(p.x_dtype, p.format, true);
  const float s = *p.scale;
  constexpr int64_t kCols = 64;
  uint32_t worst = 0;
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const int64_t r0 = t * kFp8CpuTileRows;
    const int64_t r1 = r0 + kFp8CpuTileRows < p.rows ? r0 + kFp8CpuTileRows : p.rows;
    const uint32_t w = span(p.x, p.out, r0 * p.cols, r1 * p.cols, s);
    worst = w > worst ? w : worst;
    for (int64_t c0 = 0; c0 < p.cols; c0 += kCols) {
      const int64_t c1 = c0 + kCols < p.cols ? c0 + kCols : p.cols;
      for (int64_t c = c0; c < c1; ++c) {
        uint8_t* dst = p.out_t + c * p.rows;
        for (int64_t r = r0; r < r1; ++r) dst[r] = p.out[r * p.cols + c];
      }
    }
  }
  return worst;
}

void fp8_update_scale_cpu(const Fp8ScaleParams& p) { fp8_update_scale_step(p); }

}  // namespace mixprec::kernels
