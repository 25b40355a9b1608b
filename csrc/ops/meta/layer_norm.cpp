// Meta registration of layer_norm_forward / layer_norm_backward: output shapes (symbolic under
// torch.compile) after the same argument checks the real kernels make.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/layer_norm.h"

namespace mixprec::detail {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_meta(const at::Tensor& input,
                                                                       const std::optional<at::Tensor>& weight,
                                                                       const std::optional<at::Tensor>& bias,
                                                                       double /*eps*/) {
  check_layer_norm_forward(input, weight, bias);
  const auto stats = input.options().dtype(at::kFloat);
  return {at::empty_like(input), at::empty_symint({input.sym_size(0)}, stats),
          at::empty_symint({input.sym_size(0)}, stats)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_meta(const at::Tensor& grad_out,
                                                                        const at::Tensor& input, const at::Tensor& mean,
                                                                        const at::Tensor& rstd,
                                                                        const std::optional<at::Tensor>& weight,
                                                                        std::array<bool, 3> output_mask) {
  check_layer_norm_backward(grad_out, input, mean, rstd, weight);
  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) grad_input = at::empty_like(input);
  if (output_mask[1]) grad_weight = at::empty_symint({input.sym_size(1)}, input.options());
  if (output_mask[2]) grad_bias = at::empty_symint({input.sym_size(1)}, input.options());
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, Meta, m) {
  m.impl("layer_norm_forward", &layer_norm_forward_meta);
  m.impl("layer_norm_backward", &layer_norm_backward_meta);
}

}  // namespace mixprec::detail
