// Ops-tier implementation of the loss-scaling family, shared by the CPU and CUDA registrations:
// validation and packing live here once; each backend passes only its kernel runner.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "kernels/loss_scale.h"

namespace mixprec::detail {

using UnscaleRunner = void (*)(const kernels::UnscaleParams&);
using ScaleUpdateRunner = void (*)(const kernels::ScaleUpdateParams&);

void non_finite_check_and_unscale_impl(at::TensorList grads, const std::optional<at::Tensor>& found_inf,
                                       const std::optional<at::Tensor>& inv_scale, at::TensorList out,
                                       const std::optional<at::Tensor>& per_tensor_found, UnscaleRunner run);

void update_scale_impl(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const std::optional<at::Tensor>& hysteresis_tracker,
                       const std::optional<at::Tensor>& skipped_steps, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                       double min_scale, double max_scale, ScaleUpdateRunner run);

}  // namespace mixprec::detail
