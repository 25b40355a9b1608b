// CPU kernels of the fused LAMB step (see kernels/lamb.h): each chunk streams through L1-sized
// fp32 tiles whose update loops the compiler vectorizes (AVX2 clone on x86-64).
#include "kernels/lamb.h"

#include <cmath>

#include "kernels/cpu/convert.h"
#include "kernels/cpu/optim_weights.h"

namespace mixprec::kernels {
namespace {

constexpr int kLanes = 16;  // independent partial sums (two AVX2 registers), as kernels/cpu/norm.cpp

// Pass 1 over one chunk: its partial sums of w^2 and u^2, or (no trust ratio) the whole step.
MIXPREC_CPU_CLONES void lamb_moments_chunk(const LambParams& p, const LambCoefficients& c, int64_t t, int64_t begin,
                                           int64_t n, float& w_sq, float& u_sq) {
  const TensorGroup& g = *p.group;
  alignas(64) float grad[cpu::kTile], w[cpu::kTile], m[cpu::kTile], v[cpu::kTile], u[cpu::kTile];
  const bool apply = !p.trust_ratio;
  float w_acc[kLanes] = {}, u_acc[kLanes] = {};
  for (int64_t at = begin; at < begin + n; at += cpu::kTile) {
    const int64_t len = std::min(cpu::kTile, begin + n - at);
    cpu::load_tile(g.dtypes[kLambGrad], g.ptrs[kLambGrad][t], at, len, grad);
    cpu::load_weights(p.weights, g, t, at, len, w);
    cpu::load_tile(DType::kFloat32, g.ptrs[kLambExpAvg][t], at, len, m);
    cpu::load_tile(DType::kFloat32, g.ptrs[kLambExpAvgSq][t], at, len, v);
    for (int64_t i = 0; i < len; ++i) u[i] = lamb_moments(c, grad[i], w[i], m[i], v[i]);
    if (stores_unscaled_grads(p.scalars)) cpu::store_tile(g.dtypes[kLambGrad], grad, g.ptrs[kLambGrad][t], at, len);
    cpu::store_tile(DType::kFloat32, m, g.ptrs[kLambExpAvg][t], at, len);
    cpu::store_tile(DType::kFloat32, v, g.ptrs[kLambExpAvgSq][t], at, len);
    if (apply) {
      for (int64_t i = 0; i < len; ++i) w[i] -= c.lr * u[i];
      cpu::store_weights(p.weights, p.scalars, g, t, at, len, w);
      continue;
    }
    // Pad the tile to whole lanes with zeros (w = 0 and u = 0 add nothing), then sum by lanes.
    const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
    for (int64_t i = len; i < padded; ++i) w[i] = u[i] = 0.f;
    for (int64_t i = 0; i < padded; i += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        w_acc[l] += w[i + l] * w[i + l];
        u_acc[l] += u[i + l] * u[i + l];
      }
  }
  w_sq = u_sq = 0.f;
  for (int l = 0; l < kLanes; ++l) {
    w_sq += w_acc[l];
    u_sq += u_acc[l];
  }
}

MIXPREC_CPU_CLONES void lamb_apply_chunk(const LambParams& p, const LambCoefficients& coefficients, float step_size,
                                         int64_t t, int64_t begin, int64_t n) {
  const LambCoefficients c = coefficients;  // a local copy: see cpu::stream_tiles
  // Moments read, never written; no gradient.
  const cpu::TileState moments[] = {{kLambExpAvg, true, false}, {kLambExpAvgSq, true, false}};
  cpu::stream_tiles</*kReadGrad=*/false>(
      p.weights, p.scalars, *p.group, kLambGrad, moments, t, begin, n,
      [&](float&, float& w, float& m, float& v) { w -= step_size * lamb_direction(c, m, v, w); });
}

}  // namespace

void lamb_moments_cpu(const LambParams& p, int64_t chunk_begin, int64_t chunk_end) {
  if (step_skipped(p.scalars)) return;
  const LambCoefficients c = lamb_coefficients(p);
  const TensorGroup& g = *p.group;
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const ChunkRef r = resolve_chunk(g, chunk);
    float w_sq = 0.f, u_sq = 0.f;
    lamb_moments_chunk(p, c, r.tensor, r.begin, r.size, w_sq, u_sq);
    if (p.trust_ratio) {
      const int64_t global = g.first_chunk[r.tensor] + (chunk - g.chunk_prefix[r.tensor]);
      p.param_partials[global] = w_sq;
      p.update_partials[global] = u_sq;
    }
  }
}

void lamb_apply_cpu(const LambParams& p, int64_t chunk_begin, int64_t chunk_end) {
  if (step_skipped(p.scalars)) return;
  const LambCoefficients c = lamb_coefficients(p);
  const TensorGroup& g = *p.group;
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const ChunkRef r = resolve_chunk(g, chunk);
    const int32_t arg = g.index[r.tensor];
    lamb_apply_chunk(p, c, lamb_step_size(c.lr, p.param_norms[arg], p.update_norms[arg]), r.tensor, r.begin, r.size);
  }
}

}  // namespace mixprec::kernels
