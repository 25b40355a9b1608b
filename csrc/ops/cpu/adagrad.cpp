// CPU registration of the fused Adagrad op: chunks spread over ATen's thread pool.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/adagrad.h"

namespace mixprec::detail {
namespace {

void run_adagrad(const kernels::AdagradParams& p) {
  at::parallel_for(0, p.group->total_chunks(), 1, [&](int64_t b, int64_t e) { kernels::adagrad_cpu(p, b, e); });
}

void adagrad_cpu(at::TensorList params, at::TensorList grads, at::TensorList state_sums, at::TensorList master_params,
                 const std::optional<at::Tensor>& step_tensor, double lr, double eps, double weight_decay,
                 double lr_decay, bool adagrad_w_mode, bool maximize, int64_t step,
                 const std::optional<at::Tensor>& lr_tensor, const std::optional<at::Tensor>& grad_scale,
                 const std::optional<at::Tensor>& found_inf) {
  adagrad_impl(params, grads, state_sums, master_params, step_tensor, lr, eps, weight_decay, lr_decay, adagrad_w_mode,
               maximize, step, lr_tensor, grad_scale, found_inf, {kernels::increment_step_cpu, run_adagrad});
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) { m.impl("adagrad_", &adagrad_cpu); }

}  // namespace mixprec::detail
