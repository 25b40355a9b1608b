// Validation and packing for the loss-scaling ops (see loss_scale.h); kernels run per backend.
#include "ops/loss_scale.h"

#include <c10/core/DeviceGuard.h>

#include <cmath>

#include "ops/tensor_lists.h"

namespace mixprec::detail {

void non_finite_check_and_unscale_impl(at::TensorList grads, const std::optional<at::Tensor>& found_inf,
                                       const std::optional<at::Tensor>& inv_scale, at::TensorList out,
                                       const std::optional<at::Tensor>& per_tensor_found, UnscaleRunner run) {
  constexpr const char* kOp = "non_finite_check_and_unscale_";
  if (grads.empty()) {
    MIXPREC_CHECK_VALUE(out.empty(), arg_name(kOp, "out"), " has ", num(out.size()), " tensors but grads has 0");
    return;
  }
  // The grads decide the device, so a misplaced scalar is the argument the error names.
  const at::Device device = op_device(kOp, {"grads", grads}, std::nullopt);
  if (found_inf) check_scalar_tensor(kOp, "found_inf", *found_inf, device);
  if (inv_scale) check_scalar_tensor(kOp, "inv_scale", *inv_scale, device);
  if (per_tensor_found) {
    const at::Tensor& f = *per_tensor_found;
    const std::string what = arg_name(kOp, "per_tensor_found");
    MIXPREC_CHECK(f.device() == device, what, " is on ", f.device().str(), " but the op runs on ", device.str());
    MIXPREC_CHECK_TYPE(f.scalar_type() == at::kFloat, what, " has dtype ", f.scalar_type(), "; expected float32");
    MIXPREC_CHECK_VALUE(f.dim() == 1 && f.numel() == static_cast<int64_t>(grads.size()) && f.is_contiguous(), what,
                        " must be a contiguous float32 vector of len(grads) = ", num(grads.size()), ", got shape ",
                        shape(f.sizes()));
  }

  // In place: the output list is the input list. Check only: a single list, never written.
  // Out of place, out[i] may be grads[i] itself (that entry in place); any other shared memory
  // between what is written and what is read (out[0] = grads[1], a grad listed twice in place)
  // would unscale one tensor into another, or one tensor twice: refused.
  const bool writes = !out.empty() || inv_scale.has_value();
  std::vector<NamedList> lists{{"grads", grads, /*written=*/writes && out.empty()}};
  if (writes)
    lists.push_back(out.empty() ? NamedList{"grads", grads} : NamedList{"out", out, true, /*may_be_params=*/true});
  const PackedLists packed = pack_lists(kOp, lists, device, {/*dense_layouts=*/false, /*refuse_overlap=*/writes});
  check_scalars_apart(kOp,
                      {{"found_inf", found_inf ? &*found_inf : nullptr, true},
                       {"inv_scale", inv_scale ? &*inv_scale : nullptr, false},
                       {"per_tensor_found", per_tensor_found ? &*per_tensor_found : nullptr, true}},
                      lists);

  const c10::DeviceGuard guard(device);
  for (const kernels::TensorGroup& g : packed.groups) {
    kernels::UnscaleParams p;
    p.group = &g;
    p.found_inf = found_inf ? found_inf->data_ptr<float>() : nullptr;
    p.inv_scale = inv_scale ? inv_scale->data_ptr<float>() : nullptr;
    p.per_tensor_found = per_tensor_found ? per_tensor_found->data_ptr<float>() : nullptr;
    run(p);
  }
}

void update_scale_impl(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const std::optional<at::Tensor>& hysteresis_tracker,
                       const std::optional<at::Tensor>& skipped_steps, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                       double min_scale, double max_scale, ScaleUpdateRunner run) {
  constexpr const char* kOp = "update_scale_";
  const at::Device device = scale.device();
  check_scalar_tensor(kOp, "scale", scale, device);
  check_scalar_tensor(kOp, "growth_tracker", growth_tracker, device, at::kInt);
  if (hysteresis_tracker) check_scalar_tensor(kOp, "hysteresis_tracker", *hysteresis_tracker, device, at::kInt);
  if (skipped_steps) check_scalar_tensor(kOp, "skipped_steps", *skipped_steps, device, at::kLong);
  check_scalar_tensor(kOp, "found_inf", found_inf, device);
  MIXPREC_CHECK_VALUE(growth_factor > 0, arg_name(kOp, "growth_factor"), " must be positive, got ", num(growth_factor));
  MIXPREC_CHECK_VALUE(backoff_factor > 0, arg_name(kOp, "backoff_factor"), " must be positive, got ",
                      num(backoff_factor));
  MIXPREC_CHECK_VALUE(growth_interval >= 1 && growth_interval <= INT32_MAX, arg_name(kOp, "growth_interval"),
                      " must be a positive 32-bit integer, got ", num(growth_interval));
  MIXPREC_CHECK_VALUE(hysteresis >= 1 && hysteresis <= INT32_MAX, arg_name(kOp, "hysteresis"),
                      " must be a positive 32-bit integer, got ", num(hysteresis));
  MIXPREC_CHECK_VALUE(min_scale >= 0 && std::isfinite(min_scale), arg_name(kOp, "min_scale"),
                      " must be finite and >= 0, got ", num(min_scale));
  MIXPREC_CHECK_VALUE(max_scale == 0 || max_scale >= min_scale, arg_name(kOp, "max_scale"),
                      " must be 0 (no cap) or >= min_scale = ", num(min_scale), ", got ", num(max_scale));
  MIXPREC_CHECK_VALUE(hysteresis == 1 || hysteresis_tracker.has_value(), arg_name(kOp, "hysteresis_tracker"),
                      " is required when hysteresis > 1");
  check_scalars_apart(kOp, {{"scale", &scale, true},
                            {"growth_tracker", &growth_tracker, true},
                            {"hysteresis_tracker", hysteresis_tracker ? &*hysteresis_tracker : nullptr, true},
                            {"skipped_steps", skipped_steps ? &*skipped_steps : nullptr, true},
                            {"found_inf", &found_inf, false}});

  kernels::ScaleUpdateParams p;
  p.scale = scale.data_ptr<float>();
  p.growth_tracker = growth_tracker.data_ptr<int32_t>();
  p.hysteresis_tracker = hysteresis_tracker ? hysteresis_tracker->data_ptr<int32_t>() : nullptr;
  p.skipped_steps = skipped_steps ? skipped_steps->data_ptr<int64_t>() : nullptr;
  p.found_inf = found_inf.data_ptr<float>();
  p.growth_factor = growth_factor;
  p.backoff_factor = backoff_factor;
  p.growth_interval = static_cast<int32_t>(growth_interval);
  p.hysteresis = static_cast<int32_t>(hysteresis);
  p.min_scale = min_scale;
  p.max_scale = max_scale;
  const c10::DeviceGuard guard(device);
  run(p);
}

}  // namespace mixprec::detail
