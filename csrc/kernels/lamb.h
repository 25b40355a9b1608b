// Torch-free entry points of the fused LAMB step for CPU and CUDA (You et al. 2019, with Apex's
// options): global-norm clipping, Adam moments, per-tensor trust ratio ||w|| / ||update||.
//
// Why two passes, and which two. The trust ratio of tensor t needs ||w_t|| and ||u_t|| (u: the
// update direction) before any element of w_t may change, and u depends on the new moments, so
// no single pass can do it. Bytes per parameter, fp32 everything, no masters (W = weight, G =
// grad, P = model param written when masters are kept; fp16 grads/params halve their terms):
//   1. moments pass: read g, w, m, v; write m, v; per-chunk partials of ||w||^2, ||u||^2    24 B
//   2. apply pass:   read m, v, w; recompute u from them (same inline math, bit-identical);
//                    write w (and the model copy P)                                        16 B
// = 40 B (+4 B read of g by the global gradient norm, when clipping; fp16 params + grads with
// fp32 masters: 2 + 22 + 18 = 42 B). The alternative, storing u in a scratch buffer in pass 1
// (Apex stores it over the gradient, which our schema keeps read-only), moves the same 40 B
// (+4 write in pass 1, -8 +4 read in pass 2) and costs 4 B/param of extra memory, so pass 2
// recomputes. Recomputing m, v in pass 2 from g instead of writing them in pass 1 would move
// 44 B. When no tensor takes a trust ratio (weight_decay == 0 and not use_nvlamb) the moments
// pass applies the update itself: one pass, 28 B, like Adam.
//
// Per-tensor norms reuse the norm machinery: pass 1 writes one partial per chunk (the layout of
// kernels/norm.h), and norm_finalize_* turns them into per-tensor norms between the passes.
// found_inf set: every pass returns at once, so weights, moments and masters stay bit-identical.
#pragma once

#include <math.h>

#include "include/mixprec/optim_args.h"  // LambArgs, torch-free
#include "kernels/optim_common.h"

namespace mixprec::kernels {

// Lists of the group, always five (without masters the master list repeats params, never touched).
enum LambList : int { kLambParam = 0, kLambGrad, kLambExpAvg, kLambExpAvgSq, kLambMaster, kLambLists };

struct LambParams {
  const TensorGroup* group = nullptr;
  StepScalars scalars;
  // The hyper-parameters as declared, in double, so that 1 - beta and the bias corrections are
  // exact enough: 1 - 0.999f is off by 1.3e-5 relative, which would bias exp_avg_sq (and
  // 1 - 0.999f^t the step) by as much. grad_averaging: beta1's (1 - beta1) factor on the gradient
  // (false: 1); adam_w_mode: decoupled decay (added to the update), else L2 added to the gradient.
  LambArgs args;
  WeightMode weights{kLambParam, kLambMaster};  // where the weight lives (kernels/optim_common.h)
  // Clipping: grads are divided by max(1, norm / max_grad_norm), norm = *global_grad_norm of the
  // unscaled grads (times 1/grad_scale first when global_grad_norm_scaled). Null: no clipping.
  // The limit is args.max_grad_norm.
  const float* global_grad_norm = nullptr;
  bool global_grad_norm_scaled = false;
  // Two passes with a trust ratio (weight_decay != 0 or use_nvlamb); otherwise the moments pass
  // applies lr * u directly.
  bool trust_ratio = true;
  float* param_partials = nullptr;      // [total chunks] sum of w^2 per chunk (pass 1 writes)
  float* update_partials = nullptr;     // [total chunks] sum of u^2 per chunk
  const float* param_norms = nullptr;   // [num args] ||w|| per tensor (pass 2 reads)
  const float* update_norms = nullptr;  // [num args] ||u|| per tensor
};

// Pass 1 (moments, partials; or the whole step when !trust_ratio) and pass 2 (apply).
void lamb_moments_cpu(const LambParams& p, int64_t chunk_begin, int64_t chunk_end);
void lamb_moments_cuda(const LambParams& p, Stream stream);
void lamb_apply_cpu(const LambParams& p, int64_t chunk_begin, int64_t chunk_end);
void lamb_apply_cuda(const LambParams& p, Stream stream);

// ---- the per-element math, shared by both backends and both passes ----------------------------

struct LambCoefficients {
  float lr, beta1, beta2, beta3, one_minus_beta2, eps, weight_decay, inv_bias_correction1, inv_bias_correction2,
      grad_factor, inv_scale;
  bool adam_w_mode;
};

MIXPREC_HOST_DEVICE inline LambCoefficients lamb_coefficients(const LambParams& p) {
  LambCoefficients c;
  c.lr = step_lr(p.scalars);
  // Scalars in double once per chunk (cheap), elements in float.
  const LambArgs& a = p.args;
  c.beta1 = static_cast<float>(a.beta1);
  c.beta2 = static_cast<float>(a.beta2);
  c.beta3 = a.grad_averaging ? static_cast<float>(1.0 - a.beta1) : 1.f;
  c.one_minus_beta2 = static_cast<float>(1.0 - a.beta2);
  c.eps = static_cast<float>(a.eps);
  c.weight_decay = static_cast<float>(a.weight_decay);
  const double step = step_count(p.scalars);
  c.inv_bias_correction1 = a.bias_correction ? static_cast<float>(1.0 / (1.0 - pow(a.beta1, step))) : 1.f;
  c.inv_bias_correction2 = a.bias_correction ? static_cast<float>(1.0 / (1.0 - pow(a.beta2, step))) : 1.f;
  // Unscale and clip with one multiply: g * (1/scale) / max(1, norm / max_grad_norm).
  const float inv_scale = grad_inv_scale(p.scalars);
  float clip = 1.f;
  if (p.global_grad_norm != nullptr) {
    const float norm = *p.global_grad_norm * (p.global_grad_norm_scaled ? inv_scale : 1.f);
    const float max_norm = static_cast<float>(a.max_grad_norm);
    if (norm > max_norm) clip = norm / max_norm;
  }
  c.grad_factor = inv_scale / clip;
  c.inv_scale = inv_scale;
  c.adam_w_mode = a.adam_w_mode;
  return c;
}

// The update direction from the new moments: the one definition both passes evaluate, so pass 2
// applies exactly the u whose norm pass 1 measured.
MIXPREC_HOST_DEVICE inline float lamb_direction(const LambCoefficients& c, float m, float v, float w) {
  const float u = (m * c.inv_bias_correction1) / (sqrtf(v * c.inv_bias_correction2) + c.eps);
  return c.adam_w_mode ? u + c.weight_decay * w : u;
}

// Pass 1 per element: moments updated in place; returns u. `grad` comes in as stored and leaves
// unscaled but not clipped (what stores_unscaled_grads writes back: the gradient a GradScaler's
// unscale_ would leave, whatever max_grad_norm does to the update).
MIXPREC_HOST_DEVICE inline float lamb_moments(const LambCoefficients& c, float& grad, float w, float& m, float& v) {
  float g = grad * c.grad_factor;
  grad *= c.inv_scale;
  if (!c.adam_w_mode) g += c.weight_decay * w;  // L2 on the clipped gradient, as Apex does
  m = c.beta1 * m + c.beta3 * g;
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
  return lamb_direction(c, m, v, w);
}

// lr times the trust ratio of a tensor: ||w|| / ||u|| when both are non-zero, else 1 (Apex's rule;
// a NaN norm makes the ratio NaN, so a non-finite step never passes silently).
MIXPREC_HOST_DEVICE inline float lamb_step_size(float lr, float param_norm, float update_norm) {
  return (param_norm != 0.f && update_norm != 0.f) ? lr * (param_norm / update_norm) : lr;
}

}  // namespace mixprec::kernels
