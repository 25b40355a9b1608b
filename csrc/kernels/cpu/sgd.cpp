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
MIXPREC_CPU_CLONES void sgd_chunk(const SgdParams& p, const SgdCoefficients& coefficients, int64_t t, int64_t begin,
                                  int64_t n) {
  const SgdCoefficients c = coefficients;  // a local copy: see cpu::stream_tiles
  // The first step sets the buffer without reading it (torch.optim.SGD's semantics).
  const cpu::TileState momentum[] = {{kSgdMomentum, c.use_momentum && !c.first_step, c.use_momentum}};
  cpu::stream_tiles(p.weights, p.scalars, *p.group, kSgdGrad, momentum, t, begin, n,
                    [&](float& g, float& w, float& m) { sgd_update(c, g, w, m, RoundTo<DM>{}); });
}

}  // namespace

void sgd_cpu(const SgdParams& p, int64_t chunk_begin, int64_t chunk_end) {
  if (step_skipped(p.scalars)) return;
  const SgdCoefficients c = sgd_coefficients(p);
  // Momentum storage as a template argument: its rounding sits in the vectorized update loop.
  // Without momentum the list stands in with the params and nothing is rounded (float32), as on CUDA.
  const DType momentum_dtype = c.use_momentum ? p.group->dtypes[kSgdMomentum] : DType::kFloat32;
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const ChunkRef r = resolve_chunk(*p.group, chunk);
    cpu::with_dtype(momentum_dtype,
                    [&](auto tag) { sgd_chunk<decltype(tag)::value>(p, c, r.tensor, r.begin, r.size); });
  }
}

}  // namespace mixprec::kernels
