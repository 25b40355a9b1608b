// Validation and kernel-tier packing for linear_bias_grad (see kernels/bias_grad.h). Every check
// runs before any output is allocated or any kernel is launched.
#include "ops/bias_grad.h"

#include <c10/core/DeviceGuard.h>

#include <climits>

#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

constexpr const char* kOp = "linear_bias_grad";

}  // namespace

void check_linear_bias_grad(const at::Tensor& grad) {
  const std::string what = arg_name(kOp, "grad");
  MIXPREC_CHECK(grad.defined(), what, " is undefined");
  kernel_dtype(grad, what);
  MIXPREC_CHECK_VALUE(grad.dim() == 2, what, " must be 2-D [rows, out_features], got shape ", shape(grad.sym_sizes()));
  MIXPREC_CHECK(grad.is_contiguous(), what, " is not contiguous; mixprec's linear_bias_grad reads rows in place");
}

at::Tensor linear_bias_grad_impl(const at::Tensor& grad, const BiasGradRunner& runner) {
  check_linear_bias_grad(grad);
  const int64_t rows = grad.size(0), cols = grad.size(1);
  // The CUDA kernel indexes a row's columns with int.
  MIXPREC_CHECK_VALUE(cols <= INT_MAX, arg_name(kOp, "grad"), " has shape ", shape(grad.sizes()),
                      "; out_features must be below 2^31");
  at::Tensor out = at::empty({cols}, grad.options());
  if (cols == 0) return out;

  const c10::DeviceGuard guard(grad.device());
  kernels::BiasGradParams p;
  p.dtype = kernel_dtype(grad, arg_name(kOp, "grad"));
  p.grad = grad.data_ptr();
  p.rows = rows;
  p.cols = cols;
  p.splits = runner.splits(p.dtype, rows, cols);
  at::Tensor partials = at::empty({p.splits, cols}, grad.options().dtype(at::kFloat));
  p.partials = partials.data_ptr<float>();
  p.out = out.data_ptr();
  runner.run(p);
  return out;
}

}  // namespace mixprec::detail
