// FusedNovoGrad for LibTorch (include/mixprec/optim/fused_novograd.h): options, state, the group's
// second-moment vector and the mixprec::novograd_ call python/mixprec/optimizers/fused_novograd.py makes.
#include <mixprec/optim/fused_novograd.h>

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "api/api_util.h"

namespace mixprec::optim {

using namespace mixprec::detail::api;

namespace {
// Cached device index tensors for groups where only some params have grads.
constexpr size_t kMaxCachedIndices = 64;
}  // namespace

FusedNovoGradOptions::FusedNovoGradOptions(double lr) : lr_(lr) {}

std::unique_ptr<torch::optim::OptimizerOptions> FusedNovoGradOptions::clone() const {
  return std::make_unique<FusedNovoGradOptions>(*this);
}

void FusedNovoGradOptions::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr_));
  write_betas(archive, betas_);
  archive.write("eps", c10::IValue(eps_));
  archive.write("weight_decay", c10::IValue(weight_decay_));
  archive.write("bias_correction", c10::IValue(bias_correction_));
  archive.write("grad_averaging", c10::IValue(grad_averaging_));
  archive.write("reg_inside_moment", c10::IValue(reg_inside_moment_));
  archive.write("norm_type", c10::IValue(norm_type_));
  archive.write("init_zero", c10::IValue(init_zero_));
  archive.write("master_weights", c10::IValue(master_weights_));
}

void FusedNovoGradOptions::serialize(torch::serialize::InputArchive& archive) {
  const std::string w = "FusedNovoGradOptions";
  lr_ = read_double(archive, "lr", w);
  betas_ = read_betas(archive, w);
  eps_ = read_double(archive, "eps", w);
  weight_decay_ = read_double(archive, "weight_decay", w);
  bias_correction_ = read_bool(archive, "bias_correction", w);
  grad_averaging_ = read_bool(archive, "grad_averaging", w);
  reg_inside_moment_ = read_bool(archive, "reg_inside_moment", w);
  norm_type_ = read_double(archive, "norm_type", w);
  init_zero_ = read_bool(archive, "init_zero", w);
  master_weights_ = read_bool(archive, "master_weights", w);
}

void FusedNovoGradOptions::inherit_unset(const FusedOptions& defaults, const FusedOptions& fresh_options) {
  const auto& d = static_cast<const FusedNovoGradOptions&>(defaults);
  const auto& fresh = static_cast<const FusedNovoGradOptions&>(fresh_options);
  MIXPREC_INHERIT_UNSET(lr);
  MIXPREC_INHERIT_UNSET(betas);
  MIXPREC_INHERIT_UNSET(eps);
  MIXPREC_INHERIT_UNSET(weight_decay);
  MIXPREC_INHERIT_UNSET(bias_correction);
  MIXPREC_INHERIT_UNSET(grad_averaging);
  MIXPREC_INHERIT_UNSET(reg_inside_moment);
  MIXPREC_INHERIT_UNSET(norm_type);
  MIXPREC_INHERIT_UNSET(init_zero);
  MIXPREC_INHERIT_UNSET(master_weights);
}

void FusedNovoGradOptions::check(const std::string& where) const {
  check_finite_nonneg(where, "learning rate", lr_);
  check_finite_nonneg(where, "eps", eps_);
  check_betas(where, betas_);
  check_finite_nonneg(where, "weight_decay", weight_decay_);
  TORCH_CHECK_VALUE(norm_type_ == 2 || norm_type_ == 0 || (std::isinf(norm_type_) && norm_type_ > 0), where,
                    ": norm_type must be 2 (L2) or 0 (infinity norm; inf also works), got ",
                    detail::num(norm_type_));
}

double FusedNovoGradOptions::op_norm_type() const {
  return norm_type_ == 2 ? 2.0 : std::numeric_limits<double>::infinity();
}

std::vector<FusedParamState::Slot> FusedNovoGradParamState::slots() {
  return {{"master_param", &master_param()}, {"exp_avg", &exp_avg_}};
}

FusedNovoGrad::FusedNovoGrad(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                             FusedNovoGradOptions defaults)
    : FusedOptimizer("FusedNovoGrad", param_groups, std::make_unique<FusedNovoGradOptions>(defaults)) {
  finish_construction();
}

FusedNovoGrad::FusedNovoGrad(std::vector<at::Tensor> params, FusedNovoGradOptions defaults)
    : FusedNovoGrad({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

std::unique_ptr<FusedParamState> FusedNovoGrad::make_state() const {
  return std::make_unique<FusedNovoGradParamState>();
}

std::unique_ptr<FusedOptions> FusedNovoGrad::make_options() const { return std::make_unique<FusedNovoGradOptions>(); }

const FusedOptions* FusedNovoGrad::cast_options(const torch::optim::OptimizerOptions& o) const {
  return dynamic_cast<const FusedNovoGradOptions*>(&o);
}

void FusedNovoGrad::init_param_state(const at::Tensor& p, const FusedOptions&, FusedParamState& state) {
  auto& s = static_cast<FusedNovoGradParamState&>(state);
  if (!s.exp_avg().defined())
    s.exp_avg(at::zeros_like(p, at::TensorOptions().dtype(at::kFloat), at::MemoryFormat::Contiguous));
}

void FusedNovoGrad::step_group(size_t index, const std::vector<at::Tensor>& params, const FusedOptions& options,
                               const StepArgs& args) {
  const auto& o = static_cast<const FusedNovoGradOptions&>(options);
  const auto& group_params = param_groups()[index].params();
  const at::Device device = params[0].device();
  at::Tensor& norms = group_tensor(index, "exp_avg_sq");
  const int64_t n = static_cast<int64_t>(group_params.size());
  if (!norms.defined()) {
    norms = at::zeros({n}, at::TensorOptions().dtype(at::kFloat).device(device));
  } else if (norms.device() != device) {
    norms = norms.to(device);
  }
  TORCH_CHECK(norms.numel() == n, name(), ": param group ", detail::num(index), " exp_avg_sq has ",
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
  std::vector<at::Tensor> grads, exp_avgs;
  for (const auto& p : params) {
    grads.push_back(p.grad());
    exp_avgs.push_back(state_as<FusedNovoGradParamState>(p).exp_avg());
  }
  NovoGradArgs a;
  a.beta1 = std::get<0>(o.betas());
  a.beta2 = std::get<1>(o.betas());
  a.eps = o.eps();
  a.weight_decay = o.weight_decay();
  a.norm_type = o.op_norm_type();
  a.bias_correction = o.bias_correction();
  a.grad_averaging = o.grad_averaging();
  a.reg_inside_moment = o.reg_inside_moment();
  a.init_zero = o.init_zero();
  mixprec::novograd_(params, grads, exp_avgs, moments, masters(params, options), a, args);
  if (idx.defined()) norms.index_copy_(0, idx, moments);
}

at::Tensor FusedNovoGrad::checked_group_tensor(const std::string& where, const std::string& key,
                                               const at::Tensor& value,
                                               const torch::optim::OptimizerParamGroup& group) const {
  TORCH_CHECK_VALUE(key == "exp_avg_sq", where, " is not a group tensor ", name(), " knows");
  TORCH_CHECK_TYPE(value.is_floating_point(), where, " must be a floating-point tensor, got ", value.scalar_type());
  const int64_t n = static_cast<int64_t>(group.params().size());
  TORCH_CHECK_VALUE(value.dim() == 1 && value.numel() == n, where, " has shape ", detail::shape(value.sizes()),
                    "; expected [", detail::num(n), "] (one per param)");
  return value.to(at::kFloat).contiguous();
}

}  // namespace mixprec::optim
