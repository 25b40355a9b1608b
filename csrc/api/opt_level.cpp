// mixprec::amp::initialize (include/mixprec/amp.h): Apex's opt levels O0-O3 for a torch::nn::Module
// and its optimizer, with the rules of python/mixprec/amp/_properties.py and _initialize.py.
#include <mixprec/amp.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/utils.h>

#include <unordered_set>

#include <mixprec/optim/fused_optimizer.h>

#include "ops/format.h"  // MIXPREC_CHECK*

namespace mixprec::amp {

namespace {
constexpr const char* kName = "mixprec::amp::initialize";

bool is_low(c10::ScalarType t) { return t == c10::kHalf || t == c10::kBFloat16; }

// Affine BatchNorm, as Apex keeps in fp32 (its running statistics stay fp32 with it).
bool is_affine_batchnorm(const torch::nn::Module& m) {
  if (const auto* b = dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m)) return b->options.affine();
  if (const auto* b = dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m)) return b->options.affine();
  if (const auto* b = dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m)) return b->options.affine();
  return false;
}

// The level's properties with the user's overrides, checked as Apex checks them.
AmpState resolve(const AmpOptions& o) {
  MIXPREC_CHECK_VALUE(is_low(o.dtype()), kName, ": dtype must be float16 or bfloat16, got ", o.dtype());
  AmpState s;
  s.opt_level = o.opt_level();
  s.dtype = o.dtype();
  const bool fp16 = o.dtype() == c10::kHalf;
  switch (o.opt_level()) {
    case OptLevel::O0:
      s.cast_model_type = c10::kFloat;
      break;
    case OptLevel::O1:
      s.autocast = true;
      s.dynamic_loss_scale = fp16;
      break;
    case OptLevel::O2:
      s.cast_model_type = o.dtype();
      s.keep_batchnorm_fp32 = true;
      s.master_weights = true;
      s.dynamic_loss_scale = fp16;
      break;
    case OptLevel::O3:
      s.cast_model_type = o.dtype();
      break;
  }
  const bool o1 = o.opt_level() == OptLevel::O1;
  if (o.keep_batchnorm_fp32()) {
    MIXPREC_CHECK_VALUE(!o1, kName,
                        ": with O1 BatchNorm runs in fp32 under autocast anyway; leave keep_batchnorm_fp32 unset");
    s.keep_batchnorm_fp32 = *o.keep_batchnorm_fp32();
  }
  if (o.master_weights()) {
    MIXPREC_CHECK_VALUE(!o1, kName, ": master weights make no sense with O1, whose model weights stay fp32");
    s.master_weights = *o.master_weights();
  }
  if (o.dynamic_loss_scale()) s.dynamic_loss_scale = *o.dynamic_loss_scale();
  MIXPREC_CHECK_VALUE(!s.master_weights || (s.cast_model_type && is_low(*s.cast_model_type)), kName,
                      ": master weights need a model cast to float16 or bfloat16 (O2, or O3 with master_weights)");
  if (o.fp8()) {
    MIXPREC_CHECK_VALUE(s.cast_model_type && is_low(*s.cast_model_type), kName,
                        ": fp8 needs a model cast to float16 or bfloat16 (opt_level O2 or O3); opt_level ",
                        to_string(s.opt_level), " does not cast it");
    o.fp8()->check(kName);
  }
  return s;
}

AmpState initialize_impl(torch::nn::Module& model, torch::optim::Optimizer* optimizer, const AmpOptions& options) {
  const AmpState s = resolve(options);
  for (const auto& kv : model.named_parameters()) {
    const std::string& name = kv.key();
    MIXPREC_CHECK_VALUE(!kv.value().is_floating_point() || kv.value().scalar_type() == c10::kFloat, kName,
                        ": parameter '", name, "' is ", kv.value().scalar_type(),
                        "; pass the model in fp32 (initialize casts it for the level)");
  }

  auto* fused = dynamic_cast<optim::FusedOptimizer*>(optimizer);
  const bool cast = s.cast_model_type && is_low(*s.cast_model_type);
  if (optimizer != nullptr && s.master_weights)
    MIXPREC_CHECK_VALUE(
        fused != nullptr, kName, ": ", to_string(s.opt_level),
        "'s fp32 master weights need a mixprec::optim fused optimizer (FusedAdam, FusedAdamW, FusedSGD, "
        "FusedLAMB, FusedAdagrad or FusedNovoGrad); a torch::optim optimizer would update the ",
        s.dtype, " weights directly");
  if (optimizer != nullptr && cast && fused == nullptr)
    MIXPREC_CHECK_VALUE(optimizer->state().empty(), kName,
                        ": the optimizer already has state; call initialize before the first step");

  // The modules whose own parameters and buffers are cast (the root may not be owned by a
  // shared_ptr, so it is listed by hand before its descendants).
  std::vector<std::pair<std::string, torch::nn::Module*>> modules{{"", &model}};
  for (const auto& kv : model.named_modules("", /*include_self=*/false))
    modules.emplace_back(kv.key(), kv.value().get());
  std::vector<torch::nn::Module*> to_cast;
  for (const auto& m : modules) {
    const bool keep = (s.keep_batchnorm_fp32 && is_affine_batchnorm(*m.second)) ||
                      (options.keep_fp32() && options.keep_fp32()(m.first, *m.second));
    if (!keep) to_cast.push_back(m.second);
  }

  torch::NoGradGuard no_grad;
  if (fused != nullptr && s.master_weights) {
    // The fp32 values before the cast become the masters, exact rather than rounded through the
    // low dtype and back.
    std::unordered_set<const void*> in_optimizer;
    for (const auto& g : fused->param_groups())
      for (const auto& p : g.params()) in_optimizer.insert(p.unsafeGetTensorImpl());
    for (auto* m : to_cast)
      for (const auto& kv : m->named_parameters(/*recurse=*/false))
        if (kv.value().is_floating_point() && in_optimizer.count(kv.value().unsafeGetTensorImpl()))
          fused->set_master(kv.value(), kv.value().detach());
    fused->set_master_weights(true);
  }
  if (cast) {
    const c10::ScalarType to = *s.cast_model_type;
    for (auto* m : to_cast) {
      // set_data keeps each tensor's identity, so the optimizer still holds the same params.
      for (auto& kv : m->named_parameters(/*recurse=*/false)) {
        at::Tensor& p = kv.value();
        if (!p.is_floating_point()) continue;
        p.set_data(p.detach().to(to));
        if (p.grad().defined() && p.grad().is_floating_point()) p.mutable_grad() = p.grad().detach().to(to);
      }
      for (auto& kv : m->named_buffers(/*recurse=*/false)) {
        at::Tensor& b = kv.value();
        if (b.defined() && b.is_floating_point()) b.set_data(b.detach().to(to));
      }
    }
  }
  AmpState out = s;
  if (options.fp8()) out.fp8 = fp8::convert(model, *options.fp8());  // the same parameter tensors: masters hold
  return out;
}
}  // namespace

const char* to_string(OptLevel level) {
  switch (level) {
    case OptLevel::O0:
      return "O0";
    case OptLevel::O1:
      return "O1";
    case OptLevel::O2:
      return "O2";
    case OptLevel::O3:
      return "O3";
  }
  return "?";
}

GradScalerOptions AmpState::scaler_options() const { return GradScalerOptions().enabled(dynamic_loss_scale); }

AutocastGuard AmpState::autocast_guard(c10::DeviceType device_type) const {
  return AutocastGuard(device_type, dtype, autocast);
}

at::Tensor AmpState::cast_input(const at::Tensor& input) const {
  if (cast_model_type && is_low(*cast_model_type) && input.is_floating_point()) return input.to(*cast_model_type);
  return input;
}

AmpState initialize(torch::nn::Module& model, torch::optim::Optimizer& optimizer, const AmpOptions& options) {
  return initialize_impl(model, &optimizer, options);
}

AmpState initialize(torch::nn::Module& model, const AmpOptions& options) {
  return initialize_impl(model, nullptr, options);
}

}  // namespace mixprec::amp
