// mixprec::fp8::linear and fp8::Linear (include/mixprec/fp8.h): a Linear on the fp8_linear op (the
// one python's Fp8Linear calls), with the fallback for shapes FP8 cannot take, and convert().
#include <mixprec/fp8.h>

#include "ops/format.h"
#include "ops/front_rules.h"  // the eligibility rule, python's Fp8Linear's too (fp8_linear_ineligibility op)

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <mixprec/ops.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <cmath>

namespace mixprec::fp8 {

static_assert(kAlign == detail::kFp8Align, "fp8.h's kAlign is the rule's alignment");

at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                     c10::ScalarType out_dtype, const at::Tensor& bias, std::optional<bool> emulate) {
  return mixprec::fp8_scaled_mm(a, b, scale_a, scale_b, out_dtype,
                                bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, emulate);
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias, ScalingState& state) {
  MIXPREC_CHECK_VALUE(input.defined() && weight.defined() && weight.dim() == 2,
                      "mixprec::fp8::linear: expected a defined "
                      "input and a 2-D weight, got weight of ",
                      mixprec::detail::num(weight.defined() ? weight.dim() : int64_t{-1}), " dims");
  if (!detail::fp8_linear_ineligibility(weight, &input).empty()) {
    ++state.fallbacks;
    return torch::nn::functional::linear(input, weight, bias);
  }
  state.to(input.device());
  const Recipe& r = state.recipe();
  // The op (csrc/ops/fp8_linear.cpp) casts, updates the state and runs the GEMMs, as for python.
  return mixprec::fp8_linear(input, weight, bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt,
                             state.scale, state.amax, state.amax_history, r.forward_dtype(), r.backward_dtype(),
                             r.scaling() == Scaling::kDelayed, r.margin(), r.amax_reduction());
}

std::optional<std::string> ineligibility(const torch::nn::Module& module) {
  const auto* l = dynamic_cast<const torch::nn::LinearImpl*>(&module);
  if (l == nullptr) return module.name() + " is not a torch::nn::Linear";
  std::string why = detail::fp8_linear_ineligibility(l->weight);
  if (why.empty()) return std::nullopt;
  return why;
}

LinearImpl::LinearImpl(const torch::nn::LinearOptions& options_, Recipe recipe)
    : options(options_), state(std::move(recipe)) {
  reset();
}

LinearImpl::LinearImpl(const torch::nn::LinearImpl& linear, Recipe recipe)
    : options(linear.options), state(std::move(recipe), linear.weight.device()) {
  const auto why = ineligibility(linear);
  MIXPREC_CHECK_VALUE(!why, "mixprec::fp8::Linear: linear is not eligible for FP8: ", why.value_or(""));
  weight = register_parameter("weight", linear.weight, linear.weight.requires_grad());
  bias = register_parameter("bias", linear.bias, linear.bias.defined() && linear.bias.requires_grad());
}

void LinearImpl::reset() {
  weight = register_parameter("weight", torch::empty({options.out_features(), options.in_features()}));
  bias = register_parameter("bias", options.bias() ? torch::empty(options.out_features()) : at::Tensor(),
                            /*requires_grad=*/options.bias());
  reset_parameters();
}

void LinearImpl::reset_parameters() {
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5));
  if (bias.defined()) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(weight.size(1)));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

at::Tensor LinearImpl::forward(const at::Tensor& input) { return fp8::linear(input, weight, bias, state); }

ConvertResult convert(torch::nn::Module& model, const Recipe& recipe) {
  recipe.check("mixprec::fp8::convert");
  ConvertResult result;
  // Every Sequential (the model or nested) is listed first; the rest of the Linears are members.
  std::vector<std::pair<std::string, torch::nn::SequentialImpl*>> sequentials;
  if (auto* self = dynamic_cast<torch::nn::SequentialImpl*>(&model)) sequentials.emplace_back("", self);
  std::vector<std::string> in_sequential;
  for (const auto& kv : model.named_modules("", /*include_self=*/false)) {
    if (auto* seq = kv.value()->as<torch::nn::SequentialImpl>()) sequentials.emplace_back(kv.key(), seq);
  }
  for (const auto& [prefix, seq] : sequentials) {
    const auto children = seq->named_children();
    size_t i = 0;
    for (auto& any : *seq) {
      const std::string& child = children[i++].key();
      const std::string name = prefix.empty() ? child : prefix + "." + child;
      const auto* linear = any.ptr()->as<torch::nn::LinearImpl>();
      if (linear == nullptr) continue;
      in_sequential.push_back(name);
      if (const auto why = ineligibility(*linear)) {
        result.skipped.emplace_back(name, *why);
        continue;
      }
      auto fp8_linear = std::make_shared<LinearImpl>(*linear, recipe);
      // Both the Sequential's call list and its registry of children, so named_parameters() and
      // save() see the same module forward() runs.
      any = torch::nn::AnyModule(fp8_linear);
      seq->replace_module(child, fp8_linear);
      result.converted.push_back(name);
    }
  }
  for (const auto& kv : model.named_modules("", /*include_self=*/false)) {
    if (kv.value()->as<torch::nn::LinearImpl>() == nullptr) continue;
    if (std::find(in_sequential.begin(), in_sequential.end(), kv.key()) != in_sequential.end()) continue;
    result.skipped.emplace_back(kv.key(),
                                "held as a member, which LibTorch calls directly: build it as mixprec::fp8::Linear");
  }
  return result;
}

}  // namespace mixprec::fp8
