// CPU registration of multi_tensor_norm: per-chunk partials spread over ATen's thread pool.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops/norm.h"

namespace mixprec::detail {
namespace {

void run_norm_partials(const kernels::NormParams& p) {
  at::parallel_for(0, p.group->total_chunks(), 1, [&](int64_t b, int64_t e) { kernels::norm_partials_cpu(p, b, e); });
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_norm_cpu(at::TensorList tensors, double ord, bool per_tensor) {
  return multi_tensor_norm_impl(tensors, ord, per_tensor, {run_norm_partials, kernels::norm_finalize_cpu});
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CPU, m) { m.impl("multi_tensor_norm", &multi_tensor_norm_cpu); }

}  // namespace mixprec::detail
