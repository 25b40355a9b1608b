// Torch-free entry points of the fused Adam/AdamW step for CPU and CUDA: unscale, skip, moment
// update, bias correction, weight decay (L2 or decoupled) and amsgrad in one pass, writing the fp32
// master and the rounded model copy together when master weights are kept. Moments are float32,
// bfloat16, or 8-bit block-quantized codes (kernels/quant8.h) dequantized and requantized in the pass.
#pragma once

#include <math.h>

#include "include/mixprec/optim_args.h"  // AdamArgs, torch-free
#include "kernels/optim_common.h"

namespace mixprec::kernels {

// Lists of the group, six (unused ones repeat the params list and are never touched); with 8-bit
// moments eight: kAdamExpAvg/kAdamExpAvgSq then hold the int8/uint8 codes and the two scale lists
// (float32, one per kQuantBlock elements: a chunk's scales start at begin / kQuantBlock) follow.
enum AdamList : int {
  kAdamParam = 0,
  kAdamGrad,
  kAdamExpAvg,
  kAdamExpAvgSq,
  kAdamMaxExpAvgSq,
  kAdamMaster,
  kAdamLists,
  kAdamExpAvgScale = kAdamLists,
  kAdamExpAvgSqScale,
  kAdamQ8Lists
};

struct AdamParams {
  const TensorGroup* group = nullptr;
  StepScalars scalars;
  AdamArgs args;  // the hyper-parameters as declared (double); read once per chunk
  // Derived on the host in double: 1 - beta2 in float loses 1.3e-5 (relative) for beta2 = 0.999,
  // and 1 - powf(beta2, step) as much again.
  float one_minus_beta1 = 0.1f;
  float one_minus_beta2 = 0.001f;
  float log_beta1 = -0.105360516f;  // log(beta1): bias correction 1 - beta^t = -expm1(t * log(beta))
  float log_beta2 = -0.0010005003f;
  bool amsgrad = false;                         // list kAdamMaxExpAvgSq is live
  bool quant8 = false;                          // 8-bit moments: kAdamQ8Lists lists (never with amsgrad)
  WeightMode weights{kAdamParam, kAdamMaster};  // where the weight lives (kernels/optim_common.h)
};

void adam_cpu(const AdamParams& p, int64_t chunk_begin, int64_t chunk_end);
void adam_cuda(const AdamParams& p, Stream stream);

// The per-element update, shared by both backends. `w` is the fp32 weight (master or param).
struct AdamCoefficients {
  float lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, step_size, inv_bias_correction2_sqrt,
      inv_scale;
  bool adam_w_mode, amsgrad, maximize;
};

MIXPREC_HOST_DEVICE inline AdamCoefficients adam_coefficients(const AdamParams& p) {
  AdamCoefficients c;
  c.lr = step_lr(p.scalars);
  const AdamArgs& a = p.args;
  c.beta1 = static_cast<float>(a.beta1);
  c.beta2 = static_cast<float>(a.beta2);
  c.one_minus_beta1 = p.one_minus_beta1;
  c.one_minus_beta2 = p.one_minus_beta2;
  c.eps = static_cast<float>(a.eps);
  c.weight_decay = static_cast<float>(a.weight_decay);
  const float step = step_count(p.scalars);
  const float bc1 = a.bias_correction ? -expm1f(step * p.log_beta1) : 1.f;
  const float bc2 = a.bias_correction ? -expm1f(step * p.log_beta2) : 1.f;
  c.step_size = c.lr / bc1;
  c.inv_bias_correction2_sqrt = 1.f / sqrtf(bc2);
  c.inv_scale = grad_inv_scale(p.scalars);
  c.adam_w_mode = a.adam_w_mode;
  c.amsgrad = p.amsgrad;
  c.maximize = a.maximize;
  return c;
}

// The flags an update loop may take as known. With every run-time flag live, nvcc 13 keeps
// them and their branches in registers across the eight elements of a vector and spills inside
// the fp16 O2 loop (8 local loads and stores a vector: 89% of copy bandwidth on the H200, 94%
// before); AdamOp compiles one loop per case below, the cases users run (Adam without decay,
// AdamW) with their branches folded. kAdamAnyFlags reads every flag.
enum AdamFlagCase : int { kAdamAnyFlags = 0, kAdamDecoupledDecay = 1, kAdamNoDecay = 2 };

MIXPREC_HOST_DEVICE inline int adam_flag_case(const AdamCoefficients& c) {
  if (c.amsgrad || c.maximize) return kAdamAnyFlags;
  if (c.weight_decay == 0.f) return kAdamNoDecay;
  return c.adam_w_mode ? kAdamDecoupledDecay : kAdamAnyFlags;
}

// Same order of operations as torch's fused Adam, so fp32 trajectories agree to rounding. `grad`
// comes in as stored and leaves unscaled (what stores_unscaled_grads writes back). Every case
// evaluates the same expressions as kAdamAnyFlags with the flags adam_flag_case found, so a
// case's loop and the general one give the same bits (and the CPU, which uses the general one).
template <int kCase = kAdamAnyFlags>
MIXPREC_HOST_DEVICE inline void adam_update(const AdamCoefficients& c, float& grad, float& w, float& m, float& v,
                                            float& v_max) {
  constexpr bool kAny = kCase == kAdamAnyFlags;
  const bool maximize = kAny && c.maximize, amsgrad = kAny && c.amsgrad;
  const bool decay = kCase == kAdamDecoupledDecay || (kAny && c.weight_decay != 0.f);
  const bool decoupled = kCase == kAdamDecoupledDecay || (kAny && c.adam_w_mode);
  grad *= c.inv_scale;
  float g = maximize ? -grad : grad;
  if (decay) {
    if (decoupled) w -= c.lr * c.weight_decay * w;
    else g += c.weight_decay * w;
  }
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
  float second = v;
  if (amsgrad) {
    v_max = fmaxf(v_max, v);
    second = v_max;
  }
  const float denom = sqrtf(second) * c.inv_bias_correction2_sqrt + c.eps;
  w -= c.step_size * m / denom;
}

}  // namespace mixprec::kernels
