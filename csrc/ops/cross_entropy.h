// Ops-tier implementation of the fused cross-entropy, shared by the CPU, CUDA and Meta registrations.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "kernels/cross_entropy.h"

namespace mixprec::detail {

struct CrossEntropyRunners {
  void (*forward)(const kernels::CrossEntropyForwardParams&);
  void (*backward)(const kernels::CrossEntropyBackwardParams&);
  // Whether every target must be checked against [0, V) before a kernel runs: on the CPU it is
  // free to look; on CUDA it would wait for the device, so the kernels poison the row instead.
  bool check_target_values;
};

// Checks dtype, device, shape and contiguity of the forward's operands (sizes may be symbolic:
// the Meta kernel runs this on fake tensors); errors name the op and the argument.
void check_cross_entropy_forward(const at::Tensor& logits, const at::Tensor& target);
void check_cross_entropy_backward(const at::Tensor& grad_losses, const at::Tensor& logits, const at::Tensor& target,
                                  const at::Tensor& lse);

std::tuple<at::Tensor, at::Tensor> cross_entropy_forward_impl(const at::Tensor& logits, const at::Tensor& target,
                                                              int64_t ignore_index, const CrossEntropyRunners& run);
at::Tensor cross_entropy_backward_impl(const at::Tensor& grad_losses, const at::Tensor& logits,
                                       const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
                                       const CrossEntropyRunners& run);

}  // namespace mixprec::detail
