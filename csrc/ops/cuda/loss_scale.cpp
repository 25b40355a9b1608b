// CUDA registration of the loss-scaling ops: kernels launched on the current stream,
// with no host synchronization.
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include "ops/loss_scale.h"

namespace mixprec::detail {
namespace {

kernels::Stream current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

void non_finite_check_and_unscale_cuda(at::TensorList grads, const std::optional<at::Tensor>& found_inf,
                                       const std::optional<at::Tensor>& inv_scale, at::TensorList out,
                                       const std::optional<at::Tensor>& per_tensor_found) {
  non_finite_check_and_unscale_impl(
      grads, found_inf, inv_scale, out, per_tensor_found,
      [](const kernels::UnscaleParams& p) { kernels::non_finite_check_and_unscale_cuda(p, current_stream()); });
}

void update_scale_cuda(const at::Tensor& scale, const at::Tensor& growth_tracker,
                       const std::optional<at::Tensor>& hysteresis_tracker,
                       const std::optional<at::Tensor>& skipped_steps, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                       double min_scale, double max_scale) {
  update_scale_impl(scale, growth_tracker, hysteresis_tracker, skipped_steps, found_inf, growth_factor, backoff_factor,
                    growth_interval, hysteresis, min_scale, max_scale,
                    [](const kernels::ScaleUpdateParams& p) { kernels::update_scale_cuda(p, current_stream()); });
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CUDA, m) {
  m.impl("non_finite_check_and_unscale_", &non_finite_check_and_unscale_cuda);
  m.impl("update_scale_", &update_scale_cuda);
}

}  // namespace mixprec::detail
