// CPU kernels of the fused NovoGrad step: the per-tensor moment update, and the element-wise pass
// streaming each chunk through L1-sized fp32 tiles whose update loop the compiler vectorizes
// (AVX2 clone on x86-64).
#include "kernels/novograd.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/optim_weights.h"

namespace mixprec::kernels {
namespace {

// One tile loop per moment mode, so that each update loop vectorizes without a branch inside.
template <bool RegInsideMoment>
MIXPREC_INLINE void novograd_tiles(const NovoGradParams& p, const NovoGradCoefficients& c, float denom, int64_t t,
                                   int64_t begin, int64_t n) {
  const cpu::TileState exp_avg[] = {{kNovoGradExpAvg}};
  cpu::stream_tiles(p.weights, p.scalars, *p.group, kNovoGradGrad, exp_avg, t, begin, n,
                    [&](float& g, float& w, float& m) { novograd_update<RegInsideMoment>(c, denom, g, w, m); });
}

MIXPREC_CPU_CLONES void novograd_chunk(const NovoGradParams& p, const NovoGradCoefficients& coefficients, float denom,
                                       int64_t t, int64_t begin, int64_t n) {
  const NovoGradCoefficients c = coefficients;  // a local copy: see cpu::stream_tiles
  if (c.reg_inside_moment) novograd_tiles<true>(p, c, denom, t, begin, n);
  else novograd_tiles<false>(p, c, denom, t, begin, n);
}

}  // namespace

void novograd_moment_cpu(const NovoGradMomentParams& p) {
  if (step_skipped(p.scalars)) return;
  const float inv_scale = grad_inv_scale(p.scalars);
  const bool seed = novograd_seeds(p.scalars, p.args.init_zero);
  const float beta2 = static_cast<float>(p.args.beta2);
  for (int64_t i = 0; i < p.num_tensors; ++i)
    p.exp_avg_sq_norms[i] = novograd_moment(p.type, p.exp_avg_sq_norms[i], p.grad_norms[i] * inv_scale, beta2, seed);
}

void novograd_cpu(const NovoGradParams& p, int64_t chunk_begin, int64_t chunk_end) {
  if (step_skipped(p.scalars)) return;
  const NovoGradCoefficients c = novograd_coefficients(p);
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const ChunkRef r = resolve_chunk(*p.group, chunk);
    const float denom = novograd_denom(c, p.exp_avg_sq_norms[p.group->index[r.tensor]]);
    novograd_chunk(p, c, denom, r.tensor, r.begin, r.size);
  }
}

}  // namespace mixprec::kernels
