// mixprec::layer_norm: torch.nn.functional.layer_norm on mixprec's kernels (layer_norm_forward /
// layer_norm_backward, see kernels/layer_norm.h), with a C++ autograd node so that a step through
// it costs the host what torch's own LayerNorm costs. Inputs the kernels do not take (float64,
// or on CUDA a normalized size past kLayerNormMaxCudaCols) go to torch's LayerNorm instead.
#include <c10/util/accumulate.h>
#include <mixprec/ops.h>  // the forward and backward ops, called through the dispatcher
#include <torch/autograd.h>
#include <torch/library.h>

#include "kernels/layer_norm.h"
#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kOp = "layer_norm";

// torch's rules, with errors that name mixprec's op and the argument; returns the normalized size.
int64_t check_layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                         const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias) {
  MIXPREC_CHECK(input.defined(), arg_name(kOp, "input"), " is undefined");
  const auto dims = static_cast<int64_t>(normalized_shape.size());
  MIXPREC_CHECK_VALUE(dims >= 1, arg_name(kOp, "normalized_shape"), " must have at least one dimension");
  MIXPREC_CHECK_VALUE(input.dim() >= dims && input.sizes().slice(input.dim() - dims) == normalized_shape,
                      arg_name(kOp, "input"), " has shape ", shape(input.sizes()), "; its last dimensions must be ",
                      "normalized_shape ", shape(normalized_shape));
  for (const auto& [arg, t] : {std::pair<const char*, const std::optional<at::Tensor>&>{"weight", weight},
                               std::pair<const char*, const std::optional<at::Tensor>&>{"bias", bias}}) {
    if (t.has_value() && t->defined())
      MIXPREC_CHECK_VALUE(t->sizes() == normalized_shape, arg_name(kOp, arg), " must have shape normalized_shape ",
                          shape(normalized_shape), ", got ", shape(t->sizes()));
  }
  int64_t cols = 1;
  for (const int64_t d : normalized_shape) cols *= d;
  return cols;
}

// Whether mixprec's kernels take this input; torch's LayerNorm serves the rest.
bool kernels_take(const at::Tensor& input, int64_t cols) {
  return has_kernel_dtype(input) && cols > 0 && (!input.is_cuda() || cols <= kernels::kLayerNormMaxCudaCols);
}

std::optional<at::Tensor> flat(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return t->reshape({-1}).contiguous();
}

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                            double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const at::Tensor rows = input.contiguous().view({-1, c10::multiply_integers(normalized_shape)});
    const std::optional<at::Tensor> w = flat(weight);
    auto [out, mean, rstd] = mixprec::layer_norm_forward(rows, w, flat(bias), eps);
    ctx->save_for_backward({rows, mean, rstd, w.value_or(at::Tensor())});
    ctx->saved_data["has_weight"] = w.has_value();
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["normalized_shape"] = normalized_shape.vec();
    return out.view(input.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& rows = saved[0];
    const bool has_weight = ctx->saved_data["has_weight"].toBool();
    const std::optional<at::Tensor> weight = has_weight ? std::optional<at::Tensor>(saved[3]) : std::nullopt;
    // needs_input_grad counts the tensor arguments that were given: input, then weight and bias
    // where present (an absent optional is no input of the node).
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), has_weight && ctx->needs_input_grad(1),
                                   has_bias && ctx->needs_input_grad(has_weight ? 2 : 1)};
    const at::Tensor grad = grads[0].contiguous().view(rows.sizes());
    auto [grad_rows, grad_weight, grad_bias] =
        mixprec::layer_norm_backward(grad, rows, saved[1], saved[2], weight, mask);
    // Back in the caller's shapes: input's, and weight's / bias's (normalized_shape).
    const auto param_shape = ctx->saved_data["normalized_shape"].toIntVector();
    return {mask[0] ? grad_rows.view(grads[0].sizes()) : at::Tensor(), at::Tensor(),
            mask[1] ? grad_weight.view(param_shape) : at::Tensor(),
            mask[2] ? grad_bias.view(param_shape) : at::Tensor(), at::Tensor()};
  }
};

at::Tensor layer_norm_no_autograd(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                  double eps) {
  const int64_t cols = check_layer_norm(input, normalized_shape, weight, bias);
  if (!kernels_take(input, cols)) return at::layer_norm(input, normalized_shape, weight, bias, eps);
  const at::Tensor rows = input.contiguous().view({-1, cols});
  return std::get<0>(mixprec::layer_norm_forward(rows, flat(weight), flat(bias), eps)).view(input.sizes());
}

at::Tensor layer_norm_autograd(const at::Tensor& input, at::IntArrayRef normalized_shape,
                               const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                               double eps) {
  const int64_t cols = check_layer_norm(input, normalized_shape, weight, bias);
  if (!kernels_take(input, cols)) return at::layer_norm(input, normalized_shape, weight, bias, eps);
  return LayerNormFunction::apply(input, normalized_shape, weight, bias, eps);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CompositeExplicitAutograd, m) { m.impl("layer_norm", &layer_norm_no_autograd); }
TORCH_LIBRARY_IMPL(mixprec, Autograd, m) { m.impl("layer_norm", &layer_norm_autograd); }

}  // namespace mixprec::detail
