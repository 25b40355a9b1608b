// A fused optimizer step held below Python (issue 22): one param group's op call, its tensor lists
// and arguments kept in C++ between steps, replayed with the step scalars alone; and FusedLAMB's
// global gradient norm over the held params of every group (HeldNorm).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>

#include <optional>
#include <string>
#include <vector>

namespace mixprec::detail {

// Passing 6 lists of 292 tensors through the dispatcher from Python costs ~150 us of host time per
// step (each tensor converted to an IValue); a HeldStep keeps the call's boxed arguments and, on
// each step, only reads every param's current .grad (so a new grad after zero_grad(set_to_none)
// is seen) and sets the step scalars. The op itself still runs all of its checks on every call:
// nothing about the tensors is assumed from the last step. What C++ cannot see (a Python state
// dict whose tensor was replaced, a changed option) its owner checks before each step (Python:
// optimizers/_held.py; the C++ front: its per-group cache) and makes a new HeldStep on any change.
class HeldStep : public torch::CustomClassHolder {
 public:
  // `family`: "adam", "sgd", ... (the ops mixprec::<family>_ and <family>_check). The op's
  // arguments in schema order, split by kind: `tensors` the tensor lists flattened (`lengths`
  // per list) and the plain tensors; `optionals` each Tensor? argument; `floats`, `ints` and
  // `bools` each of those. The list named "grads" is read from the params at every step;
  // `per_step`: names of Tensor? arguments given anew at every step (besides the step scalars).
  // `bools` holds 0 or 1 each.
  HeldStep(const std::string& family, const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& lengths,
           const c10::List<std::optional<at::Tensor>>& optionals, const std::vector<double>& floats,
           const std::vector<int64_t>& ints, const std::vector<int64_t>& bools,
           const std::vector<std::string>& per_step);

  // Runs the op (validate_only: its check twin) with these step scalars and `extras` (the
  // per_step arguments, in order). False, with nothing run, when some param has no dense grad or
  // is no longer on the held device or dtype: its owner then takes its fully checked path.
  // `check_inf`: first a GradScaler's inf check of the same grads into found_inf, grad_scale
  // being the scale (as check_inf below), so that a scaler step is one call.
  bool step(std::optional<at::Tensor> step_tensor, double lr, std::optional<at::Tensor> lr_tensor,
            std::optional<at::Tensor> grad_scale, std::optional<at::Tensor> found_inf,
            c10::List<std::optional<at::Tensor>> extras, bool validate_only, bool check_inf);

  // A GradScaler's read-only inf check of the held grads into found_inf (one op call); with
  // `scale`, also flags a scale whose float32 reciprocal is unusable (0, inf, NaN or negative:
  // its logarithm is not finite) in the same call. False, with nothing run, as for step().
  bool check_inf(at::Tensor found_inf, std::optional<at::Tensor> scale);

  int64_t num_params() const { return static_cast<int64_t>(params_.size()); }
  const std::string& family() const { return family_; }

 private:
  // The params' current grads, or nothing when a param has no dense grad or left the device.
  std::optional<c10::List<at::Tensor>> current_grads() const;
  size_t index_of(const std::string& name) const;
  static void check_grads(std::vector<at::Tensor> tensors, const at::Tensor& found_inf,
                          const std::optional<at::Tensor>& scale);

  std::string family_;
  c10::OperatorHandle op_, check_op_;  // <family>_ and <family>_check
  std::vector<c10::IValue> stack_;     // the op's arguments, in schema order
  std::vector<at::Tensor> params_;
  std::vector<at::ScalarType> dtypes_;  // the params' when held
  at::Device device_{at::kCPU};
  size_t grads_at_, step_tensor_at_, lr_at_, lr_tensor_at_, grad_scale_at_, found_inf_at_;
  std::vector<size_t> per_step_at_;
};

// FusedLAMB clips against the L2 norm of every gradient of every group; built in Python each step
// (a loop over 292 params and a fresh list through the dispatcher) it cost ~150 us of host time,
// more than the held steps it precedes. A HeldNorm keeps the params of all held groups, split by
// device, and each step reads their current grads and makes exactly the calls
// FusedLAMB._global_grad_norms makes (the same ops in the same order: the same bits). The op's
// kept packing (pack_lists) serves the unchanged list.
class HeldNorm : public torch::CustomClassHolder {
 public:
  // `params`: every param of every held group, per device in order of first use, `lengths` per
  // device; each list in group order (the order the checked path reduces in).
  HeldNorm(const std::vector<at::Tensor>& params, const std::vector<int64_t>& lengths);

  // The unscaled L2 norm of all current grads (divided by `grad_scale`, a GradScaler's scale, on
  // the device): one float32 [1] per device, in the held order, no host sync. Empty, with nothing
  // run, when some param has no dense grad on its own held device: its owner then takes its
  // fully checked path.
  std::vector<at::Tensor> norms(std::optional<at::Tensor> grad_scale) const;

 private:
  std::vector<std::vector<at::Tensor>> params_;  // per device
  std::vector<at::Device> devices_;
};

}  // namespace mixprec::detail
