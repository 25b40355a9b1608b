// CPU kernel of the fused Adam/AdamW step: each chunk streams through L1-sized fp32 tiles, and
// the update loop over a tile is plain arithmetic the compiler vectorizes (AVX2 clone on x86-64).
// fp32/bf16 moments run on the streaming skeleton (cpu::stream_tiles); 8-bit moments keep a loop
// of their own (adam_chunk_q8 says why).
#include "kernels/adam.h"

#include <cmath>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/optim_weights.h"
#include "kernels/quant8.h"

namespace mixprec::kernels {
namespace {

// One tile loop per amsgrad mode, on the streaming skeleton (cpu::stream_tiles): with amsgrad
// max_exp_avg_sq is a third state list; without it the list is none of the step's (the update
// writes a per-element dummy the compiler drops), so the loop streams two. The flag is fixed in
// the local copy, so that the update loop has no branch and vectorizes.
template <bool kAmsgrad>
MIXPREC_INLINE void adam_tiles(const AdamParams& p, const AdamCoefficients& coefficients, int64_t t, int64_t begin,
                               int64_t n) {
  AdamCoefficients c = coefficients;  // a local copy: see cpu::stream_tiles
  c.amsgrad = kAmsgrad;
  if constexpr (kAmsgrad) {
    const cpu::TileState moments[] = {{kAdamExpAvg}, {kAdamExpAvgSq}, {kAdamMaxExpAvgSq}};
    cpu::stream_tiles(p.weights, p.scalars, *p.group, kAdamGrad, moments, t, begin, n,
                      [&](float& g, float& w, float& m, float& v, float& v_max) { adam_update(c, g, w, m, v, v_max); });
  } else {
    const cpu::TileState moments[] = {{kAdamExpAvg}, {kAdamExpAvgSq}};
    cpu::stream_tiles(p.weights, p.scalars, *p.group, kAdamGrad, moments, t, begin, n,
                      [&](float& g, float& w, float& m, float& v) {
                        float unused_max;  // a per-element dummy: a shared one would be a loop-carried store
                        adam_update(c, g, w, m, v, unused_max);
                      });
  }
}

MIXPREC_CPU_CLONES void adam_chunk(const AdamParams& p, const AdamCoefficients& c, int64_t t, int64_t begin,
                                   int64_t n) {
  if (c.amsgrad) adam_tiles<true>(p, c, t, begin, n);
  else adam_tiles<false>(p, c, t, begin, n);
}

// 8-bit moments (kernels/quant8.h): each tile (whole quantization blocks, as chunks and tiles
// start at multiples of kQuantBlock) is dequantized, updated and requantized with the new absmax of
// each block, so the pass still reads and writes every operand once. Not on the streaming skeleton:
// its states are element tiles of a float dtype, loaded and stored one list at a time, while a
// code decodes only with its block's scale and is encoded only after a reduction over its whole
// updated block (the new absmax), a step between the update and the stores the skeleton does
// not have (CUDA's AdamQ8Op stays off OptimStream for the same reason).
MIXPREC_CPU_CLONES void adam_chunk_q8(const AdamParams& p, const AdamCoefficients& coefficients, int64_t t,
                                      int64_t begin, int64_t n) {
  static_assert(cpu::kTile % kQuantBlock == 0, "a tile holds whole quantization blocks");
  const AdamCoefficients c = coefficients;
  const TensorGroup& g = *p.group;
  auto* avg_codes = static_cast<int8_t*>(g.ptrs[kAdamExpAvg][t]);
  auto* sq_codes = static_cast<uint8_t*>(g.ptrs[kAdamExpAvgSq][t]);
  auto* avg_scales = static_cast<float*>(g.ptrs[kAdamExpAvgScale][t]);
  auto* sq_scales = static_cast<float*>(g.ptrs[kAdamExpAvgSqScale][t]);
  alignas(64) float grad[cpu::kTile], w[cpu::kTile], m[cpu::kTile], v[cpu::kTile];
  for (int64_t at = begin; at < begin + n; at += cpu::kTile) {
    const int64_t len = std::min(cpu::kTile, begin + n - at);
    cpu::load_tile(g.dtypes[kAdamGrad], g.ptrs[kAdamGrad][t], at, len, grad);
    cpu::load_weights(p.weights, g, t, at, len, w);
    for (int64_t b = 0; b < len; b += kQuantBlock) {
      const int64_t end = std::min(len, b + kQuantBlock);
      const float avg_scale = avg_scales[(at + b) / kQuantBlock], sq_scale = sq_scales[(at + b) / kQuantBlock];
      for (int64_t i = b; i < end; ++i) {
        m[i] = q8_decode_signed(avg_codes[at + i], avg_scale);
        v[i] = q8_decode_sq(sq_codes[at + i], sq_scale);
      }
    }
    for (int64_t i = 0; i < len; ++i) {
      float unused_max;
      adam_update(c, grad[i], w[i], m[i], v[i], unused_max);
    }
    if (stores_unscaled_grads(p.scalars)) cpu::store_tile(g.dtypes[kAdamGrad], grad, g.ptrs[kAdamGrad][t], at, len);
    cpu::store_weights(p.weights, p.scalars, g, t, at, len, w);
    for (int64_t b = 0; b < len; b += kQuantBlock) {
      const int64_t end = std::min(len, b + kQuantBlock);
      // The absmax as an integer max over the bits of |x|: non-negative floats order as their
      // bits, and a NaN's bits exceed every number's, so a NaN moment still gives its block a NaN
      // scale, as q8_absmax does on CUDA; unlike a NaN-keeping float max, this reduction vectorizes.
      uint32_t avg_bits = 0, sq_bits = 0;
      for (int64_t i = b; i < end; ++i) {
        v[i] = sqrtf(v[i]);  // from here on v holds sqrt(exp_avg_sq), the quantity coded
        avg_bits = std::max(avg_bits, float_bits(fabsf(m[i])));
        sq_bits = std::max(sq_bits, float_bits(fabsf(v[i])));
      }
      const float avg_max = bits_float(avg_bits), sq_max = bits_float(sq_bits);
      for (int64_t i = b; i < end; ++i) {
        avg_codes[at + i] = q8_encode_signed(m[i], avg_max);
        sq_codes[at + i] = q8_encode_root(v[i], sq_max);
      }
      avg_scales[(at + b) / kQuantBlock] = avg_max;
      sq_scales[(at + b) / kQuantBlock] = sq_max;
    }
  }
}

}  // namespace

void adam_cpu(const AdamParams& p, int64_t chunk_begin, int64_t chunk_end) {
  if (step_skipped(p.scalars)) return;
  const AdamCoefficients c = adam_coefficients(p);
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const ChunkRef r = resolve_chunk(*p.group, chunk);
    if (p.quant8) adam_chunk_q8(p, c, r.tensor, r.begin, r.size);
    else adam_chunk(p, c, r.tensor, r.begin, r.size);
  }
}

}  // namespace mixprec::kernels
