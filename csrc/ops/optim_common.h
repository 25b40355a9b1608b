// Ops-tier pieces every fused optimizer op shares: validation of the per-step scalars (lr, step,
// grad_scale, found_inf), of hyper-parameters and of optimizer-state lists.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include <mixprec/ops.h>  // StepArgs

#include "kernels/optim_common.h"
#include "ops/tensor_lists.h"

namespace mixprec::detail {

// Checks and converts the step scalars of optimizer op `op` running on `device`. Nothing runs yet:
// the step tensor is incremented by the backend (kernels::increment_step_*) right before the update.
kernels::StepScalars step_scalars(const char* op, const at::Device& device, const StepArgs& step, bool needs_step);

// Mutable pointer of the step tensor (null when absent), for the increment.
inline float* step_tensor_ptr(const std::optional<at::Tensor>& step_tensor) {
  return step_tensor ? step_tensor->data_ptr<float>() : nullptr;
}

// Raises ValueError "mixprec::op: name must be in [lo, hi), got v" (hi_open) or [lo, hi].
void check_range(const char* op, const char* name, double v, double lo, double hi, bool hi_open = false);

// Every tensor of `list` is float32, or (allow_bf16) bfloat16 like its counterpart in `like`.
void check_state_dtypes(const char* op, const NamedList& list, bool allow_bf16, const NamedList* like = nullptr);

// The grads list: read, never written (the overlap check lets grads share memory among themselves).
inline NamedList grad_list(at::TensorList grads) { return {"grads", grads, /*written=*/false}; }

// The weights of one call as the kernels take them (kernels::WeightMode): master_params entries
// are fp32 masters or int16 remainders (the low halves of bf16 params' fp32 masters), the latter
// viewed as bfloat16 so that they pack like any 16-bit list (the kernels move their bits as they
// are); which an entry is follows from its dtype, so one call may mix both (a checkpoint's fp32
// master beside remainders). Refuses a remainder without a bf16 param, other master dtypes, and
// stochastic_rounding with masters or fp16 params. `mode` comes with the family's list indices.
struct WeightLists {
  std::vector<at::Tensor> masters;
  kernels::WeightMode mode;
  // master_params for pack_lists, or `params` standing in for the absent list.
  NamedList master_list(const NamedList& params) const {
    return masters.empty() ? params : NamedList{"master_params", masters, true, /*may_be_params=*/true};
  }
};
WeightLists weight_lists(const char* op, at::TensorList params, at::TensorList master_params, bool stochastic_rounding,
                         int64_t seed, kernels::WeightMode mode);

// A list is "absent" when empty; else it must match `ref` in length (checked later by pack_lists).
inline bool present(at::TensorList l) { return !l.empty(); }

}  // namespace mixprec::detail
