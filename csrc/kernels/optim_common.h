// Torch-free pieces every fused optimizer shares: the per-step device scalars (lr, step count,
// loss scale, found_inf), read the same way on CPU and CUDA, and the step-count increment.
#pragma once

#include "kernels/multi_tensor.h"

namespace mixprec::kernels {

// Scalars of one optimizer step. Each comes from the host or from a one-element float32 tensor
// on the op's device; the tensor wins when given, so a step can be captured in a CUDA graph.
struct StepScalars {
  float lr = 0.f;
  const float* lr_tensor = nullptr;
  float step = 0.f;                    // this step's count (>= 1) when step_tensor is null
  const float* step_tensor = nullptr;  // already incremented for this step (see increment_step_*)
  const float* grad_scale = nullptr;   // grads are divided by it (loss scale), null: unscaled
  const float* found_inf = nullptr;    // non-zero: the whole step does nothing
};

MIXPREC_HOST_DEVICE inline bool step_skipped(const StepScalars& s) {
  return s.found_inf != nullptr && *s.found_inf != 0.f;
}
MIXPREC_HOST_DEVICE inline float step_lr(const StepScalars& s) { return s.lr_tensor != nullptr ? *s.lr_tensor : s.lr; }
MIXPREC_HOST_DEVICE inline float step_count(const StepScalars& s) {
  return s.step_tensor != nullptr ? *s.step_tensor : s.step;
}
MIXPREC_HOST_DEVICE inline float grad_inv_scale(const StepScalars& s) {
  return s.grad_scale != nullptr ? 1.f / *s.grad_scale : 1.f;
}

// torch's fused-optimizer contract (aten::_fused_adam_ on CPU and CUDA, Apex's FusedAdam): a step
// given a grad_scale leaves every gradient unscaled, g * (1/scale) as the update used it, rounded
// to the grad's dtype, so code that clips or logs grads after scaler.step sees true values. The
// pass that reads g stores it back (2-4 more bytes per param); a skipped step (found_inf) returns
// before any store, so grads keep their scaled values, as torch's do. Without a grad_scale the
// gradient is not written at all.
MIXPREC_HOST_DEVICE inline bool stores_unscaled_grads(const StepScalars& s) { return s.grad_scale != nullptr; }

// step_tensor += 1 unless found_inf is set. Runs before the update kernel, so every block of
// that kernel reads the same, already incremented, count.
void increment_step_cpu(float* step_tensor, const float* found_inf);
void increment_step_cuda(float* step_tensor, const float* found_inf, Stream stream);

}  // namespace mixprec::kernels
