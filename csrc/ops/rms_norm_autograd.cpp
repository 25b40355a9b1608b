// mixprec::rms_norm: torch.nn.functional.rms_norm on mixprec's kernels (rms_norm_forward /
// rms_norm_backward, see kernels/rms_norm.h), with a C++ autograd node as layer_norm's. Inputs the
// kernels do not take (float64, or on CUDA a normalized size past kRmsNormMaxCudaCols) go to
// torch's rms_norm instead.
#include <c10/util/accumulate.h>
#include <mixprec/ops.h>  // the forward and backward ops, called through the dispatcher
#include <torch/autograd.h>
#include <torch/library.h>

#include <limits>

#include "kernels/rms_norm.h"
#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// eps = None: the machine epsilon of the type torch computes in, as torch's F.rms_norm does: float32's
// for fp16/bf16/fp32 inputs, float64's for float64 (torch's documentation says finfo(input.dtype),
// but its kernels use the accumulation type's; bf16's 2^-7 would change the model).
double eps_or_default(const at::Tensor& input, std::optional<double> eps) {
  if (eps.has_value()) return *eps;
  return input.scalar_type() == at::kDouble ? std::numeric_limits<double>::epsilon()
                                            : std::numeric_limits<float>::epsilon();
}

// Whether mixprec's kernels take this input; torch's rms_norm serves the rest. (The ops check
// shapes and dtypes themselves, with errors that name them.)
bool kernels_take(const at::Tensor& input, at::IntArrayRef normalized_shape) {
  if (!input.defined() || !has_kernel_dtype(input) || normalized_shape.empty()) return !input.defined();
  const int64_t cols = c10::multiply_integers(normalized_shape);
  return cols > 0 && (!input.is_cuda() || cols <= kernels::kRmsNormMaxCudaCols);
}

std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return t->contiguous();
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const std::optional<at::Tensor>& weight, double eps) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const at::Tensor x = input.contiguous();
    const std::optional<at::Tensor> w = contiguous(weight);
    auto [out, rstd] = mixprec::rms_norm_forward(x, normalized_shape, w, eps);
    ctx->save_for_backward({x, rstd, w.value_or(at::Tensor())});
    ctx->saved_data["has_weight"] = w.has_value();
    ctx->saved_data["normalized_shape"] = normalized_shape.vec();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_weight = ctx->saved_data["has_weight"].toBool();
    const std::optional<at::Tensor> weight = has_weight ? std::optional<at::Tensor>(saved[2]) : std::nullopt;
    // needs_input_grad counts the tensor arguments given: input, then weight where present.
    const std::array<bool, 2> mask{ctx->needs_input_grad(0), has_weight && ctx->needs_input_grad(1)};
    const auto normalized_shape = ctx->saved_data["normalized_shape"].toIntVector();
    auto [grad_input, grad_weight] =
        mixprec::rms_norm_backward(grads[0].contiguous(), saved[0], normalized_shape, saved[1], weight, mask);
    return {mask[0] ? grad_input : at::Tensor(), at::Tensor(), mask[1] ? grad_weight : at::Tensor(), at::Tensor()};
  }
};

at::Tensor rms_norm_no_autograd(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  if (!kernels_take(input, normalized_shape)) return at::rms_norm(input, normalized_shape, weight, eps);
  return std::get<0>(
      mixprec::rms_norm_forward(input.contiguous(), normalized_shape, contiguous(weight), eps_or_default(input, eps)));
}

at::Tensor rms_norm_autograd(const at::Tensor& input, at::IntArrayRef normalized_shape,
                             const std::optional<at::Tensor>& weight, std::optional<double> eps) {
  if (!kernels_take(input, normalized_shape)) return at::rms_norm(input, normalized_shape, weight, eps);
  return RmsNormFunction::apply(input, normalized_shape, weight, eps_or_default(input, eps));
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CompositeExplicitAutograd, m) { m.impl("rms_norm", &rms_norm_no_autograd); }
TORCH_LIBRARY_IMPL(mixprec, Autograd, m) { m.impl("rms_norm", &rms_norm_autograd); }

}  // namespace mixprec::detail
