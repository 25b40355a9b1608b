// CPU registration of linear_bias_grad: row splits, then column ranges, over ATen's thread pool.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/bias_grad.h"

namespace mixprec::detail {
namespace {

int64_t cpu_splits(kernels::DType /*dtype*/, int64_t rows, int64_t /*cols*/) { return kernels::cpu_row_splits(rows); }

void run(const kernels::BiasGradParams& p) {
  at::parallel_for(0, p.splits, 1, [&](int64_t b, int64_t e) { kernels::bias_grad_partials_cpu(p, b, e); });
  at::parallel_for(0, p.cols, 4096, [&](int64_t b, int64_t e) { kernels::bias_grad_finish_cpu(p, b, e); });
}

constexpr BiasGradRunner kRunner{cpu_splits, run};

at::Tensor linear_bias_grad_cpu(const at::Tensor& grad) { return linear_bias_grad_impl(grad, kRunner); }

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) { m.impl("linear_bias_grad", &linear_bias_grad_cpu); }

}  // namespace mixprec::detail
