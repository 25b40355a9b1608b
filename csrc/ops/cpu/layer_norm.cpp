// CPU registration of layer_norm_forward / layer_norm_backward: rows (forward), row splits and
// then column ranges (backward) over ATen's thread pool.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/layer_norm.h"

namespace mixprec::detail {
namespace {

void forward(const kernels::LayerNormForwardParams& p) {
  at::parallel_for(0, p.rows, 16, [&](int64_t b, int64_t e) { kernels::layer_norm_forward_cpu(p, b, e); });
}

int64_t cpu_splits(kernels::DType /*dtype*/, int64_t rows, int64_t /*cols*/) { return kernels::cpu_row_splits(rows); }

void backward(const kernels::LayerNormBackwardParams& p) {
  if (p.partials == nullptr) {  // the input gradient alone: rows in any blocks
    kernels::LayerNormBackwardParams rows = p;
    rows.splits = p.rows;
    at::parallel_for(0, p.rows, 16, [&](int64_t b, int64_t e) { kernels::layer_norm_backward_cpu(rows, b, e); });
    return;
  }
  at::parallel_for(0, p.splits, 1, [&](int64_t b, int64_t e) { kernels::layer_norm_backward_cpu(p, b, e); });
  at::parallel_for(0, p.cols, 4096, [&](int64_t b, int64_t e) { kernels::layer_norm_param_grads_finish_cpu(p, b, e); });
}

constexpr LayerNormRunners kRunners{forward, cpu_splits, backward};

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_cpu(const at::Tensor& input,
                                                                      const std::optional<at::Tensor>& weight,
                                                                      const std::optional<at::Tensor>& bias,
                                                                      double eps) {
  return layer_norm_forward_impl(input, weight, bias, eps, kRunners);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cpu(const at::Tensor& grad_out,
                                                                       const at::Tensor& input, const at::Tensor& mean,
                                                                       const at::Tensor& rstd,
                                                                       const std::optional<at::Tensor>& weight,
                                                                       std::array<bool, 3> output_mask) {
  return layer_norm_backward_impl(grad_out, input, mean, rstd, weight, output_mask, kRunners);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) {
  m.impl("layer_norm_forward", &layer_norm_forward_cpu);
  m.impl("layer_norm_backward", &layer_norm_backward_cpu);
}

}  // namespace mixprec::detail
