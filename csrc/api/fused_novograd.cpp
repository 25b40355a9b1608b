// FusedNovoGrad for LibTorch (include/mixprec/optim/fused_novograd.h): options, state, the group's
// second-moment vector and the mixprec::novograd_ call python/mixprec/optimizers/fused_novograd.py makes.
#include <mixprec/optim/fused_novograd.h>

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "api/fused_options_impl.h"

namespace mixprec::optim {

using namespace mixprec::detail::api;

namespace {
// Cached device index tensors for groups where only some params have grads.
constexpr size_t kMaxCachedIndices = 64;
}  // namespace

template class FusedOptionsFor<FusedNovoGradOptions, NovoGradArgs>;

void FusedNovoGradOptions::check(const std::string& where) const {
  check_finite_nonneg(where, "learning rate", lr());
  check_finite_nonneg(where, "eps", eps());
  check_betas(where, betas());
  check_finite_nonneg(where, "weight_decay", weight_decay());
  const double n = norm_type();
  MIXPREC_CHECK_VALUE(n == 2 || n == 0 || (std::isinf(n) && n > 0), where,
                      ": norm_type must be 2 (L2) or 0 (infinity norm; inf also works), got ", detail::num(n));
}

double FusedNovoGradOptions::op_norm_type() const {
  return norm_type() == 2 ? 2.0 : std::numeric_limits<double>::infinity();
}

FusedNovoGrad::FusedNovoGrad(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                             FusedNovoGradOptions defaults)
    : FusedOptimizerOf("FusedNovoGrad", param_groups, std::make_unique<FusedNovoGradOptions>(defaults)) {
  finish_construction();
}

void FusedNovoGrad::init_param_state(const at::Tensor& p, const FusedOptions&, FusedParamState& state) {
  auto& s = static_cast<FusedNovoGradParamState&>(state);
  if (!s.exp_avg().defined()) s.exp_avg(state_zeros(p));
}

void FusedNovoGrad::step_group(size_t index, const GroupLists& l, const FusedOptions& options, const StepArgs& args) {
  const auto& o = options_as(options);
  const std::vector<at::Tensor>& params = l.params;
  const auto& group_params = param_groups()[index].params();
  const at::Device device = params[0].device();
  // The group's norms, made or moved here and kept once the op has taken them (a check keeps
  // nothing, group tensors included).
  at::Tensor norms = group_tensor_or_none(index, "exp_avg_sq");
  const int64_t n = static_cast<int64_t>(group_params.size());
  const bool made = !norms.defined() || norms.device() != device;
  if (!norms.defined()) {
    norms = at::zeros({n}, at::TensorOptions().dtype(at::kFloat).device(device));
  } else if (norms.device() != device) {
    norms = norms.to(device);
  }
  MIXPREC_CHECK(norms.numel() == n, name(), ": param group ", detail::num(index), " exp_avg_sq has ",
                detail::num(norms.numel()), " entries for ", detail::num(n), " params");

  // Some params have no grad this step: the op sees the moments of the others, gathered and
  // scattered back on the device (a skipped step writes back what it read).
  at::Tensor idx, moments = norms;
  if (params.size() != group_params.size()) {
    std::vector<int64_t> positions;
    for (int64_t i = 0; i < n; ++i)
      if (group_params[i].grad().defined()) positions.push_back(i);
    auto key = std::make_pair(positions, device.str());
    auto it = index_cache_.find(key);
    if (it == index_cache_.end()) {
      if (index_cache_.size() >= kMaxCachedIndices) index_cache_.clear();
      at::Tensor host = at::tensor(positions, at::kLong);
      // A pinned source makes the copy asynchronous: no host sync even on a cache miss.
      if (device.is_cuda()) host = host.pin_memory();
      it = index_cache_.emplace(key, host.to(device, /*non_blocking=*/true)).first;
    }
    idx = it->second;
    moments = norms.index_select(0, idx);
  }
  NovoGradArgs a = o.args();
  a.norm_type = o.op_norm_type();
  mixprec::novograd_(params, l.grads, l.slot("exp_avg"), moments, l.masters, a, args);
  if (args.validate_only) return;
  if (idx.defined()) norms.index_copy_(0, idx, moments);
  if (made) group_tensor(index, "exp_avg_sq") = norms;
}

at::Tensor FusedNovoGrad::checked_group_tensor(const std::string& where, const std::string& key,
                                               const at::Tensor& value,
                                               const torch::optim::OptimizerParamGroup& group) const {
  MIXPREC_CHECK_VALUE(key == "exp_avg_sq", where, " is not a group tensor ", name(), " knows");
  MIXPREC_CHECK_TYPE(value.is_floating_point(), where, " must be a floating-point tensor, got ", value.scalar_type());
  const int64_t n = static_cast<int64_t>(group.params().size());
  MIXPREC_CHECK_VALUE(value.dim() == 1 && value.numel() == n, where, " has shape ", detail::shape(value.sizes()),
                      "; expected [", detail::num(n), "] (one per param)");
  return value.to(at::kFloat).contiguous();
}

}  // namespace mixprec::optim
