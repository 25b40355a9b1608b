// Ops-tier pieces of linear_weight_bias_grad shared by its registrations: the argument checks and
// the composite (torch's mm and linear_bias_grad) that serves every device and dtype the CUDA
// cuBLASLt path does not take.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace mixprec::detail {

// grad [rows, out_features] and input [rows, in_features]: defined, 2-D, contiguous, on one
// device, one floating dtype, the same number of rows. Errors name the op and the argument.
void check_linear_weight_bias_grad(const at::Tensor& grad, const at::Tensor& input);

// grad [rows, out_features] summed over its rows: linear_bias_grad, or torch's sum for float64,
// which has no kernel of ours.
at::Tensor bias_grad_any_dtype(const at::Tensor& grad);

// (grad.t() @ input, grad summed over its rows): torch's mm and bias_grad_any_dtype. Checks its
// arguments first.
std::tuple<at::Tensor, at::Tensor> linear_weight_bias_grad_composite(const at::Tensor& grad, const at::Tensor& input);

}  // namespace mixprec::detail
