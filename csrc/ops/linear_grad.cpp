// linear_weight_bias_grad's checks and its composite implementation, registered for every backend
// without a kernel of its own (CPU, Meta); the CUDA registration (ops/cuda/linear_grad.cpp) falls
// back to it where cuBLASLt does not serve.
#include "ops/linear_grad.h"

#include <mixprec/ops.h>
#include <torch/library.h>

#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

constexpr const char* kOp = "linear_weight_bias_grad";

void check_matrix(const at::Tensor& t, const char* arg, const char* layout) {
  MIXPREC_CHECK(t.defined(), arg_name(kOp, arg), " is undefined");
  MIXPREC_CHECK_VALUE(t.dim() == 2, arg_name(kOp, arg), " must be 2-D ", layout, ", got shape ", shape(t.sym_sizes()));
  MIXPREC_CHECK_TYPE(at::isFloatingType(t.scalar_type()), arg_name(kOp, arg), " must be a floating tensor, got ",
                     t.scalar_type());
  MIXPREC_CHECK(t.is_contiguous(), arg_name(kOp, arg), " is not contiguous");
}

}  // namespace

void check_linear_weight_bias_grad(const at::Tensor& grad, const at::Tensor& input) {
  check_matrix(grad, "grad", "[rows, out_features]");
  check_matrix(input, "input", "[rows, in_features]");
  MIXPREC_CHECK_TYPE(input.scalar_type() == grad.scalar_type(), arg_name(kOp, "input"), " is ", input.scalar_type(),
                     " but grad is ", grad.scalar_type(), "; both must have one dtype");
  MIXPREC_CHECK(input.device() == grad.device(), arg_name(kOp, "input"), " is on ", input.device(), " but grad is on ",
                grad.device());
  MIXPREC_CHECK_VALUE(input.sym_size(0) == grad.sym_size(0), arg_name(kOp, "input"), " has shape ",
                      shape(input.sym_sizes()), " but grad has shape ", shape(grad.sym_sizes()),
                      "; both must have the same number of rows");
}

at::Tensor bias_grad_any_dtype(const at::Tensor& grad) {
  return has_kernel_dtype(grad) ? mixprec::linear_bias_grad(grad) : grad.sum(0);
}

std::tuple<at::Tensor, at::Tensor> linear_weight_bias_grad_composite(const at::Tensor& grad, const at::Tensor& input) {
  check_linear_weight_bias_grad(grad, input);
  return {grad.t().mm(input), bias_grad_any_dtype(grad)};
}

TORCH_LIBRARY_IMPL(mixprec, CompositeExplicitAutograd, m) {
  m.impl("linear_weight_bias_grad", &linear_weight_bias_grad_composite);
}

}  // namespace mixprec::detail
