// Torch-free entry points of the fused Adagrad step for CPU and CUDA: unscale, skip, weight decay
// (L2 as torch.optim.Adagrad, or decoupled as Apex's adagrad_w_mode), lr_decay and the squared-
// gradient sum in one pass, writing the fp32 master and the rounded model copy together.
#pragma once

#include <math.h>

#include "include/mixprec/optim_args.h"  // AdagradArgs, torch-free
#include "kernels/optim_common.h"

namespace mixprec::kernels {

// Lists of the group, always four (an absent master list repeats params and is never touched).
enum AdagradList : int { kAdagradParam = 0, kAdagradGrad, kAdagradStateSum, kAdagradMaster, kAdagradLists };

struct AdagradParams {
  const TensorGroup* group = nullptr;
  StepScalars scalars;
  // The hyper-parameters as declared (double); adagrad_w_mode: decoupled weight decay, else L2
  // added to the gradient.
  AdagradArgs args;
  WeightMode weights{kAdagradParam, kAdagradMaster};  // where the weight lives (kernels/optim_common.h)
};

void adagrad_cpu(const AdagradParams& p, int64_t chunk_begin, int64_t chunk_end);
void adagrad_cuda(const AdagradParams& p, Stream stream);

struct AdagradCoefficients {
  float clr, eps, weight_decay, inv_scale;
  bool adagrad_w_mode, maximize;
};

MIXPREC_HOST_DEVICE inline AdagradCoefficients adagrad_coefficients(const AdagradParams& p) {
  AdagradCoefficients c;
  const AdagradArgs& a = p.args;
  const float lr = step_lr(p.scalars);
  const float lr_decay = static_cast<float>(a.lr_decay);
  // torch.optim.Adagrad: lr / (1 + (step - 1) * lr_decay); the step only matters with a decay
  // (the ops tier demands one then).
  c.clr = lr_decay != 0.f ? lr / (1.f + (step_count(p.scalars) - 1.f) * lr_decay) : lr;
  c.eps = static_cast<float>(a.eps);
  c.weight_decay = static_cast<float>(a.weight_decay);
  c.inv_scale = grad_inv_scale(p.scalars);
  c.adagrad_w_mode = a.adagrad_w_mode;
  c.maximize = a.maximize;
  return c;
}

// torch.optim.Adagrad's order of operations (sum += g*g; w -= clr * g / (sqrt(sum) + eps)), and
// Apex's decoupled form w -= clr * (g / (sqrt(sum) + eps) + wd * w). `w` is the fp32 weight;
// `grad` comes in as stored and leaves unscaled (what stores_unscaled_grads writes back).
MIXPREC_HOST_DEVICE inline void adagrad_update(const AdagradCoefficients& c, float& grad, float& w, float& sum) {
  grad *= c.inv_scale;
  float g = c.maximize ? -grad : grad;
  const bool decay = c.weight_decay != 0.f;
  if (decay && !c.adagrad_w_mode) g += c.weight_decay * w;
  sum += g * g;
  float update = g / (sqrtf(sum) + c.eps);
  if (decay && c.adagrad_w_mode) update += c.weight_decay * w;
  w -= c.clr * update;
}

}  // namespace mixprec::kernels
