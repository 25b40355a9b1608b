// Torch-free entry points and per-element math of the FP8 family (saturating cast with a fused
// amax, and the scale update from an amax history), shared by the CPU and CUDA kernels.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/float_bits.h"
#include "kernels/multi_tensor.h"

namespace mixprec::kernels {

// The two OCP FP8 formats torch names float8_e4m3fn (no inf, max 448) and float8_e5m2 (max 57344).
enum class Fp8Format : int8_t { kE4M3 = 0, kE5M2 = 1 };

constexpr float kFp8E4M3Max = 448.f;
constexpr float kFp8E5M2Max = 57344.f;

// v rounded to nearest even into an FP8 format with kMan mantissa bits and exponent bias kBias,
// saturated first to +-max_value: +-inf becomes +-max (a scaled tensor never produces FP8 inf),
// NaN becomes the format's NaN (0x7f, with v's sign, as torch writes it). Branch-free, so the
// CPU loop vectorizes and CUDA threads do not diverge.
template <int kMan, int kBias> MIXPREC_HOST_DEVICE inline uint8_t fp8_encode(float v, float max_value) {
  const uint32_t u = float_bits(v);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t mag = u & 0x7fffffffu;
  const bool nan = mag > 0x7f800000u;
  // Saturate on the bits: for non-negative floats integer order is float order.
  const uint32_t max_bits = float_bits(max_value);
  const uint32_t a = mag < max_bits ? mag : max_bits;
  // Normal range: rebias the exponent, round the dropped mantissa bits to nearest even. A value
  // at max_value never rounds past it (max is representable, and a <= max).
  constexpr int kShift = 23 - kMan;
  constexpr uint32_t kRebias = static_cast<uint32_t>(127 - kBias) << 23;
  const uint32_t normal = (a - kRebias + ((1u << (kShift - 1)) - 1u) + ((a >> kShift) & 1u)) >> kShift;
  // Subnormal range (below 2^(1-kBias)): count units of the smallest subnormal 2^(1-kBias-kMan).
  // The scaling by a power of two is exact; adding 2^23 rounds the count to nearest even in the
  // float unit (the count is < 2^kMan), and a count of 2^kMan is the smallest normal's code.
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - kBias) << 23;
  constexpr uint32_t kUnitsBits = static_cast<uint32_t>(127 + kBias - 1 + kMan) << 23;  // 2^(kBias-1+kMan)
  const float units = bits_float(a < kMinNormalBits ? a : 0u) * bits_float(kUnitsBits);
  const uint32_t sub = float_bits(units + 8388608.f) - 0x4b000000u;
  const uint32_t code = a < kMinNormalBits ? sub : normal;
  return static_cast<uint8_t>(sign | (nan ? 0x7fu : code));
}

MIXPREC_HOST_DEVICE inline uint8_t fp8_encode_e4m3(float v) { return fp8_encode<3, 7>(v, kFp8E4M3Max); }
MIXPREC_HOST_DEVICE inline uint8_t fp8_encode_e5m2(float v) { return fp8_encode<2, 15>(v, kFp8E5M2Max); }

template <Fp8Format F> MIXPREC_HOST_DEVICE inline uint8_t fp8_encode_as(float v) {
  if constexpr (F == Fp8Format::kE4M3) return fp8_encode_e4m3(v);
  else return fp8_encode_e5m2(v);
}

// |x| as bits, combined by an unsigned max: the order of non-negative floats, with NaN above inf,
// so the running max of a tensor holding NaN is NaN (the amax must show the non-finite input).
MIXPREC_HOST_DEVICE inline uint32_t fp8_abs_bits(float x) { return float_bits(x) & 0x7fffffffu; }

// One pass over x [rows, cols] (row-major, contiguous): out = fp8(x * scale), out_t = its
// transpose [cols, rows] when not null, and *amax = max(*amax, max |x|) when not null. With out
// null the pass only reads (the amax of current scaling, taken before the scale exists).
struct Fp8QuantizeParams {
  const void* x = nullptr;
  DType x_dtype = DType::kFloat32;
  uint8_t* out = nullptr;
  uint8_t* out_t = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  const float* scale = nullptr;  // device scalar; null only when out is null
  float* amax = nullptr;         // device scalar, max-accumulated; may be null
  Fp8Format format = Fp8Format::kE4M3;
};

// The CPU kernels return the max |x| bits of their range; the ops tier combines the ranges of
// its threads and folds the result into *amax (kernels never write amax on the CPU).
// Elements [begin, end) of x viewed flat (no transpose).
uint32_t fp8_quantize_span_cpu(const Fp8QuantizeParams& p, int64_t begin, int64_t end);
// Row tiles [tile_begin, tile_end) of kFp8CpuTileRows rows each, writing out and out_t.
constexpr int64_t kFp8CpuTileRows = 32;
uint32_t fp8_quantize_tiles_cpu(const Fp8QuantizeParams& p, int64_t tile_begin, int64_t tile_end);
void fp8_quantize_cuda(const Fp8QuantizeParams& p, Stream stream);

// Scale update from an amax history, all on the device: the step's amax (max-accumulated by the
// casts since the last update) is pushed into history[0] (older entries shift by one, the
// oldest drops out) and reset to 0; the history is reduced (max over it, or its newest entry);
// and scale = fp8_max / (reduced * 2^margin). A reduced amax that is 0 (nothing seen), inf or
// NaN, or a scale that would not be a finite positive float, keeps the previous scale.
struct Fp8ScaleParams {
  float* scale = nullptr;
  float* history = nullptr;  // [history_len], newest first
  int64_t history_len = 1;
  float* amax = nullptr;
  float fp8_max = kFp8E4M3Max;
  double margin_factor = 1.0;  // 2^-margin
  bool reduce_max = true;      // false: the most recent amax
};

MIXPREC_HOST_DEVICE inline void fp8_update_scale_step(const Fp8ScaleParams& p) {
  for (int64_t i = p.history_len - 1; i > 0; --i) p.history[i] = p.history[i - 1];
  p.history[0] = *p.amax;
  *p.amax = 0.f;
  uint32_t reduced = fp8_abs_bits(p.history[0]);
  if (p.reduce_max)
    for (int64_t i = 1; i < p.history_len; ++i) {
      const uint32_t b = fp8_abs_bits(p.history[i]);
      reduced = b > reduced ? b : reduced;
    }
  if (reduced == 0u || reduced >= 0x7f800000u) return;  // zero, inf or NaN: keep the scale
  // In double: fp8_max / a tiny amax overflows float; the result is then tested once as a float.
  const float s = static_cast<float>(static_cast<double>(p.fp8_max) / bits_float(reduced) * p.margin_factor);
  const uint32_t sb = float_bits(s);
  if (sb != 0u && sb < 0x7f800000u) *p.scale = s;
}

void fp8_update_scale_cpu(const Fp8ScaleParams& p);
void fp8_update_scale_cuda(const Fp8ScaleParams& p, Stream stream);

}  // namespace mixprec::kernels
