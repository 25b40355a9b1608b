// CPU kernel of the fused Adagrad step: each chunk streams through L1-sized fp32 tiles, and the
// update loop over a tile is plain arithmetic the compiler vectorizes (AVX2 clone on x86-64).
#include "kernels/adagrad.h"

#include "kernels/cpu/convert.h"
#include "kernels/cpu/optim_weights.h"

namespace mixprec::kernels {
namespace {

MIXPREC_CPU_CLONES void adagrad_chunk(const AdagradParams& p, const AdagradCoefficients& coefficients, int64_t t,
                                      int64_t begin, int64_t n) {
  const AdagradCoefficients c = coefficients;  // a local copy: see cpu::stream_tiles
  const cpu::TileState sum[] = {{kAdagradStateSum}};
  cpu::stream_tiles(p.weights, p.scalars, *p.group, kAdagradGrad, sum, t, begin, n,
                    [&](float& g, float& w, float& h) { adagrad_update(c, g, w, h); });
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
