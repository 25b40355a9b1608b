// CPU registration of the fused SGD op: chunks spread over ATen's thread pool.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/sgd.h"

namespace mixprec::detail {
namespace {

void run_sgd(const kernels::SgdParams& p) {
  at::parallel_for(0, p.group->total_chunks(), 1, [&](int64_t b, int64_t e) { kernels::sgd_cpu(p, b, e); });
}

void sgd_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, at::TensorList master_params,
             const std::optional<at::Tensor>& step_tensor, double lr, double momentum, double dampening,
             double weight_decay, bool nesterov, bool wd_after_momentum, bool maximize, int64_t step,
             const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
             const std::optional<at::Tensor>& found_inf) {
  sgd_impl(params, grads, momentum_buffers, master_params, step_tensor, lr, momentum, dampening, weight_decay, nesterov,
           wd_after_momentum, maximize, step, lr_tensor, grad_scale, found_inf, {kernels::increment_step_cpu, run_sgd});
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) { m.impl("sgd_", &sgd_cpu); }

}  // namespace mixprec::detail
