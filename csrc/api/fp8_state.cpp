// mixprec::fp8 recipes and scaling state (include/mixprec/fp8.h): the recipe's checks, the state's
// device tensors and its checkpoints (the casts that update it are the fp8_linear op's).
#include <mixprec/fp8.h>

#include "ops/format.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace mixprec::fp8 {

namespace {
bool is_fp8(c10::ScalarType t) { return t == c10::kFloat8_e4m3fn || t == c10::kFloat8_e5m2; }
}  // namespace

double fp8_max(c10::ScalarType dtype) {
  MIXPREC_CHECK_VALUE(is_fp8(dtype), "mixprec::fp8::fp8_max: dtype must be Float8_e4m3fn or Float8_e5m2, got ", dtype);
  return dtype == c10::kFloat8_e4m3fn ? 448.0 : 57344.0;
}

Recipe Recipe::e4m3() { return Recipe().backward_dtype(c10::kFloat8_e4m3fn); }

void Recipe::check(const char* where) const {
  MIXPREC_CHECK_VALUE(is_fp8(forward_dtype()), where,
                      ": recipe forward_dtype must be Float8_e4m3fn or Float8_e5m2, got ", forward_dtype());
  MIXPREC_CHECK_VALUE(is_fp8(backward_dtype()), where,
                      ": recipe backward_dtype must be Float8_e4m3fn or Float8_e5m2, got ", backward_dtype());
  MIXPREC_CHECK_VALUE(scaling() == Scaling::kCurrent || scaling() == Scaling::kDelayed, where,
                      ": recipe scaling must be Scaling::kCurrent or Scaling::kDelayed");
  MIXPREC_CHECK_VALUE(amax_history_len() >= 1 && amax_history_len() <= 65536, where,
                      ": recipe amax_history_len must be in [1, 65536], got ",
                      mixprec::detail::num(amax_history_len()));
  MIXPREC_CHECK_VALUE(amax_reduction() == "max" || amax_reduction() == "most_recent", where,
                      ": recipe amax_reduction must be \"max\" or \"most_recent\", got \"", amax_reduction(), "\"");
  MIXPREC_CHECK_VALUE(std::isfinite(margin()) && margin() >= 0 && margin() <= 64, where,
                      ": recipe margin must be a number in [0, 64], got ", mixprec::detail::num(margin()));
}

ScalingState::ScalingState(Recipe recipe, c10::Device device) : recipe_(std::move(recipe)) {
  recipe_.check("mixprec::fp8::ScalingState");
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  scale = at::ones({3}, opts);
  amax = at::zeros({3}, opts);
  amax_history = at::zeros({3, recipe_.history_len()}, opts);
}

c10::ScalarType ScalingState::dtype_of(int64_t role) const {
  return role == kGradOutput ? recipe_.backward_dtype() : recipe_.forward_dtype();
}

void ScalingState::to(c10::Device device) {
  if (scale.device() == device) return;
  scale = scale.to(device);
  amax = amax.to(device);
  amax_history = amax_history.to(device);
}

void ScalingState::save(torch::serialize::OutputArchive& archive) const {
  archive.write("scale", scale, /*is_buffer=*/true);
  archive.write("amax", amax, /*is_buffer=*/true);
  archive.write("amax_history", amax_history, /*is_buffer=*/true);
}

namespace {
// The three tensors of `archive`, checked against `state`'s shapes and for finite positive scales.
std::vector<at::Tensor> checked(const ScalingState& state, torch::serialize::InputArchive& archive,
                                const std::string& where) {
  std::vector<at::Tensor> out;
  const std::pair<const char*, const at::Tensor*> slots[] = {
      {"scale", &state.scale}, {"amax", &state.amax}, {"amax_history", &state.amax_history}};
  for (const auto& [key, mine_ptr] : slots) {
    at::Tensor value;
    MIXPREC_CHECK_VALUE(archive.try_read(key, value, /*is_buffer=*/true), where, ": missing '", key, "'");
    const at::Tensor& mine = *mine_ptr;
    MIXPREC_CHECK_VALUE(value.defined() && value.is_floating_point() && value.sizes() == mine.sizes(), where, "['", key,
                        "']: expected a float tensor of shape ", mixprec::detail::shape(mine.sizes()),
                        " (recipe scaling ", state.recipe().scaling() == Scaling::kDelayed ? "delayed" : "current",
                        ", amax_history_len ", mixprec::detail::num(state.recipe().amax_history_len()), "), got ",
                        mixprec::detail::shape(value.defined() ? value.sizes() : c10::IntArrayRef{}), " ",
                        value.defined() ? value.scalar_type() : c10::kFloat);
    out.push_back(value);
  }
  const at::Tensor s = out[0].to(at::kDouble);
  MIXPREC_CHECK_VALUE(((s > 0) & s.isfinite()).all().item<bool>(), where,
                      "['scale']: every scale must be finite and > 0");
  return out;
}

void assign(ScalingState& state, const std::vector<at::Tensor>& values) {
  at::NoGradGuard no_grad;
  state.scale.copy_(values[0]);
  state.amax.copy_(values[1]);
  state.amax_history.copy_(values[2]);
}

std::vector<std::pair<std::string, LinearImpl*>> fp8_layers(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, LinearImpl*>> out;
  if (auto* self = dynamic_cast<LinearImpl*>(const_cast<torch::nn::Module*>(&model))) out.emplace_back("", self);
  for (const auto& kv : model.named_modules("", /*include_self=*/false))
    if (auto* layer = kv.value()->as<LinearImpl>()) out.emplace_back(kv.key(), layer);
  return out;
}
}  // namespace

void ScalingState::load(torch::serialize::InputArchive& archive) {
  assign(*this, checked(*this, archive, "mixprec::fp8::ScalingState::load"));
}

void save_state(const torch::nn::Module& model, torch::serialize::OutputArchive& archive) {
  for (const auto& [name, layer] : fp8_layers(model)) {
    torch::serialize::OutputArchive sub(archive.compilation_unit());
    layer->state.save(sub);
    archive.write(name.empty() ? "(model)" : name, sub);
  }
}

void load_state(torch::nn::Module& model, torch::serialize::InputArchive& archive) {
  const auto layers = fp8_layers(model);
  std::vector<std::vector<at::Tensor>> values;  // every entry checked before any is assigned
  for (const auto& [name, layer] : layers) {
    const std::string key = name.empty() ? "(model)" : name;
    torch::serialize::InputArchive sub;
    MIXPREC_CHECK_VALUE(archive.try_read(key, sub),
                        "mixprec::fp8::load_state: archive has no entry for the FP8 layer '", key, "'");
    values.push_back(checked(layer->state, sub, "mixprec::fp8::load_state: archive['" + key + "']"));
  }
  for (size_t i = 0; i < layers.size(); ++i) assign(layers[i].second->state, values[i]);
}

}  // namespace mixprec::fp8
