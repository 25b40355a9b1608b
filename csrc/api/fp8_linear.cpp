// mixprec::fp8::linear and fp8::Linear (include/mixprec/fp8.h): the three GEMMs of a Linear on FP8
// operands, as python/mixprec/fp8/linear.py runs them, and convert() for a LibTorch model.
#include <mixprec/fp8.h>

#include "ops/format.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <cmath>

namespace mixprec::fp8 {

namespace {
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool is_float(c10::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// y = x W^T + b with x, W in the forward FP8 dtype and dy in the backward one. What backward keeps
// is FP8 (x^T and W^T, in the column-major layout the gradient GEMMs read) plus two scalars. The
// state is reached through its grad row's tensors (views: the cast updates the state in place),
// not a pointer, so a module destroyed before backward leaves nothing dangling.
class Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x2, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias_opt, ScalingState* state, bool need_dgrad,
                            bool need_wgrad) {
    // Optional, not an undefined tensor: autograd's Function wants a device for every tensor input.
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    auto [xq, xq_t, x_inv] = state->quantize(x2, kInput, need_wgrad);
    auto [wq, wq_t, w_inv] = state->quantize(weight.contiguous(), kWeight, need_dgrad);
    at::Tensor y = scaled_mm(xq, wq.t(), x_inv, w_inv, x2.scalar_type(), bias);
    const Recipe& r = state->recipe();
    ctx->saved_data["row"] =
        c10::List<at::Tensor>({state->scale.narrow(0, kGradOutput, 1), state->amax.narrow(0, kGradOutput, 1),
                               state->amax_history.select(0, kGradOutput)});
    ctx->saved_data["recipe"] =
        c10::List<int64_t>({static_cast<int64_t>(r.backward_dtype()), static_cast<int64_t>(r.scaling())});
    ctx->saved_data["margin"] = r.margin();
    ctx->saved_data["reduction"] = r.amax_reduction();
    ctx->saved_data["dtypes"] =
        c10::List<int64_t>({static_cast<int64_t>(x2.scalar_type()), static_cast<int64_t>(weight.scalar_type())});
    ctx->saved_data["flags"] = c10::List<bool>({need_dgrad, need_wgrad, bias.defined() && bias.requires_grad()});
    ctx->save_for_backward({xq_t, wq_t, x_inv, w_inv});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &xq_t = saved[0], &wq_t = saved[1], &x_inv = saved[2], &w_inv = saved[3];
    const auto flags = ctx->saved_data["flags"].toBoolList();
    const auto dtypes = ctx->saved_data["dtypes"].toIntList();
    const bool need_dgrad = flags[0], need_wgrad = flags[1], need_bgrad = flags[2];
    const at::Tensor dy = grads[0].contiguous();
    at::Tensor dx, dw, db;
    if (need_dgrad || need_wgrad) {
      const auto row = ctx->saved_data["row"].toTensorList();
      const auto recipe = ctx->saved_data["recipe"].toIntList();
      auto [gq, gq_t, g_inv] = detail::quantize_row(
          dy, row[0], row[1], row[2], static_cast<c10::ScalarType>(recipe[0]), static_cast<Scaling>(recipe[1]),
          ctx->saved_data["margin"].toDouble(), ctx->saved_data["reduction"].toStringRef(), need_wgrad);
      if (need_dgrad) dx = scaled_mm(gq, wq_t.t(), g_inv, w_inv, static_cast<c10::ScalarType>(dtypes[0]));
      if (need_wgrad) dw = scaled_mm(gq_t, xq_t.t(), g_inv, x_inv, static_cast<c10::ScalarType>(dtypes[1]));
    }
    // The unquantized gradient: a sum needs no FP8.
    if (need_bgrad) db = dy.to(at::kFloat).sum(0).to(static_cast<c10::ScalarType>(dtypes[1]));
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                     c10::ScalarType out_dtype, const at::Tensor& bias, std::optional<bool> emulate) {
  if (!emulate.value_or(!a.is_cuda())) {
    const bool fuse_bias = bias.defined() && bias.scalar_type() == out_dtype && out_dtype != at::kFloat;
    at::Tensor y = at::_scaled_mm(a, b, scale_a.reshape({}), scale_b.reshape({}),
                                  fuse_bias ? std::optional<at::Tensor>(bias) : std::nullopt, std::nullopt, out_dtype);
    if (bias.defined() && !fuse_bias) y = (y.to(at::kFloat) + bias.to(at::kFloat)).to(out_dtype);
    return y;
  }
  // FP8 values widen exactly to fp32; one fp32 product and one rounding, as the tensor cores.
  at::Tensor y = at::mm(a.to(at::kFloat), b.to(at::kFloat)).mul_(scale_a * scale_b);
  if (bias.defined()) y.add_(bias.to(at::kFloat));
  return y.to(out_dtype);
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias, ScalingState& state) {
  MIXPREC_CHECK_VALUE(input.defined() && weight.defined() && weight.dim() == 2,
                      "mixprec::fp8::linear: expected a defined "
                      "input and a 2-D weight, got weight of ",
                      mixprec::detail::num(weight.defined() ? weight.dim() : int64_t{-1}), " dims");
  const int64_t k = weight.size(1), n = weight.size(0);
  const int64_t tokens = k && input.dim() ? input.numel() / k : 0;
  if (!is_float(input.scalar_type()) || !is_float(weight.scalar_type()) || input.dim() == 0 || input.size(-1) != k ||
      tokens == 0 || tokens % kAlign || n % kAlign || k % kAlign) {
    ++state.fallbacks;
    return torch::nn::functional::linear(input, weight, bias);
  }
  state.to(input.device());
  const bool grad = at::GradMode::is_enabled();
  const auto bias_opt = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  at::Tensor y = Fp8LinearFunction::apply(input.reshape({tokens, k}).contiguous(), weight, bias_opt, &state,
                                          grad && input.requires_grad(), grad && weight.requires_grad());
  std::vector<int64_t> shape = input.sizes().vec();
  shape.back() = n;
  return y.view(shape);
}

std::optional<std::string> ineligibility(const torch::nn::Module& module) {
  const auto* l = dynamic_cast<const torch::nn::LinearImpl*>(&module);
  if (l == nullptr) return module.name() + " is not a torch::nn::Linear";
  std::string bad;
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"in_features", l->options.in_features()},
                                {"out_features", l->options.out_features()}})
    if (v % kAlign) bad += (bad.empty() ? "" : ", ") + std::string(name) + "=" + std::to_string(v);
  if (!bad.empty()) return bad + " not a multiple of " + std::to_string(kAlign);
  if (!is_float(l->weight.scalar_type()))
    return "weight dtype " + std::string(c10::toString(l->weight.scalar_type())) + " is not Float, Half or BFloat16";
  return std::nullopt;
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
