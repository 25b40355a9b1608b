// Meta registrations of the loss-scaling ops for torch.compile's fake tensors: they return
// nothing, so their meta impls only check what needs no data.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

void non_finite_check_and_unscale_meta(at::TensorList grads, const std::optional<at::Tensor>&,
                                       const std::optional<at::Tensor>&, at::TensorList out,
                                       const std::optional<at::Tensor>&) {
  MIXPREC_CHECK_VALUE(out.empty() || out.size() == grads.size(), arg_name("non_finite_check_and_unscale_", "out"),
                      " has ", num(out.size()), " tensors but grads has ", num(grads.size()));
}

void update_scale_meta(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                       const std::optional<at::Tensor>&, const at::Tensor&, double, double, int64_t, int64_t, double,
                       double) {}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, Meta, m) {
  m.impl("non_finite_check_and_unscale_", &non_finite_check_and_unscale_meta);
  m.impl("update_scale_", &update_scale_meta);
}

}  // namespace mixprec::detail
