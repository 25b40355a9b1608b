// Meta registration of the fused Adagrad op: it returns nothing, so torch.compile's fake tensors
// need no shapes from it; list lengths are the one thing checkable without data.
#include <torch/library.h>

#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

void adagrad_meta(at::TensorList params, at::TensorList grads, at::TensorList state_sums, at::TensorList master_params,
                  const std::optional<at::Tensor>&, double, double, double, double, bool, bool, int64_t,
                  const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                  const std::optional<at::Tensor>&) {
  for (const NamedList& l : {NamedList{"grads", grads}, NamedList{"state_sums", state_sums}})
    TORCH_CHECK_VALUE(l.tensors.size() == params.size(), arg_name("adagrad_", l.name), " has ",
                      num(l.tensors.size()), " tensors but params has ", num(params.size()));
  TORCH_CHECK_VALUE(master_params.empty() || master_params.size() == params.size(),
                    arg_name("adagrad_", "master_params"), " has ", num(master_params.size()),
                    " tensors but params has ", num(params.size()));
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, Meta, m) { m.impl("adagrad_", &adagrad_meta); }

}  // namespace mixprec::detail
