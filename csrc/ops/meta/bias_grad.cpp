// Meta registration of linear_bias_grad: the output shape (symbolic under torch.compile) after
// the same argument checks the real kernels make.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/bias_grad.h"

namespace mixprec::detail {
namespace {

at::Tensor linear_bias_grad_meta(const at::Tensor& grad) {
  check_linear_bias_grad(grad);
  return at::empty_symint({grad.sym_size(1)}, grad.options());
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, Meta, m) { m.impl("linear_bias_grad", &linear_bias_grad_meta); }

}  // namespace mixprec::detail
