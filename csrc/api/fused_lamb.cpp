// FusedLAMB for LibTorch (include/mixprec/optim/fused_lamb.h): options, state, the global gradient
// norm over every group and the mixprec::lamb_ calls python/mixprec/optimizers/fused_lamb.py makes.
#include <mixprec/optim/fused_lamb.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "api/api_util.h"

namespace mixprec::optim {

using namespace mixprec::detail::api;

FusedLAMBOptions::FusedLAMBOptions(double lr) : lr_(lr) {}

std::unique_ptr<torch::optim::OptimizerOptions> FusedLAMBOptions::clone() const {
  return std::make_unique<FusedLAMBOptions>(*this);
}

void FusedLAMBOptions::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr_));
  write_betas(archive, betas_);
  archive.write("eps", c10::IValue(eps_));
  archive.write("weight_decay", c10::IValue(weight_decay_));
  archive.write("bias_correction", c10::IValue(bias_correction_));
  archive.write("grad_averaging", c10::IValue(grad_averaging_));
  archive.write("adam_w_mode", c10::IValue(adam_w_mode_));
  archive.write("max_grad_norm", c10::IValue(max_grad_norm_));
  archive.write("use_nvlamb", c10::IValue(use_nvlamb_));
  archive.write("master_weights", c10::IValue(master_weights_));
}

void FusedLAMBOptions::serialize(torch::serialize::InputArchive& archive) {
  const std::string w = "FusedLAMBOptions";
  lr_ = read_double(archive, "lr", w);
  betas_ = read_betas(archive, w);
  eps_ = read_double(archive, "eps", w);
  weight_decay_ = read_double(archive, "weight_decay", w);
  bias_correction_ = read_bool(archive, "bias_correction", w);
  grad_averaging_ = read_bool(archive, "grad_averaging", w);
  adam_w_mode_ = read_bool(archive, "adam_w_mode", w);
  max_grad_norm_ = read_double(archive, "max_grad_norm", w);
  use_nvlamb_ = read_bool(archive, "use_nvlamb", w);
  master_weights_ = read_bool(archive, "master_weights", w);
}

void FusedLAMBOptions::inherit_unset(const FusedOptions& defaults, const FusedOptions& fresh_options) {
  const auto& d = static_cast<const FusedLAMBOptions&>(defaults);
  const auto& fresh = static_cast<const FusedLAMBOptions&>(fresh_options);
  MIXPREC_INHERIT_UNSET(lr);
  MIXPREC_INHERIT_UNSET(betas);
  MIXPREC_INHERIT_UNSET(eps);
  MIXPREC_INHERIT_UNSET(weight_decay);
  MIXPREC_INHERIT_UNSET(bias_correction);
  MIXPREC_INHERIT_UNSET(grad_averaging);
  MIXPREC_INHERIT_UNSET(adam_w_mode);
  MIXPREC_INHERIT_UNSET(max_grad_norm);
  MIXPREC_INHERIT_UNSET(use_nvlamb);
  MIXPREC_INHERIT_UNSET(master_weights);
}

void FusedLAMBOptions::check(const std::string& where) const {
  check_finite_nonneg(where, "learning rate", lr_);
  check_finite_nonneg(where, "eps", eps_);
  check_betas(where, betas_);
  check_finite_nonneg(where, "weight_decay", weight_decay_);
  TORCH_CHECK_VALUE(max_grad_norm_ >= 0, where, ": invalid max_grad_norm ", detail::num(max_grad_norm_),
                    "; it must be >= 0 (0 or inf: no clipping)");
}

bool FusedLAMBOptions::clips() const { return max_grad_norm_ > 0 && std::isfinite(max_grad_norm_); }

std::vector<FusedParamState::Slot> FusedLAMBParamState::slots() {
  return {{"master_param", &master_param()}, {"exp_avg", &exp_avg_}, {"exp_avg_sq", &exp_avg_sq_}};
}

FusedLAMB::FusedLAMB(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, FusedLAMBOptions defaults)
    : FusedOptimizer("FusedLAMB", param_groups, std::make_unique<FusedLAMBOptions>(defaults)) {
  finish_construction();
}

FusedLAMB::FusedLAMB(std::vector<at::Tensor> params, FusedLAMBOptions defaults)
    : FusedLAMB({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

std::unique_ptr<FusedParamState> FusedLAMB::make_state() const { return std::make_unique<FusedLAMBParamState>(); }

std::unique_ptr<FusedOptions> FusedLAMB::make_options() const { return std::make_unique<FusedLAMBOptions>(); }

const FusedOptions* FusedLAMB::cast_options(const torch::optim::OptimizerOptions& o) const {
  return dynamic_cast<const FusedLAMBOptions*>(&o);
}

void FusedLAMB::init_param_state(const at::Tensor& p, const FusedOptions&, FusedParamState& state) {
  auto& s = static_cast<FusedLAMBParamState&>(state);
  const auto zeros = [&] {
    return at::zeros_like(p, at::TensorOptions().dtype(at::kFloat), at::MemoryFormat::Contiguous);
  };
  if (!s.exp_avg().defined()) s.exp_avg(zeros());
  if (!s.exp_avg_sq().defined()) s.exp_avg_sq(zeros());
}

void FusedLAMB::begin_step() {
  // The unscaled L2 norm of all gradients of all groups, once per device in use, computed and
  // divided on the device (no host sync). Nothing when no group clips.
  grad_norms_.clear();
  bool any_clips = false;
  for (size_t i = 0; i < param_groups().size(); ++i)
    any_clips = any_clips || static_cast<const FusedLAMBOptions&>(options_of(i)).clips();
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
      norms.push_back(std::get<0>(mixprec::multi_tensor_norm(e.second)).to(first, /*non_blocking=*/true));
    total = at::stack(norms).square().sum().sqrt().reshape({1});
  }
  const GradScaling s = scaling_on(first);
  if (s.grad_scale) total = total / *s.grad_scale;
  for (const auto& e : by_device)
    grad_norms_.emplace_back(e.first, e.first == first ? total : total.to(e.first, /*non_blocking=*/true));
}

void FusedLAMB::end_step() noexcept { grad_norms_.clear(); }

void FusedLAMB::step_group(size_t index, const std::vector<at::Tensor>& params, const FusedOptions& options,
                           const StepArgs& args) {
  const auto& o = static_cast<const FusedLAMBOptions&>(options);
  std::optional<at::Tensor> global_grad_norm;
  if (o.clips()) {
    for (const auto& e : grad_norms_)
      if (e.first == params[0].device()) global_grad_norm = e.second;
    TORCH_CHECK(global_grad_norm.has_value(), name(), ": the global gradient norm is computed in step()");
  }
  std::vector<at::Tensor> grads, exp_avgs, exp_avg_sqs;
  for (const auto& p : params) {
    auto& s = state_as<FusedLAMBParamState>(p);
    grads.push_back(p.grad());
    exp_avgs.push_back(s.exp_avg());
    exp_avg_sqs.push_back(s.exp_avg_sq());
  }
  LambArgs a;
  a.beta1 = std::get<0>(o.betas());
  a.beta2 = std::get<1>(o.betas());
  a.eps = o.eps();
  a.weight_decay = o.weight_decay();
  a.max_grad_norm = o.max_grad_norm();
  a.bias_correction = o.bias_correction();
  a.grad_averaging = o.grad_averaging();
  a.adam_w_mode = o.adam_w_mode();
  a.use_nvlamb = o.use_nvlamb();
  mixprec::lamb_(params, grads, exp_avgs, exp_avg_sqs, masters(params, options), a, args, global_grad_norm);
}

}  // namespace mixprec::optim
