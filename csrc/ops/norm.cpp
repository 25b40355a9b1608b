// Validation, scratch allocation and packing for multi_tensor_norm (see norm.h).
#include "ops/norm.h"

#include <c10/core/DeviceGuard.h>

#include <cmath>

#include "ops/tensor_lists.h"

namespace mixprec::detail {

kernels::NormType norm_type_of(const char* op, double ord) {
  if (ord == 2.0) return kernels::NormType::kL2;
  if (std::isinf(ord) && ord > 0) return kernels::NormType::kInf;
  MIXPREC_CHECK_VALUE(false, arg_name(op, "ord"), " must be 2 or inf, got ", num(ord));
  return kernels::NormType::kL2;  // unreachable
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_norm_impl(at::TensorList tensors, double ord, bool per_tensor,
                                                          NormRunners run) {
  constexpr const char* kOp = "multi_tensor_norm";
  const kernels::NormType type = norm_type_of(kOp, ord);
  if (tensors.empty()) return {at::zeros({}, at::kFloat), at::empty({0}, at::kFloat)};
  const at::Device device = op_device(kOp, {"tensors", tensors}, std::nullopt);
  // A norm is a sum over elements in any order: any dense layout will do.
  const PackedLists packed = pack_lists(kOp, {{"tensors", tensors}}, device, PackRules{/*dense_layouts=*/true});
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  // Empty tensors have no chunks and get no kernel: their norm is the zero written here.
  at::Tensor per = per_tensor ? at::zeros({packed.num_tensors}, opts) : at::empty({0}, opts);
  if (packed.total_chunks == 0) return {at::zeros({}, opts), per};
  at::Tensor total = at::empty({}, opts);
  at::Tensor partials = at::empty({packed.total_chunks}, opts);

  const c10::DeviceGuard guard(device);
  for (const kernels::TensorGroup& g : packed.groups) {
    kernels::NormParams p;
    p.group = &g;
    p.type = type;
    p.partials = partials.data_ptr<float>();
    run.partials(p);
  }
  kernels::NormFinalizeParams f;
  f.all = &packed.all;
  f.type = type;
  f.partials = partials.data_ptr<float>();
  f.total_chunks = packed.total_chunks;
  f.total = total.data_ptr<float>();
  f.per_tensor = per_tensor ? per.data_ptr<float>() : nullptr;
  run.finalize(f);
  return {total, per};
}

}  // namespace mixprec::detail
