// CUDA device code of the fused SGD step: one streaming pass that reads grad, weight and momentum
// once and writes weight (and model copy) and momentum once (see kernels/sgd.h).
#pragma once

#include "kernels/optim_stream.cuh"
#include "kernels/sgd.h"

namespace mixprec::kernels {

// TP: model param storage, TG: grad storage, TS: momentum storage (float, or TP as Apex's and
// torch's fp16/bf16 SGD keep it); the master float32 or a remainder (WeightMode). kStoreGrad: as AdamOp.
template <typename TP, typename TG, typename TS, bool kStoreGrad, int kPath> struct SgdOp {  // kPath: as AdamOp
  SgdParams p;

  __device__ void operator()(const TensorTable<kSgdLists>& table, const ChunkCtx& ctx) const {
    // A skipped step touches nothing: params, master, momentum and the step count stay as they were.
    if (step_skipped(p.scalars)) return;
    const SgdCoefficients c = sgd_coefficients(p);
    // 16 bytes of the narrowest operand per vector. SGD streams at most three inputs, so each
    // thread keeps more vectors in flight than Adam does; 4 fp32 vectors would spill at the
    // 64-register cap of two blocks per SM, 3 do not.
    constexpr int N = vec_elems<TP, TG, TS>();
    constexpr int Ilp = N >= 8 ? 2 : 3;
    // The first step overwrites the buffer without reading it (torch.optim.SGD's semantics), so it
    // saves that read and never sees what the buffer held.
    const StateRole momentum[] = {{kSgdMomentum, c.use_momentum && !c.first_step, c.use_momentum}};
    OptimStream<TP, TG, TS, N, Ilp, kPath, kStoreGrad>::run(
        table, ctx, p.weights, p.scalars, kSgdParam, kSgdGrad, c.inv_scale, momentum,
        [&](int64_t, float& g, float& w, float& m) { sgd_update(c, g, w, m, RoundTo<TS>{}); });
  }
};

}  // namespace mixprec::kernels
