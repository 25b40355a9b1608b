// CPU registration of the loss-scaling ops: chunks spread over ATen's thread pool.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/loss_scale.h"

namespace mixprec::detail {
namespace {

void run_unscale(const kernels::UnscaleParams& p) {
  at::parallel_for(0, p.group->total_chunks(), 1,
                   [&](int64_t b, int64_t e) { kernels::non_finite_check_and_unscale_cpu(p, b, e); });
}

void non_finite_check_and_unscale_cpu(at::TensorList grads, const std::optional<at::Tensor>& found_inf,
                                      const std::optional<at::Tensor>& inv_scale, at::TensorList out,
                                      const std::optional<at::Tensor>& per_tensor_found) {
  non_finite_check_and_unscale_impl(grads, found_inf, inv_scale, out, per_tensor_found, run_unscale);
}

void update_scale_cpu(const at::Tensor& scale, const at::Tensor& growth_tracker,
                      const std::optional<at::Tensor>& hysteresis_tracker,
                      const std::optional<at::Tensor>& skipped_steps, const at::Tensor& found_inf, double growth_factor,
                      double backoff_factor, int64_t growth_interval, int64_t hysteresis, double min_scale,
                      double max_scale) {
  update_scale_impl(scale, growth_tracker, hysteresis_tracker, skipped_steps, found_inf, growth_factor, backoff_factor,
                    growth_interval, hysteresis, min_scale, max_scale, kernels::update_scale_cpu);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) {
  m.impl("non_finite_check_and_unscale_", &non_finite_check_and_unscale_cpu);
  m.impl("update_scale_", &update_scale_cpu);
}

}  // namespace mixprec::detail
