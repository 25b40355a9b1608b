// Meta registration of multi_tensor_norm: output shapes for torch.compile's fake tensors.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/norm.h"

namespace mixprec::detail {
namespace {

std::tuple<at::Tensor, at::Tensor> multi_tensor_norm_meta(at::TensorList tensors, double ord, bool per_tensor) {
  norm_type_of("multi_tensor_norm", ord);
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(at::kMeta);
  return {at::empty({}, opts), at::empty({per_tensor ? static_cast<int64_t>(tensors.size()) : 0}, opts)};
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, Meta, m) { m.impl("multi_tensor_norm", &multi_tensor_norm_meta); }

}  // namespace mixprec::detail
