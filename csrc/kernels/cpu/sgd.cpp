// CPU kernel of the fused SGD step: each chunk streams through L1-sized fp32 tiles, and the update
// loop over a tile is plain arithmetic the compiler vectorizes (AVX2 clone on x86-64).
#include "kernels/sgd.h"

#include "kernels/cpu/convert.h"
#include "kernels/cpu/optim_weights.h"

namespace mixprec::kernels {
namespace {

// An fp32 value as a momentum buffer of dtype D holds it (kernels/sgd.h: the step uses that value).
template <DType D> struct RoundTo {
  MIXPREC_INLINE float operator()(float x) const {
    if constexpr (D == DType::kFloat16) return cpu::half_to_float(cpu::float_to_half(x));
    else if constexpr (D == DType::kBFloat16) return cpu::bf16_to_float(cpu::float_to_bf16(x));
    else return x;
  }
};

template <DType DM>
MIXPREC_CPU_CLONES void sgd_chunk(const SgdParams& p, const SgdCoefficients& c, int64_t t, int64_t begin, int64_t n) {
  const TensorGroup& g = *p.group;
  alignas(64) float grad[cpu::kTile], w[cpu::kTile], m[cpu::kTile];
  for (int64_t at = begin; at < begin + n; at += cpu::kTile) {
    const int64_t len = std::min(cpu::kTile, begin + n - at);
    cpu::load_tile(g.dtypes[kSgdGrad], g.ptrs[kSgdGrad][t], at, len, grad);
    cpu::load_weights(p.weights, g, t, at, len, w);
    if (c.use_momentum) {
      // The first step sets the buffer without reading it (torch.optim.SGD's semantics).
      if (!c.first_step) cpu::load_tile(DM, g.ptrs[kSgdMomentum][t], at, len, m);
      for (int64_t i = 0; i < len; ++i) sgd_update(c, grad[i], w[i], m[i], RoundTo<DM>{});
      cpu::store_tile(DM, m, g.ptrs[kSgdMomentum][t], at, len);
    } else {
      for (int64_t i = 0; i < len; ++i) {
        float unused = 0.f;  // a local, so the loop carries no store the vectorizer must keep
        sgd_update(c, grad[i], w[i], unused);
      }
    }
    if (stores_unscaled_grads(p.scalars)) cpu::store_tile(g.dtypes[kSgdGrad], grad, g.ptrs[kSgdGrad][t], at, len);
    cpu::store_weights(p.weights, p.scalars, g, t, at, len, w);
  }
}

}  // namespace

void sgd_cpu(const SgdParams& p, int64_t chunk_begin, int64_t chunk_end) {
  if (step_skipped(p.scalars)) return;
  const SgdCoefficients c = sgd_coefficients(p);
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const ChunkRef r = resolve_chunk(*p.group, chunk);
    // Momentum storage as a template argument: its rounding sits in the vectorized update loop.
    cpu::with_dtype(p.group->dtypes[kSgdMomentum],
                    [&](auto tag) { sgd_chunk<decltype(tag)::value>(p, c, r.tensor, r.begin, r.size); });
  }
}

}  // namespace mixprec::kernels
