// Ops-tier implementation of the multi-tensor norm, shared by the CPU and CUDA registrations.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "kernels/norm.h"

namespace mixprec::detail {

struct NormRunners {
  void (*partials)(const kernels::NormParams&);
  void (*finalize)(const kernels::NormFinalizeParams&);
};

std::tuple<at::Tensor, at::Tensor> multi_tensor_norm_impl(at::TensorList tensors, double ord, bool per_tensor,
                                                          NormRunners run);

// The norm type for `ord`, or an error naming the op that asked.
kernels::NormType norm_type_of(const char* op, double ord);

}  // namespace mixprec::detail
