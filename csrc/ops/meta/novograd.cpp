// Meta registration of the fused NovoGrad op: it returns nothing, so torch.compile's fake
// tensors need no shapes from it; list lengths and exp_avg_sq_norms' shape are checkable without data.
#include <torch/library.h>

#include "ops/novograd.h"

namespace mixprec::detail {
namespace {

void novograd_meta(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, const at::Tensor& exp_avg_sq_norms,
                   at::TensorList master_params, const std::optional<at::Tensor>&, double, double, double, double, double,
                   bool, bool, bool, double, bool, int64_t, const std::optional<at::Tensor>&,
                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                   const std::optional<at::Tensor>& grad_norms) {
  novograd_check_shapes(params, grads, exp_avgs, exp_avg_sq_norms, master_params, grad_norms);
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, Meta, m) { m.impl("novograd_", &novograd_meta); }

}  // namespace mixprec::detail
