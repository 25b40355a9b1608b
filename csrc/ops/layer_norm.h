// Ops-tier implementation of layer_norm_forward / layer_norm_backward, shared by the CPU, CUDA and
// Meta registrations: argument checks (errors name the op and the argument) and the packing of
// tensors into the kernel tier's parameters.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

#include "kernels/layer_norm.h"

namespace mixprec::detail {

struct LayerNormRunners {
  void (*forward)(const kernels::LayerNormForwardParams&);
  int64_t (*splits)(kernels::DType dtype, int64_t rows, int64_t cols);  // rows of fp32 partials
  void (*backward)(const kernels::LayerNormBackwardParams&);
};

// input [rows, cols] contiguous fp32/fp16/bf16; weight and bias [cols] of its dtype and device.
void check_layer_norm_forward(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& bias);
// grad_out like input; mean and rstd fp32 [rows]; weight as above.
void check_layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
                               const at::Tensor& rstd, const std::optional<at::Tensor>& weight);

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_impl(const at::Tensor& input,
                                                                       const std::optional<at::Tensor>& weight,
                                                                       const std::optional<at::Tensor>& bias,
                                                                       double eps, const LayerNormRunners& runners);

// Gradients not asked for by output_mask (input, weight, bias) come back undefined.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_impl(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, std::array<bool, 3> output_mask, const LayerNormRunners& runners);

// The two ops' kernels for one backend, its runners bound at compile time (what it registers).
template <const LayerNormRunners& kRunners>
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_with(const at::Tensor& input,
                                                                       const std::optional<at::Tensor>& weight,
                                                                       const std::optional<at::Tensor>& bias,
                                                                       double eps) {
  return layer_norm_forward_impl(input, weight, bias, eps, kRunners);
}
template <const LayerNormRunners& kRunners>
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_with(const at::Tensor& grad_out,
                                                                        const at::Tensor& input, const at::Tensor& mean,
                                                                        const at::Tensor& rstd,
                                                                        const std::optional<at::Tensor>& weight,
                                                                        std::array<bool, 3> output_mask) {
  return layer_norm_backward_impl(grad_out, input, mean, rstd, weight, output_mask, kRunners);
}

}  // namespace mixprec::detail
