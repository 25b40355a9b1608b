// mixprec::optim::FusedNovoGrad: NovoGrad (layer-wise second moments) in one fused
// mixprec::novograd_ pass per param group; the C++ twin of python/mixprec/optimizers/fused_novograd.py.
#pragma once

#include <map>
#include <utility>
#include <vector>

#include <mixprec/optim/fused_options.h>

namespace mixprec::optim {

#define MIXPREC_FUSED_NOVOGRAD_OWN_OPTIONS(X) \
  X(double, lr, 1e-3)                         \
  MIXPREC_FUSED_WEIGHT_OPTIONS(X)

// Apex's FusedNovoGrad defaults. norm_type 2, or 0 / infinity for the infinity norm.
struct MIXPREC_API FusedNovoGradOptions : public FusedOptionsFor<FusedNovoGradOptions, NovoGradArgs> {
  FusedNovoGradOptions(double lr = 1e-3) { this->lr(lr); }  // NOLINT
  MIXPREC_FUSED_OPTIONS_FIELDS(FusedNovoGradOptions, MIXPREC_NOVOGRAD_ARGS, MIXPREC_FUSED_NOVOGRAD_OWN_OPTIONS)
  void check(const std::string& where) const override;
  double op_norm_type() const;  // 2 or inf, as the op takes it
};
extern template class FusedOptionsFor<FusedNovoGradOptions, NovoGradArgs>;

// The float32 first moment (the second moments are per tensor: the group tensor exp_avg_sq).
#define MIXPREC_FUSED_NOVOGRAD_STATE(X) X(exp_avg)
MIXPREC_FUSED_PARAM_STATE(FusedNovoGradParamState, MIXPREC_FUSED_NOVOGRAD_STATE);

// Each group's per-tensor second moments live in one float32 vector, the group tensor
// "exp_avg_sq" (one entry per param of the group), as in the Python front.
class MIXPREC_API FusedNovoGrad : public FusedOptimizerOf<FusedNovoGradOptions, FusedNovoGradParamState> {
  MIXPREC_FUSED_OPTIMIZER_CLASS(FusedNovoGrad, FusedNovoGradOptions, = {})
  MIXPREC_FUSED_OPTIMIZER_STEP()

 public:
  // The second moments of group `group` (undefined before its first step).
  at::Tensor exp_avg_sq(size_t group) const { return group_tensor_or_none(group, "exp_avg_sq"); }

 protected:
  at::Tensor checked_group_tensor(const std::string& where, const std::string& key, const at::Tensor& value,
                                  const torch::optim::OptimizerParamGroup& group) const override;

 private:
  // Device index tensors of the positions with grads, for groups where only some params have one.
  std::map<std::pair<std::vector<int64_t>, std::string>, at::Tensor> index_cache_;
};

}  // namespace mixprec::optim
