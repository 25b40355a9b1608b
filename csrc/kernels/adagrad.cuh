// CUDA device code of the fused Adagrad step: one streaming pass that reads grad, weight and the
// squared-gradient sum once and writes weight (and model copy) and sum once (see kernels/adagrad.h).
#pragma once

#include "kernels/adagrad.h"
#include "kernels/optim_stream.cuh"

namespace mixprec::kernels {

// TP: model param storage, TG: grad storage; the sum is float32, the master float32 or a remainder.
template <typename TP, typename TG, bool kStoreGrad, int kPath>  // kStoreGrad, kPath: as AdamOp
struct AdagradOp {
  AdagradParams p;

  __device__ void operator()(const TensorTable<kAdagradLists>& table, const ChunkCtx& ctx) const {
    // A skipped step touches nothing: params, master, sums and the step count stay as they were.
    if (step_skipped(p.scalars)) return;
    const AdagradCoefficients c = adagrad_coefficients(p);
    // Fewer vectors in flight than SGD: IEEE division and square root take registers of their
    // own, and more than 8 elements a thread spill at the 64-register cap of two blocks per SM.
    constexpr int N = vec_elems<TP, TG, float>();
    constexpr int Ilp = N >= 8 ? 1 : 2;
    const StateRole sum[] = {{kAdagradStateSum}};
    OptimStream<TP, TG, float, N, Ilp, kPath, kStoreGrad>::run(
        table, ctx, p.weights, p.scalars, kAdagradParam, kAdagradGrad, c.inv_scale, sum,
        [&](int64_t, float& g, float& w, float& h) { adagrad_update(c, g, w, h); });
  }
};

}  // namespace mixprec::kernels
