// Meta registration of rms_norm_forward / rms_norm_backward: output shapes (symbolic under
// torch.compile) after the same argument checks the real kernels make.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/rms_norm.h"

namespace mixprec::detail {
namespace {

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_meta(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                         const std::optional<at::Tensor>& weight, double /*eps*/) {
  check_rms_norm_forward(input, normalized_shape, weight);
  return {at::empty_like(input),
          at::empty_symint(rms_norm_stat_shape(input, normalized_shape), input.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_meta(const at::Tensor& grad_out, const at::Tensor& input,
                                                          at::IntArrayRef normalized_shape, const at::Tensor& rstd,
                                                          const std::optional<at::Tensor>& weight,
                                                          std::array<bool, 2> output_mask) {
  check_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight);
  const bool has_weight = weight.has_value() && weight->defined();
  at::Tensor grad_input, grad_weight;
  if (output_mask[0]) grad_input = at::empty_like(input);
  if (output_mask[1]) grad_weight = at::empty(normalized_shape, has_weight ? weight->options() : input.options());
  return {grad_input, grad_weight};
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, Meta, m) {
  m.impl("rms_norm_forward", &rms_norm_forward_meta);
  m.impl("rms_norm_backward", &rms_norm_backward_meta);
}

}  // namespace mixprec::detail
