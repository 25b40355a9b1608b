// Torch-free entry points of the fused NovoGrad step for CPU and CUDA: the per-tensor second
// moment (from the gradient norms of kernels/norm.h) and the element-wise update, one definition
// of the numerics for both backends.
//
// The update rule (Ginsburg et al. 2019, "Stochastic Gradient Methods with Layer-wise Adaptive
// Moments", with Apex's FusedNovoGrad options and numerics). For step t >= 1 (counting this one)
// and each tensor l, with g its gradient divided by grad_scale, w its weight (the fp32 master
// when master weights are kept, else the param in fp32), m = exp_avgs[l] and
// v = exp_avg_sq_norms[l]:
//
//   n  = ||g||_2 (norm_type 2)  or  max_i |g_i| (norm_type inf)
//   v  = n                                    if t == 1 and !init_zero (Apex seeds v with the
//                                             first gradient's norm, so its first blend is a no-op)
//      = sqrt(beta2 * v^2 + (1 - beta2) * n^2)   norm_type 2  (v is kept as a norm, not squared:
//      = beta2 * v + (1 - beta2) * n             norm_type inf  Apex's layout for both types)
//   c1 = 1 - beta1^t,  c2 = sqrt(1 - beta2^t)    (both 1 without bias_correction; c2 takes the
//                                                 square root for either norm type, as Apex)
//   b3 = 1 - beta1 if grad_averaging else 1
//   d  = v / c2 + eps
//   reg_inside_moment (the paper's form; Apex moment_mode 0): the normalized gradient and the
//   weight decay go into the moment
//        m = beta1 * m + b3 * (g / d + weight_decay * w)
//        w = w - lr * m / c1
//   otherwise (Apex's default, moment_mode 1): the moment averages raw gradients, and the
//   normalization and decay apply to the update only
//        m = beta1 * m + b3 * g
//        w = w - lr * (m / c1 / d + weight_decay * w)
//
// With init_zero the caller starts v at 0 (the first blend then gives sqrt(1 - beta2) * n, which
// c2 undoes). The step runs as: norm partials of the grads and their per-tensor finalize
// (kernels/norm.h), then the moment update (novograd_moment_*, one thread per tensor), then the
// element-wise pass (novograd_*), which reads the updated v of its tensor. A set found_inf makes
// the moment update and the element-wise pass do nothing, so v, m, weights and step stay as
// they were; only scratch norms are computed.
#pragma once

#include <math.h>

#include "include/mixprec/optim_args.h"  // NovoGradArgs, torch-free
#include "kernels/norm.h"
#include "kernels/optim_common.h"

namespace mixprec::kernels {

// Lists of the group, always four (without master weights the master list repeats params and is
// never touched).
enum NovoGradList : int { kNovoGradParam = 0, kNovoGradGrad, kNovoGradExpAvg, kNovoGradMaster, kNovoGradLists };

// The per-tensor moment update, after the gradient norms are known.
struct NovoGradMomentParams {
  const float* grad_norms = nullptr;  // [num_tensors] norms of the grads as stored (still scaled)
  float* exp_avg_sq_norms = nullptr;  // [num_tensors] v, updated in place
  int64_t num_tensors = 0;
  NormType type = NormType::kL2;  // from args.norm_type, checked by the ops tier
  NovoGradArgs args;              // beta2, init_zero
  StepScalars scalars;            // step (already incremented), grad_scale, found_inf
};

void novograd_moment_cpu(const NovoGradMomentParams& p);
void novograd_moment_cuda(const NovoGradMomentParams& p, Stream stream);

// The element-wise pass over one dtype group.
struct NovoGradParams {
  const TensorGroup* group = nullptr;
  StepScalars scalars;
  const float* exp_avg_sq_norms = nullptr;              // [num args] v, already updated for this step
  NovoGradArgs args;                                    // the hyper-parameters as declared (double)
  WeightMode weights{kNovoGradParam, kNovoGradMaster};  // where the weight lives (kernels/optim_common.h)
};

void novograd_cpu(const NovoGradParams& p, int64_t chunk_begin, int64_t chunk_end);
void novograd_cuda(const NovoGradParams& p, Stream stream);

// 1 - beta^step without the cancellation of 1 - powf(beta, step): for beta near 1 and small steps
// powf's last-bit rounding would cost ~1e-5 relative (beta2 = 0.999, step 2); through log1p and
// expm1 the result is good to a few ulps. beta - 1 is exact for beta in [0.5, 1] (Sterbenz).
MIXPREC_HOST_DEVICE inline float one_minus_pow(float beta, float step) { return -expm1f(step * log1pf(beta - 1.f)); }

// v for this step from the previous v and this step's unscaled gradient norm n.
MIXPREC_HOST_DEVICE inline float novograd_moment(NormType type, float v, float n, float beta2, bool seed) {
  if (seed) return n;
  return type == NormType::kL2 ? sqrtf(beta2 * v * v + (1.f - beta2) * n * n) : beta2 * v + (1.f - beta2) * n;
}

// Whether this step seeds v with the gradient norm (Apex's initialization without init_zero).
MIXPREC_HOST_DEVICE inline bool novograd_seeds(const StepScalars& s, bool init_zero) {
  return !init_zero && step_count(s) == 1.f;
}

struct NovoGradCoefficients {
  float lr, beta1, beta3, bias_correction1, bias_correction2, eps, weight_decay, inv_scale;
  bool reg_inside_moment;
};

MIXPREC_HOST_DEVICE inline NovoGradCoefficients novograd_coefficients(const NovoGradParams& p) {
  NovoGradCoefficients c;
  c.lr = step_lr(p.scalars);
  const NovoGradArgs& a = p.args;
  c.beta1 = static_cast<float>(a.beta1);
  const float beta2 = static_cast<float>(a.beta2);
  c.beta3 = a.grad_averaging ? 1.f - c.beta1 : 1.f;
  const float step = step_count(p.scalars);
  c.bias_correction1 = a.bias_correction ? one_minus_pow(c.beta1, step) : 1.f;
  c.bias_correction2 = a.bias_correction ? sqrtf(one_minus_pow(beta2, step)) : 1.f;
  c.eps = static_cast<float>(a.eps);
  c.weight_decay = static_cast<float>(a.weight_decay);
  c.inv_scale = grad_inv_scale(p.scalars);
  c.reg_inside_moment = a.reg_inside_moment;
  return c;
}

// The denominator d of a tensor whose (updated) second moment is v.
MIXPREC_HOST_DEVICE inline float novograd_denom(const NovoGradCoefficients& c, float v) {
  return v / c.bias_correction2 + c.eps;
}

// The per-element update, in Apex's order of operations. `w` is the fp32 weight; `grad` comes in
// as stored and leaves unscaled (what stores_unscaled_grads writes back).
template <bool RegInsideMoment>
MIXPREC_HOST_DEVICE inline void novograd_update(const NovoGradCoefficients& c, float denom, float& grad, float& w,
                                                float& m) {
  grad *= c.inv_scale;
  float g = grad;
  if (RegInsideMoment) {
    g = g / denom + c.weight_decay * w;
    m = c.beta1 * m + c.beta3 * g;
    w -= c.lr * (m / c.bias_correction1);
  } else {
    m = c.beta1 * m + c.beta3 * g;
    w -= c.lr * ((m / c.bias_correction1) / denom + c.weight_decay * w);
  }
}

}  // namespace mixprec::kernels
