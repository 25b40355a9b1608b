// 8-bit block-quantized storage of Adam's moments (issue 24): per block of kQuantBlock elements one
// float32 scale (the block's absmax) and one byte per element, coded on a minifloat map relative to
// that scale. Host/device inline math, so the CPU and CUDA kernels code the same values to the same bits.
//
// The code map. x = |value| / scale lies in [0, 1]; its byte is a small float with a 4-bit
// exponent field e and kMant mantissa bits f, rounded to nearest (ties to the even code):
//   e >= 1: x = 2^(e - 15) * (1 + f / 2^kMant)     e = 15 holds only x = 1 (the block's absmax)
//   e == 0: x = 2^-14 * f / 2^kMant                 (even steps below 2^-14: zero stays zero)
// exp_avg (signed): sign and magnitude with kMant = 3, stored as +-magnitude in an int8 (|code| <= 120).
// exp_avg_sq: its square root s = sqrt(v) with kMant = 4 in a uint8 (code <= 240); the update
// divides by sqrt(v), so s's relative error is the denominator's, and s spans half v's exponent range.
// Round-trip bound, for a block of absmax A (tests/python/test_adam_8bit.py checks it):
//   |decoded - value| <= max(2^-(kMant+1) * |value|, 2^-(15+kMant) * A) * (1 + 2^-16)
// (the 2^-16 covers the two float32 roundings, of the ratio and of the decoded product; a
// subnormal A adds float32's underflow, at most 2^-150), i.e.
// 6.25% (exp_avg) and 3.125% (sqrt(exp_avg_sq)) relative down to 2^-14 * A, absolute below.
// The absmax itself decodes exactly (x = 1), so repeated steps do not shrink a block's scale.
#pragma once

#include <math.h>

#include <cstdint>

#include "kernels/float_bits.h"
#include "kernels/multi_tensor.h"

namespace mixprec::kernels {

// One warp of 32 lanes x 8 elements on CUDA; kChunkElems is a multiple, so a block never
// straddles a chunk (nor a CPU tile of cpu::kTile = 512).
constexpr int64_t kQuantBlock = 256;
static_assert(kChunkElems % kQuantBlock == 0, "a quantization block must not straddle a chunk");

constexpr int kQ8ExpMax = 15;                                 // exponent field of x = 1
constexpr int kQ8MantSigned = 3;                              // exp_avg: sign + 7 bits
constexpr int kQ8MantUnsigned = 4;                            // sqrt(exp_avg_sq): 8 bits
constexpr int kQ8MaxSigned = kQ8ExpMax << kQ8MantSigned;      // 120: the code of x = 1
constexpr int kQ8MaxUnsigned = kQ8ExpMax << kQ8MantUnsigned;  // 240

MIXPREC_HOST_DEVICE inline int64_t quant_blocks(int64_t numel) { return (numel + kQuantBlock - 1) / kQuantBlock; }

// x in [0, 1] -> its code; NaN -> 0 (a NaN block has a NaN scale, which its decoding carries).
template <int kMant> MIXPREC_HOST_DEVICE inline uint32_t q8_code(float x) {
  constexpr float kMinNormal = 1.f / 16384.f;                                  // 2^-14
  constexpr float kSubScale = static_cast<float>(int64_t{1} << (14 + kMant));  // 2^(14 + kMant), exact
  if (x >= kMinNormal) {
    // Round the fp32 mantissa to kMant bits, to nearest even, on the bits: a carry moves into the
    // exponent as it should; then rebias the exponent from fp32's 127 to the map's 15.
    constexpr int kShift = 23 - kMant;
    uint32_t b = float_bits(x);
    b += ((1u << (kShift - 1)) - 1u) + ((b >> kShift) & 1u);
    return (b >> kShift) - (static_cast<uint32_t>(127 - kQ8ExpMax) << kMant);
  }
  // Below 2^-14 the steps are even: rintf rounds half to even, as the bits above do.
  return x > 0.f ? static_cast<uint32_t>(rintf(x * kSubScale)) : 0u;
}

// code -> x in [0, 1], exactly.
template <int kMant> MIXPREC_HOST_DEVICE inline float q8_value(uint32_t code) {
  constexpr float kSubStep = 1.f / static_cast<float>(int64_t{1} << (14 + kMant));
  const uint32_t e = code >> kMant;
  if (e == 0) return static_cast<float>(code) * kSubStep;
  const uint32_t f = code & ((1u << kMant) - 1u);
  return bits_float(((e + 127u - kQ8ExpMax) << 23) | (f << (23 - kMant)));
}

// |value| / scale, one correctly rounded division (a reciprocal would overflow for a subnormal
// scale); 0 for a zero or NaN scale: every code 0 then, decoding to 0 or NaN.
MIXPREC_HOST_DEVICE inline float q8_ratio(float value, float scale) { return scale > 0.f ? fabsf(value) / scale : 0.f; }

// max that keeps a NaN (a NaN moment must give a NaN scale, never hide behind a finite one).
MIXPREC_HOST_DEVICE inline float q8_absmax(float acc, float x) {
  const float a = fabsf(x);
  return (a != a || a > acc) ? a : acc;
}

MIXPREC_HOST_DEVICE inline float q8_decode_signed(int8_t code, float scale) {
  const int c = code;
  const float x = q8_value<kQ8MantSigned>(static_cast<uint32_t>(c < 0 ? -c : c)) * scale;
  return c < 0 ? -x : x;
}

MIXPREC_HOST_DEVICE inline int8_t q8_encode_signed(float value, float scale) {
  const int mag = static_cast<int>(q8_code<kQ8MantSigned>(q8_ratio(value, scale)));
  return static_cast<int8_t>(value < 0.f ? -mag : mag);
}

// exp_avg_sq from the code of its square root.
MIXPREC_HOST_DEVICE inline float q8_decode_sq(uint8_t code, float scale) {
  const float s = q8_value<kQ8MantUnsigned>(code) * scale;
  return s * s;
}

// The code of s = sqrt(exp_avg_sq) (the scale is the block's absmax of s).
MIXPREC_HOST_DEVICE inline uint8_t q8_encode_root(float s, float scale) {
  return static_cast<uint8_t>(q8_code<kQ8MantUnsigned>(q8_ratio(s, scale)));
}

}  // namespace mixprec::kernels
