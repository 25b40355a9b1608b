// Meta registration of the fused LAMB op: it returns nothing, so torch.compile's fake tensors
// need no shapes from it; list lengths and the split step's norm shapes are checkable without data.
#include <torch/library.h>

#include "ops/lamb.h"

namespace mixprec::detail {
namespace {

void lamb_meta(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
               at::TensorList master_params, const std::optional<at::Tensor>&, double, double, double, double, double,
               bool, bool, bool, double, bool, int64_t, const std::optional<at::Tensor>&,
               const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
               const std::optional<at::Tensor>& local_norms, const std::optional<at::Tensor>& trust_norms) {
  lamb_check_shapes(params, grads, exp_avgs, exp_avg_sqs, master_params, local_norms, trust_norms);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, Meta, m) { m.impl("lamb_", &lamb_meta); }

}  // namespace mixprec::detail
