// FusedLAMB for LibTorch (include/mixprec/optim/fused_lamb.h): options, state, the global gradient
// norm over every group and the mixprec::lamb_ calls python/mixprec/optimizers/fused_lamb.py makes.
#include <mixprec/optim/fused_lamb.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "api/fused_options_impl.h"
#include "ops/device_copy.h"

namespace mixprec::optim {

using namespace mixprec::detail::api;

template class FusedOptionsFor<FusedLAMBOptions, LambArgs>;

void FusedLAMBOptions::check(const std::string& where) const {
  check_finite_nonneg(where, "learning rate", lr());
  check_finite_nonneg(where, "eps", eps());
  check_betas(where, betas());
  check_finite_nonneg(where, "weight_decay", weight_decay());
  MIXPREC_CHECK_VALUE(max_grad_norm() >= 0, where, ": invalid max_grad_norm ", detail::num(max_grad_norm()),
                      "; it must be >= 0 (0 or inf: no clipping)");
}

bool FusedLAMBOptions::clips() const { return max_grad_norm() > 0 && std::isfinite(max_grad_norm()); }

FusedLAMB::FusedLAMB(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedLAMBOptions defaults)
    : FusedOptimizerOf("FusedLAMB", param_groups, std::make_unique<FusedLAMBOptions>(defaults)) {
  finish_construction();
}

void FusedLAMB::init_param_state(const at::Tensor& p, const FusedOptions&, FusedParamState& state) {
  auto& s = static_cast<FusedLAMBParamState&>(state);
  if (!s.exp_avg().defined()) s.exp_avg(state_zeros(p));
  if (!s.exp_avg_sq().defined()) s.exp_avg_sq(state_zeros(p));
}

void FusedLAMB::begin_step() {
  // The unscaled L2 norm of all gradients of all groups, once per device in use, computed and
  // divided on the device (no host sync). Nothing when no group clips.
  grad_norms_.clear();
  bool any_clips = false;
  for (size_t i = 0; i < param_groups().size(); ++i) any_clips = any_clips || options_as(options_of(i)).clips();
  if (!any_clips) return;
  std::vector<std::pair<c10::Device, std::vector<at::Tensor>>> by_device;
  for (const auto& g : param_groups()) {
    for (const auto& p : g.params()) {
      if (!p.grad().defined()) continue;
      auto it = std::find_if(by_device.begin(), by_device.end(), [&](const auto& e) { return e.first == p.device(); });
      if (it == by_device.end()) {
        by_device.emplace_back(p.device(), std::vector<at::Tensor>{});
        it = by_device.end() - 1;
      }
      it->second.push_back(p.grad());
    }
  }
  if (by_device.empty()) return;
  const c10::Device first = by_device[0].first;
  at::Tensor total;
  if (by_device.size() == 1) {
    total = std::get<0>(mixprec::multi_tensor_norm(by_device[0].second)).reshape({1});
  } else {  // several devices: combine the squares on the first one
    std::vector<at::Tensor> norms;
    for (const auto& e : by_device)
      norms.push_back(detail::to_device(std::get<0>(mixprec::multi_tensor_norm(e.second)), first));
    total = at::stack(norms).square().sum().sqrt().reshape({1});
  }
  const GradScaling s = scaling_on(first);
  if (s.grad_scale) total = total / *s.grad_scale;
  // Blocking into the CPU: its kernels read the norm at once, and torch's non-blocking copy from a
  // GPU to the CPU goes into pinned memory still in flight.
  for (const auto& e : by_device)
    grad_norms_.emplace_back(e.first, e.first == first ? total : detail::to_device(total, e.first));
}

void FusedLAMB::end_step() noexcept { grad_norms_.clear(); }

void FusedLAMB::step_group(size_t, const GroupLists& l, const FusedOptions& options, const StepArgs& args) {
  const auto& o = options_as(options);
  std::optional<at::Tensor> global_grad_norm;
  if (o.clips()) {
    for (const auto& e : grad_norms_)
      if (e.first == l.params[0].device()) global_grad_norm = e.second;
    MIXPREC_CHECK(global_grad_norm.has_value(), name(), ": the global gradient norm is computed in step()");
  }
  mixprec::lamb_(l.params, l.grads, l.slot("exp_avg"), l.slot("exp_avg_sq"), l.masters, o.args(), args,
                 global_grad_norm);
}

}  // namespace mixprec::optim
