// Torch-free entry points of the fused SGD step for CPU and CUDA: unscale, skip, weight decay,
// momentum with dampening and Nesterov (torch.optim.SGD's and Apex's variants) in one pass,
// writing the fp32 master and the rounded model copy together when master weights are kept.
#pragma once

#include "include/mixprec/optim_args.h"  // SgdArgs, torch-free
#include "kernels/optim_common.h"

namespace mixprec::kernels {

// Lists of the group, always four (absent ones repeat the params list and are never touched).
// Momentum buffers are float32 or the param's dtype (ops/sgd.cpp).
enum SgdList : int { kSgdParam = 0, kSgdGrad, kSgdMomentum, kSgdMaster, kSgdLists };

struct SgdParams {
  const TensorGroup* group = nullptr;
  StepScalars scalars;
  // The hyper-parameters as declared (double). momentum 0: plain SGD, list kSgdMomentum is
  // absent; wd_after_momentum (Apex): decay added to the momentum-filtered direction.
  SgdArgs args;
  WeightMode weights{kSgdParam, kSgdMaster};  // where the weight lives (kernels/optim_common.h)
};

void sgd_cpu(const SgdParams& p, int64_t chunk_begin, int64_t chunk_end);
void sgd_cuda(const SgdParams& p, Stream stream);

struct SgdCoefficients {
  float lr, momentum, one_minus_dampening, weight_decay, inv_scale;
  bool use_momentum;
  bool first_step;  // torch.optim.SGD: the buffer is set to the gradient, not blended into
  bool nesterov, wd_after_momentum, maximize;
};

MIXPREC_HOST_DEVICE inline SgdCoefficients sgd_coefficients(const SgdParams& p) {
  SgdCoefficients c;
  c.lr = step_lr(p.scalars);
  const SgdArgs& a = p.args;
  c.momentum = static_cast<float>(a.momentum);
  c.one_minus_dampening = 1.f - static_cast<float>(a.dampening);
  c.weight_decay = static_cast<float>(a.weight_decay);
  c.inv_scale = grad_inv_scale(p.scalars);
  c.use_momentum = c.momentum != 0.f;
  // The step count only matters with momentum (the ops tier demands one then); a skipped step
  // does not advance it, so the step after a skipped first step is still the first.
  c.first_step = c.use_momentum && step_count(p.scalars) == 1.f;
  c.nesterov = a.nesterov;
  c.wd_after_momentum = a.wd_after_momentum;
  c.maximize = a.maximize;
  return c;
}

// The momentum path in float32: nothing rounded until the stores.
struct KeepFloat {
  MIXPREC_HOST_DEVICE float operator()(float x) const { return x; }
};

// Same order of operations as torch.optim.SGD (and Apex's kernel for wd_after_momentum), so fp32
// trajectories agree to rounding. `w` is the fp32 weight (master or param); `buf` is neither
// read on the first step nor touched without momentum. `grad` comes in as stored and leaves
// unscaled (what stores_unscaled_grads writes back).
// `to_storage` rounds to the momentum buffer's dtype (KeepFloat for float32 buffers). A buffer in
// the param's fp16/bf16 dtype follows torch.optim.SGD's arithmetic on such params, where every
// intermediate of the direction is a tensor of that dtype: the decayed gradient, momentum * buf,
// the new buffer and Nesterov's sum are each rounded, and the step goes on with the rounded value
// (so it uses the buffer's stored value). Bit for bit torch's foreach and single-tensor SGD up to
// its contraction of a + alpha * b into one rounding (or not); Apex's kernel rounds only the stored
// buffer and steps with the unrounded one, which after 7 of Apex's own test steps is 3 fp16 ulps
// from torch's trajectory, over that test's bound.
template <typename ToStorage = KeepFloat>
MIXPREC_HOST_DEVICE inline void sgd_update(const SgdCoefficients& c, float& grad, float& w, float& buf,
                                           ToStorage to_storage = {}) {
  grad *= c.inv_scale;
  // As torch's GradScaler.unscale_ leaves a gradient of the buffer's dtype (exact without a scale).
  float g = to_storage(c.maximize ? -grad : grad);
  if (c.weight_decay != 0.f && !c.wd_after_momentum) g = to_storage(g + c.weight_decay * w);
  if (c.use_momentum) {
    buf = c.first_step ? g : to_storage(to_storage(c.momentum * buf) + c.one_minus_dampening * g);
    g = c.nesterov ? to_storage(g + c.momentum * buf) : buf;
  }
  if (c.weight_decay != 0.f && c.wd_after_momentum) g = to_storage(g + c.weight_decay * w);
  w -= c.lr * g;
}

}  // namespace mixprec::kernels
