// Ops-tier implementation of rms_norm_forward / rms_norm_backward, shared by the CPU, CUDA and
// Meta registrations: argument checks (errors name the op and the argument) and the packing of
// tensors into the kernel tier's parameters.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

#include "kernels/rms_norm.h"

namespace mixprec::detail {

struct RmsNormRunners {
  void (*forward)(const kernels::RmsNormForwardParams&);
  int64_t (*splits)(kernels::DType dtype, int64_t rows, int64_t cols);  // rows of fp32 partials
  void (*backward)(const kernels::RmsNormBackwardParams&);
};

// input [..., *normalized_shape] contiguous fp32/fp16/bf16; weight shaped normalized_shape, of
// input's dtype or float32, on its device, contiguous.
void check_rms_norm_forward(const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const std::optional<at::Tensor>& weight);
// grad_out like input; rstd fp32 shaped input's leading dimensions; weight as above.
void check_rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& input, at::IntArrayRef normalized_shape,
                             const at::Tensor& rstd, const std::optional<at::Tensor>& weight);

// rstd's shape: input's dimensions before normalized_shape (symbolic under torch.compile).
std::vector<c10::SymInt> rms_norm_stat_shape(const at::Tensor& input, at::IntArrayRef normalized_shape);

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_impl(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                         const std::optional<at::Tensor>& weight, double eps,
                                                         const RmsNormRunners& runners);

// A gradient not asked for by output_mask (input, weight) comes back undefined.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_impl(const at::Tensor& grad_out, const at::Tensor& input,
                                                          at::IntArrayRef normalized_shape, const at::Tensor& rstd,
                                                          const std::optional<at::Tensor>& weight,
                                                          std::array<bool, 2> output_mask,
                                                          const RmsNormRunners& runners);

// The two ops' kernels for one backend, its runners bound at compile time (what it registers).
template <const RmsNormRunners& kRunners>
std::tuple<at::Tensor, at::Tensor> rms_norm_forward_with(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                         const std::optional<at::Tensor>& weight, double eps) {
  return rms_norm_forward_impl(input, normalized_shape, weight, eps, kRunners);
}
template <const RmsNormRunners& kRunners>
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_with(const at::Tensor& grad_out, const at::Tensor& input,
                                                          at::IntArrayRef normalized_shape, const at::Tensor& rstd,
                                                          const std::optional<at::Tensor>& weight,
                                                          std::array<bool, 2> output_mask) {
  return rms_norm_backward_impl(grad_out, input, normalized_shape, rstd, weight, output_mask, kRunners);
}

}  // namespace mixprec::detail
