// Meta registrations of the loss-scaling ops for torch.compile's fake tensors: they return
// nothing, so their meta impls only check what needs no data.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

constexpr const char* kUnscale = "non_finite_check_and_unscale_";
constexpr const char* kUpdate = "update_scale_";

void check_optional_on_meta(const char* op, const char* arg, const std::optional<at::Tensor>& t) {
  if (t) check_on_meta(op, arg, *t);
}

void non_finite_check_and_unscale_meta(at::TensorList grads, const std::optional<at::Tensor>& found_inf,
                                       const std::optional<at::Tensor>& inv_scale, at::TensorList out,
                                       const std::optional<at::Tensor>& per_tensor_found) {
  // Here when any tensor is on the meta device: all of them must be (check_on_meta says why).
  check_on_meta(kUnscale, "grads", grads);
  check_on_meta(kUnscale, "out", out);
  check_optional_on_meta(kUnscale, "found_inf", found_inf);
  check_optional_on_meta(kUnscale, "inv_scale", inv_scale);
  check_optional_on_meta(kUnscale, "per_tensor_found", per_tensor_found);
  MIXPREC_CHECK_VALUE(out.empty() || out.size() == grads.size(), arg_name("non_finite_check_and_unscale_", "out"),
                      " has ", num(out.size()), " tensors but grads has ", num(grads.size()));
}

void update_scale_meta(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const std::optional<at::Tensor>& hysteresis_tracker,
                       const std::optional<at::Tensor>& skipped_steps, const at::Tensor& found_inf, double, double,
                       int64_t, int64_t, double, double) {
  check_on_meta(kUpdate, "scale", scale);
  check_on_meta(kUpdate, "growth_tracker", growth_tracker);
  check_optional_on_meta(kUpdate, "hysteresis_tracker", hysteresis_tracker);
  check_optional_on_meta(kUpdate, "skipped_steps", skipped_steps);
  check_on_meta(kUpdate, "found_inf", found_inf);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, Meta, m) {
  m.impl("non_finite_check_and_unscale_", &non_finite_check_and_unscale_meta);
  m.impl("update_scale_", &update_scale_meta);
}

}  // namespace mixprec::detail
