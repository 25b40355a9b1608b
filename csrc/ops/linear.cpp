// mixprec::linear: torch's linear forward with a backward whose bias gradient is
// linear_bias_grad (kernels/bias_grad.h) instead of torch's generic sum(0). Forward and the two
// GEMMs of the backward are ATen's own calls, so only the bias gradient's kernel differs. The
// autograd node is C++, so a step through it costs the host what torch's own linear costs.
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/linear_grad.h"
#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kOp = "linear";

// at::linear checks too, but its messages do not name mixprec's op or the argument.
void check_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  MIXPREC_CHECK(input.defined() && weight.defined(), arg_name(kOp, input.defined() ? "weight" : "input"),
                " is undefined");
  MIXPREC_CHECK_VALUE(weight.dim() == 2, arg_name(kOp, "weight"),
                      " must be 2-D [out_features, in_features], got shape ", shape(weight.sym_sizes()));
  MIXPREC_CHECK_VALUE(input.dim() >= 1 && input.sym_size(-1) == weight.sym_size(1), arg_name(kOp, "input"),
                      " has shape ", shape(input.sym_sizes()),
                      "; its last dimension must be in_features = ", num(weight.sym_size(1)), " of weight ",
                      shape(weight.sym_sizes()));
  if (bias.has_value() && bias->defined())
    MIXPREC_CHECK_VALUE(bias->dim() == 1 && bias->sym_size(0) == weight.sym_size(0), arg_name(kOp, "bias"),
                        " must have shape [out_features] = [", num(weight.sym_size(0)), "], got ",
                        shape(bias->sym_sizes()));
}

at::Tensor linear_forward(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_linear(input, weight, bias);
  return at::linear(input, weight, bias);
}

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({input, weight});
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return at::linear(input, weight, bias);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const int64_t out_features = weight.size(0), in_features = weight.size(1);
    const at::Tensor grad = grads[0].contiguous();
    at::Tensor grad_input, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) grad_input = at::matmul(grad, weight);
    const at::Tensor grad2d = grad.reshape({-1, out_features});
    if (ctx->needs_input_grad(1)) grad_weight = grad2d.t().mm(input.reshape({-1, in_features}));
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) grad_bias = bias_grad_any_dtype(grad2d);
    return {grad_input, grad_weight, grad_bias};
  }
};

at::Tensor linear_autograd(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_linear(input, weight, bias);
  return LinearFunction::apply(input, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CompositeExplicitAutograd, m) { m.impl("linear", &linear_forward); }
TORCH_LIBRARY_IMPL(mixprec, Autograd, m) { m.impl("linear", &linear_autograd); }

}  // namespace mixprec::detail
