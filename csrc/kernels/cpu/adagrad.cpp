// CPU kernel of the fused Adagrad step: each chunk streams through L1-sized fp32 tiles, and the
// update loop over a tile is plain arithmetic the compiler vectorizes (AVX2 clone on x86-64).
#include "kernels/adagrad.h"

#include "kernels/cpu/convert.h"
#include "kernels/cpu/optim_weights.h"

namespace mixprec::kernels {
namespace {

MIXPREC_CPU_CLONES void adagrad_chunk(const AdagradParams& p, const AdagradCoefficients& c, int64_t t, int64_t begin,
                                      int64_t n) {
  const TensorGroup& g = *p.group;
  alignas(64) float grad[cpu::kTile], w[cpu::kTile], h[cpu::kTile];
  for (int64_t at = begin; at < begin + n; at += cpu::kTile) {
    const int64_t len = std::min(cpu::kTile, begin + n - at);
    cpu::load_tile(g.dtypes[kAdagradGrad], g.ptrs[kAdagradGrad][t], at, len, grad);
    cpu::load_weights(p.weights, g, t, at, len, w);
    cpu::load_tile(DType::kFloat32, g.ptrs[kAdagradStateSum][t], at, len, h);
    for (int64_t i = 0; i < len; ++i) adagrad_update(c, grad[i], w[i], h[i]);
    if (stores_unscaled_grads(p.scalars))
      cpu::store_tile(g.dtypes[kAdagradGrad], grad, g.ptrs[kAdagradGrad][t], at, len);
    cpu::store_weights(p.weights, p.scalars, g, t, at, len, w);
    cpu::store_tile(DType::kFloat32, h, g.ptrs[kAdagradStateSum][t], at, len);
  }
}

}  // namespace

void adagrad_cpu(const AdagradParams& p, int64_t chunk_begin, int64_t chunk_end) {
  if (step_skipped(p.scalars)) return;
  const AdagradCoefficients c = adagrad_coefficients(p);
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const ChunkRef r = resolve_chunk(*p.group, chunk);
    adagrad_chunk(p, c, r.tensor, r.begin, r.size);
  }
}

}  // namespace mixprec::kernels
