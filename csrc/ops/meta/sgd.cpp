// Meta registration of the fused SGD op: it returns nothing, so torch.compile's fake tensors need
// no shapes from it; list lengths are the one thing checkable without data.
#include <torch/library.h>

#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

void sgd_meta(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, at::TensorList master_params,
              const std::optional<at::Tensor>&, double, double momentum, double, double, bool, bool, bool, int64_t,
              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {
  TORCH_CHECK_VALUE(grads.size() == params.size(), arg_name("sgd_", "grads"), " has ", num(grads.size()),
                    " tensors but params has ", num(params.size()));
  const size_t buffers = momentum != 0 ? params.size() : 0;
  TORCH_CHECK_VALUE(momentum_buffers.size() == buffers, arg_name("sgd_", "momentum_buffers"), " has ",
                    num(momentum_buffers.size()), " tensors but ", num(buffers), " are needed (momentum ",
                    num(momentum), ")");
  TORCH_CHECK_VALUE(master_params.empty() || master_params.size() == params.size(), arg_name("sgd_", "master_params"),
                    " has ", num(master_params.size()), " tensors but params has ", num(params.size()));
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, Meta, m) { m.impl("sgd_", &sgd_meta); }

}  // namespace mixprec::detail
