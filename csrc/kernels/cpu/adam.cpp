// CPU kernel of the fused Adam/AdamW step: each chunk streams through L1-sized fp32 tiles, and
// the update loop over a tile is plain arithmetic the compiler vectorizes (AVX2 clone on x86-64).
#include "kernels/adam.h"

#include <cmath>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/optim_weights.h"

namespace mixprec::kernels {
namespace {

MIXPREC_CPU_CLONES void adam_chunk(const AdamParams& p, const AdamCoefficients& coefficients, int64_t t, int64_t begin,
                                   int64_t n) {
  // A local copy: through the reference every store into the tiles might change a coefficient,
  // and the compiler would keep the update loop scalar.
  const AdamCoefficients c = coefficients;
  const TensorGroup& g = *p.group;
  alignas(64) float grad[cpu::kTile], w[cpu::kTile], m[cpu::kTile], v[cpu::kTile], vm[cpu::kTile];
  for (int64_t at = begin; at < begin + n; at += cpu::kTile) {
    const int64_t len = std::min(cpu::kTile, begin + n - at);
    cpu::load_tile(g.dtypes[kAdamGrad], g.ptrs[kAdamGrad][t], at, len, grad);
    cpu::load_weights(p.weights, g, t, at, len, w);
    cpu::load_tile(g.dtypes[kAdamExpAvg], g.ptrs[kAdamExpAvg][t], at, len, m);
    cpu::load_tile(g.dtypes[kAdamExpAvgSq], g.ptrs[kAdamExpAvgSq][t], at, len, v);
    if (c.amsgrad) {
      cpu::load_tile(g.dtypes[kAdamMaxExpAvgSq], g.ptrs[kAdamMaxExpAvgSq][t], at, len, vm);
      for (int64_t i = 0; i < len; ++i) adam_update(c, grad[i], w[i], m[i], v[i], vm[i]);
      cpu::store_tile(g.dtypes[kAdamMaxExpAvgSq], vm, g.ptrs[kAdamMaxExpAvgSq][t], at, len);
    } else {
      for (int64_t i = 0; i < len; ++i) {
        float unused_max;  // a per-iteration dummy: a shared one would be a loop-carried store
        adam_update(c, grad[i], w[i], m[i], v[i], unused_max);
      }
    }
    if (stores_unscaled_grads(p.scalars)) cpu::store_tile(g.dtypes[kAdamGrad], grad, g.ptrs[kAdamGrad][t], at, len);
    cpu::store_weights(p.weights, p.scalars, g, t, at, len, w);
    cpu::store_tile(g.dtypes[kAdamExpAvg], m, g.ptrs[kAdamExpAvg][t], at, len);
    cpu::store_tile(g.dtypes[kAdamExpAvgSq], v, g.ptrs[kAdamExpAvgSq][t], at, len);
  }
}

}  // namespace

void adam_cpu(const AdamParams& p, int64_t chunk_begin, int64_t chunk_end) {
  if (step_skipped(p.scalars)) return;
  const AdamCoefficients c = adam_coefficients(p);
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const ChunkRef r = resolve_chunk(*p.group, chunk);
    adam_chunk(p, c, r.tensor, r.begin, r.size);
  }
}

}  // namespace mixprec::kernels
