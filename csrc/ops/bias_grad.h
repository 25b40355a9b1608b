// Ops-tier implementation of linear_bias_grad, shared by the CPU, CUDA and Meta registrations.
#pragma once

#include <ATen/ATen.h>

#include "kernels/bias_grad.h"

namespace mixprec::detail {

struct BiasGradRunner {
  int64_t (*splits)(kernels::DType dtype, int64_t rows, int64_t cols);  // rows of fp32 partials
  void (*run)(const kernels::BiasGradParams&);
};

// Checks dtype, dimensionality and contiguity of grad (sizes may be symbolic: the Meta kernel
// runs this on fake tensors); errors name the op and the argument.
void check_linear_bias_grad(const at::Tensor& grad);

at::Tensor linear_bias_grad_impl(const at::Tensor& grad, const BiasGradRunner& runner);

}  // namespace mixprec::detail
