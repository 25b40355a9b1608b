// Meta registration of the fused LAMB op: it returns nothing, so torch.compile's fake tensors
// need no shapes from it; list lengths are the one thing checkable without data.
#include <torch/library.h>

#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

void lamb_meta(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList master_params, const std::optional<at::Tensor>&, double, double, double, double, double,
               bool, bool, bool, double, bool, int64_t, const std::optional<at::Tensor>&,
               const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {
  for (const NamedList& l : {NamedList{"grads", grads}, NamedList{"exp_avgs", exp_avgs}, NamedList{"exp_avg_sqs", exp_avg_sqs}})
    TORCH_CHECK_VALUE(l.tensors.size() == params.size(), arg_name("lamb_", l.name), " has ",
                      num(l.tensors.size()), " tensors but params has ", num(params.size()));
  TORCH_CHECK_VALUE(master_params.empty() || master_params.size() == params.size(), arg_name("lamb_", "master_params"),
                    " has ", num(master_params.size()), " tensors but params has ", num(params.size()));
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, Meta, m) { m.impl("lamb_", &lamb_meta); }

}  // namespace mixprec::detail
