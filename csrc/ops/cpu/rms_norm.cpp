// CPU registration of rms_norm_forward / rms_norm_backward: rows (forward), row splits and then
// column ranges (backward) over ATen's thread pool.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/rms_norm.h"

namespace mixprec::detail {
namespace {

void forward(const kernels::RmsNormForwardParams& p) {
  at::parallel_for(0, p.rows, 16, [&](int64_t b, int64_t e) { kernels::rms_norm_forward_cpu(p, b, e); });
}

int64_t cpu_splits(kernels::DType /*dtype*/, int64_t rows, int64_t /*cols*/) { return kernels::cpu_row_splits(rows); }

void backward(const kernels::RmsNormBackwardParams& p) {
  if (p.partials == nullptr) {  // the input gradient alone: rows in any blocks
    kernels::RmsNormBackwardParams rows = p;
    rows.splits = p.rows;
    at::parallel_for(0, p.rows, 16, [&](int64_t b, int64_t e) { kernels::rms_norm_backward_cpu(rows, b, e); });
    return;
  }
  at::parallel_for(0, p.splits, 1, [&](int64_t b, int64_t e) { kernels::rms_norm_backward_cpu(p, b, e); });
  at::parallel_for(0, p.cols, 4096, [&](int64_t b, int64_t e) { kernels::rms_norm_weight_grad_finish_cpu(p, b, e); });
}

constexpr RmsNormRunners kRunners{forward, cpu_splits, backward};

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cpu(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                        const std::optional<at::Tensor>& weight, double eps) {
  return rms_norm_forward_impl(input, normalized_shape, weight, eps, kRunners);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_out, const at::Tensor& input,
                                                         at::IntArrayRef normalized_shape, const at::Tensor& rstd,
                                                         const std::optional<at::Tensor>& weight,
                                                         std::array<bool, 2> output_mask) {
  return rms_norm_backward_impl(grad_out, input, normalized_shape, rstd, weight, output_mask, kRunners);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) {
  m.impl("rms_norm_forward", &rms_norm_forward_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
}

}  // namespace mixprec::detail
