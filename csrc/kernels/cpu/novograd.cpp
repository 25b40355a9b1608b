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

// One loop per moment mode, so that each vectorizes without a branch inside.
template <bool RegInsideMoment>
MIXPREC_INLINE void update_tile(const NovoGradCoefficients& c, float denom, float* grad, float* w, float* m,
                                int64_t len) {
  for (int64_t i = 0; i < len; ++i) novograd_update<RegInsideMoment>(c, denom, grad[i], w[i], m[i]);
}

MIXPREC_CPU_CLONES void novograd_chunk(const NovoGradParams& p, const NovoGradCoefficients& c, float denom, int64_t t,
                                       int64_t begin, int64_t n) {
  const TensorGroup& g = *p.group;
  alignas(64) float grad[cpu::kTile], w[cpu::kTile], m[cpu::kTile];
  for (int64_t at = begin; at < begin + n; at += cpu::kTile) {
    const int64_t len = std::min(cpu::kTile, begin + n - at);
    cpu::load_tile(g.dtypes[kNovoGradGrad], g.ptrs[kNovoGradGrad][t], at, len, grad);
    cpu::load_weights(p.weights, g, t, at, len, w);
    cpu::load_tile(DType::kFloat32, g.ptrs[kNovoGradExpAvg][t], at, len, m);
    if (c.reg_inside_moment) update_tile<true>(c, denom, grad, w, m, len);
    else update_tile<false>(c, denom, grad, w, m, len);
    if (stores_unscaled_grads(p.scalars))
      cpu::store_tile(g.dtypes[kNovoGradGrad], grad, g.ptrs[kNovoGradGrad][t], at, len);
    cpu::store_weights(p.weights, p.scalars, g, t, at, len, w);
    cpu::store_tile(DType::kFloat32, m, g.ptrs[kNovoGradExpAvg][t], at, len);
  }
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
