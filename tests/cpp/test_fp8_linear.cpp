// mixprec::fp8 for LibTorch (include/mixprec/fp8.h): outputs and both gradients against a float64
// model of the same casts (python's test_fp8_linear.py numerics), delayed scaling's history,
// inf/NaN, fallback, state round trips and refusals, convert() and amp::initialize with fp8; and
// the python front's saved results reproduced bit for bit (both fronts run one op).
#include <gtest/gtest.h>
#include <mixprec/amp.h>
#include <mixprec/fp8.h>
#include <mixprec/optim.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "test_support.h"

namespace {

using namespace mixprec::test;
namespace fp8 = mixprec::fp8;

// Current scaling in float64: scale = fp8_max / amax in fp32 (as the device computes it), t *
// scale cast by torch's own conversion, divided by the scale again.
at::Tensor quantized64(const at::Tensor& t, c10::ScalarType dtype) {
  const at::Tensor t32 = t.detach().cpu().to(at::kFloat);
  const double m = fp8::fp8_max(dtype);
  const at::Tensor scale = at::full({}, m, at::kFloat) / t32.abs().max();
  return (t32 * scale).clamp(-m, m).to(dtype).to(at::kDouble) / scale.to(at::kDouble);
}

class Fp8Linear : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(Fp8Linear);

TEST_P(Fp8Linear, OutputsAndGradsMatchAFloat64ModelOfTheSameCasts) {
  for (const auto& recipe : {fp8::Recipe(), fp8::Recipe::e4m3()}) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " grads " + c10::toString(recipe.backward_dtype()));
      fp8::ScalingState state(recipe, device());
      const at::Tensor w = random_tensor({48, 64}, dtype, device(), 0.1).requires_grad_();
      const at::Tensor b = random_tensor({48}, dtype, device(), 0.1).requires_grad_();
      const at::Tensor x = random_tensor({2, 40, 64}, dtype, device()).requires_grad_();
      const at::Tensor dy = random_tensor({2, 40, 48}, dtype, device(), 1e-3);
      const at::Tensor y = fp8::linear(x, w, b, state);
      ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 40, 48}));
      ASSERT_EQ(y.scalar_type(), dtype);
      y.backward(dy);

      const at::Tensor qx = quantized64(x.reshape({80, 64}), recipe.forward_dtype());
      const at::Tensor qw = quantized64(w, recipe.forward_dtype());
      const at::Tensor qg = quantized64(dy.reshape({80, 48}), recipe.backward_dtype());
      const at::Tensor b64 = b.detach().cpu().to(at::kDouble);
      // The same casts; what is left is fp32 accumulation and the output's rounding.
      const double tol = dtype == at::kFloat ? 1e-5 : std::ldexp(1.0, -7);
      EXPECT_LT(rel_err(y.reshape({80, 48}), at::mm(qx, qw.t()) + b64), tol);
      EXPECT_LT(rel_err(x.grad().reshape({80, 64}), at::mm(qg, qw)), tol);
      EXPECT_LT(rel_err(w.grad(), at::mm(qg.t(), qx)), tol);
      EXPECT_LT(rel_err(b.grad(), dy.cpu().to(at::kDouble).reshape({80, 48}).sum(0)), tol);
      // And the state holds the scales used: fp8_max / amax of each tensor.
      const at::Tensor amax =
          at::stack({x.detach().abs().max(), w.detach().abs().max(), dy.abs().max()}).to(at::kFloat).cpu();
      const at::Tensor maxes =
          torch::tensor({fp8::fp8_max(recipe.forward_dtype()), fp8::fp8_max(recipe.forward_dtype()),
                         fp8::fp8_max(recipe.backward_dtype())},
                        at::kFloat);
      EXPECT_TRUE(bitwise_equal(state.scale.cpu(), maxes / amax));
    }
  }
}

// The two fronts run one op: fp8::Linear reproduces, bit for bit, the outputs, gradients and
// scaling state that python's Fp8Linear computed before the op existed (the fixture of
// tests/python/test_fp8_linear_op.py, written by tests/python/fixtures/make_fp8_linear_before.py).
TEST(Fp8LinearFronts, CppFrontReproducesThePythonFrontsSavedResultsBitForBit) {
  std::ifstream in(std::string(MIXPREC_TEST_FIXTURES) + "/../../python/fixtures/fp8_linear_before.pt",
                   std::ios::binary);
  ASSERT_TRUE(in.good());
  const std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const c10::Dict<c10::IValue, c10::IValue> cases = torch::pickle_load(data).toGenericDict();
  ASSERT_EQ(cases.size(), 5u);
  const auto same = [](const at::Tensor& got, const c10::IValue& want) {
    return want.isNone() ? !got.defined() : got.defined() && at::equal(got, want.toTensor());
  };
  for (const auto& kv : cases) {
    const auto c = kv.value().toGenericDict();
    SCOPED_TRACE(kv.key().toStringRef());
    fp8::Recipe recipe;
    recipe.scaling(c.at("scaling").toStringRef() == "delayed" ? fp8::Scaling::kDelayed : fp8::Scaling::kCurrent)
        .backward_dtype(c.at("backward_dtype").toStringRef() == "torch.float8_e4m3fn" ? c10::kFloat8_e4m3fn
                                                                                      : c10::kFloat8_e5m2)
        .amax_history_len(c.at("amax_history_len").toInt())
        .amax_reduction(c.at("amax_reduction").toStringRef())
        .margin(c.at("margin").toDouble());
    fp8::ScalingState state(recipe);
    const at::Tensor w = c.at("weight").toTensor().clone().requires_grad_();
    const at::Tensor b = c.at("bias").isNone() ? at::Tensor() : c.at("bias").toTensor().clone().requires_grad_();
    int step = 0;
    for (const c10::IValue& entry : c.at("steps").toList()) {
      SCOPED_TRACE("step " + std::to_string(step++));
      const auto s = entry.toGenericDict();
      const at::Tensor x = s.at("x").toTensor().clone().requires_grad_();
      const at::Tensor y = fp8::linear(x, w, b, state);
      y.backward(s.at("dy").toTensor());
      EXPECT_TRUE(same(y.detach(), s.at("y")));
      EXPECT_TRUE(same(x.grad(), s.at("dx")));
      EXPECT_TRUE(same(w.grad(), s.at("dw")));
      EXPECT_TRUE(same(b.defined() ? b.grad() : at::Tensor(), s.at("db")));
      EXPECT_TRUE(same(state.scale, s.at("scale")));
      EXPECT_TRUE(same(state.amax, s.at("amax")));
      EXPECT_TRUE(same(state.amax_history, s.at("amax_history")));
      w.mutable_grad().reset();
      if (b.defined()) b.mutable_grad().reset();
    }
  }
}

TEST_P(Fp8Linear, CudaScaledMmMatchesTheEmulation) {
  if (GetParam() != c10::kCUDA) GTEST_SKIP() << "compares _scaled_mm with the CPU emulation";
  for (const at::ScalarType out : {at::kFloat, at::kBFloat16}) {
    const at::Tensor a = random_tensor({64, 32}, at::kFloat, device(), 100).to(at::kFloat8_e4m3fn);
    const at::Tensor b = random_tensor({48, 32}, at::kFloat, device(), 100).to(at::kFloat8_e4m3fn).t();
    const at::Tensor sa = torch::full({1}, 0.03, opts()), sb = torch::full({1}, 0.007, opts());
    const at::Tensor bias = random_tensor({48}, out, device());
    const at::Tensor got = fp8::scaled_mm(a, b, sa, sb, out, bias);
    const at::Tensor ref = fp8::scaled_mm(a, b, sa, sb, out, bias, /*emulate=*/true);
    EXPECT_LT(rel_err(got, ref.to(at::kDouble)), out == at::kFloat ? 1e-5 : std::ldexp(1.0, -7));
  }
}

TEST_P(Fp8Linear, DelayedScalingFollowsItsHistory) {
  fp8::ScalingState state(fp8::Recipe().scaling(fp8::Scaling::kDelayed).amax_history_len(4), device());
  const at::Tensor w = random_tensor({16, 32}, at::kFloat, device());
  std::vector<float> seen;
  for (int step = 0; step < 3; ++step) {
    const at::Tensor x = random_tensor({16, 32}, at::kFloat, device(), std::ldexp(1.0, 3 * step));
    torch::NoGradGuard no_grad;
    fp8::linear(x, w, {}, state);
    // The cast used the scale from the earlier steps' amaxes (1 before any): max over history.
    const double expect = seen.empty() ? 1.0 : 448.0f / *std::max_element(seen.begin(), seen.end());
    EXPECT_FLOAT_EQ(state.scale[0].item<float>(), static_cast<float>(expect)) << "step " << step;
    EXPECT_EQ(state.amax[0].item<float>(), x.abs().max().item<float>());  // pending, for the next step
    seen.push_back(x.abs().max().item<float>());
  }
  EXPECT_EQ(state.amax_history[0][0].item<float>(), seen[1]);
  EXPECT_EQ(state.amax_history[0][1].item<float>(), seen[0]);
}

TEST_P(Fp8Linear, NonFiniteInputsShowInTheOutput) {
  for (const double value : {kInf, kNaN}) {
    fp8::ScalingState state({}, device());
    const at::Tensor x = random_tensor({16, 32}, at::kFloat, device());
    inject(x, {5}, value);
    const at::Tensor y = fp8::linear(x, random_tensor({16, 32}, at::kFloat, device()), {}, state);
    EXPECT_TRUE(y.isnan().all().item<bool>()) << value;  // the dequantization factor is NaN
    EXPECT_TRUE(state.scale.isfinite().all().item<bool>());
  }
}

TEST_P(Fp8Linear, ShapesFp8CannotTakeFallBackToLinear) {
  fp8::ScalingState state({}, device());
  const at::Tensor x = random_tensor({3, 32}, at::kFloat, device()), w = random_tensor({16, 32}, at::kFloat, device());
  const at::Tensor y = fp8::linear(x, w, {}, state);
  EXPECT_TRUE(bitwise_equal(y, torch::nn::functional::linear(x, w)));
  EXPECT_EQ(state.fallbacks, 1);
  EXPECT_TRUE(bitwise_equal(state.scale.cpu(), torch::ones({3})));
}

torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::Tanh(), torch::nn::Linear(64, 32),
                               torch::nn::Linear(32, 10));
}

TEST(Fp8Convert, SequentialLinearsBecomeFp8SharingTheirParameters) {
  auto model = make_model();
  struct Holder : torch::nn::Module {
    torch::nn::Linear member{nullptr};
    torch::nn::Sequential seq{nullptr};
  };
  auto holder = std::make_shared<Holder>();
  holder->member = holder->register_module("member", torch::nn::Linear(16, 16));
  holder->seq = holder->register_module("seq", model);
  const auto params = holder->named_parameters();
  const auto result = fp8::convert(*holder);
  EXPECT_EQ(result.converted, (std::vector<std::string>{"seq.0", "seq.2"}));
  ASSERT_EQ(result.skipped.size(), 2u);
  EXPECT_EQ(result.skipped[0].first, "seq.3");
  EXPECT_EQ(result.skipped[0].second, "out_features=10 not a multiple of 16");
  EXPECT_EQ(result.skipped[1].first, "member");
  const auto after = holder->named_parameters();
  ASSERT_EQ(after.keys(), params.keys());  // same names, the same tensors
  for (const auto& kv : params) EXPECT_TRUE(after[kv.key()].is_same(kv.value())) << kv.key();
  auto* layer = model->ptr(0)->as<fp8::LinearImpl>();
  ASSERT_NE(layer, nullptr);
  const at::Tensor x = random_tensor({16, 32}, at::kFloat, c10::kCPU);
  fp8::ScalingState fresh;
  const at::Tensor expect = fp8::linear(x, layer->weight, layer->bias, fresh);
  EXPECT_TRUE(bitwise_equal(model->ptr(0)->as<fp8::LinearImpl>()->forward(x), expect));
  EXPECT_EQ(model->forward(x).sizes(), (std::vector<int64_t>{16, 10}));
  // A bad recipe is refused before anything changes.
  auto other = make_model();
  expect_c10_error([&] { fp8::convert(*other, fp8::Recipe().amax_reduction("mean")); },
                   {"mixprec::fp8::convert", "amax_reduction", "\"mean\""});
  EXPECT_NE(other->ptr(0)->as<torch::nn::LinearImpl>(), nullptr);
}

TEST(Fp8State, SaveLoadRoundTripAndRefusals) {
  const fp8::Recipe delayed = fp8::Recipe().scaling(fp8::Scaling::kDelayed).amax_history_len(3);
  auto model = make_model();
  fp8::convert(*model, delayed);
  for (int i = 0; i < 3; ++i) model->forward(random_tensor({16, 32}, at::kFloat, c10::kCPU, 1 + i)).sum().backward();
  std::stringstream saved;
  {
    torch::serialize::OutputArchive archive;
    fp8::save_state(*model, archive);
    archive.save_to(saved);
  }
  auto copy = make_model();
  fp8::convert(*copy, delayed);
  torch::serialize::InputArchive in;
  in.load_from(saved);
  fp8::load_state(*copy, in);
  for (const size_t i : {0u, 2u}) {
    const auto& a = model->ptr(i)->as<fp8::LinearImpl>()->state;
    const auto& b = copy->ptr(i)->as<fp8::LinearImpl>()->state;
    EXPECT_TRUE(bitwise_equal(a.scale, b.scale) && bitwise_equal(a.amax, b.amax) &&
                bitwise_equal(a.amax_history, b.amax_history));
    EXPECT_FALSE(bitwise_equal(b.scale, torch::ones({3})));
  }
  // A current-scaling model (history length 1) refuses it whole and keeps its state.
  auto current = make_model();
  fp8::convert(*current);
  auto* second = current->ptr(2)->as<fp8::LinearImpl>();
  second->state.scale.fill_(2);
  const auto before = clone_all({current->ptr(0)->as<fp8::LinearImpl>()->state.scale, second->state.scale});
  saved.seekg(0);
  torch::serialize::InputArchive again;
  again.load_from(saved);
  expect_c10_error([&] { fp8::load_state(*current, again); },
                   {"mixprec::fp8::load_state", "archive['0']['amax_history']", "shape [3, 1]"});
  expect_unchanged({current->ptr(0)->as<fp8::LinearImpl>()->state.scale, second->state.scale}, before, "scale");
  // A non-positive scale is refused.
  fp8::ScalingState bad(delayed);
  bad.scale[1] = -1.0;
  std::stringstream s;
  torch::serialize::OutputArchive out;
  bad.save(out);
  out.save_to(s);
  torch::serialize::InputArchive bad_in;
  bad_in.load_from(s);
  fp8::ScalingState target(delayed);
  expect_c10_error([&] { target.load(bad_in); }, {"ScalingState::load", "['scale']", "finite and > 0"});
  EXPECT_TRUE(bitwise_equal(target.scale, torch::ones({3})));
}

TEST(Fp8Recipe, BadValuesAreRefusedByName) {
  expect_c10_error([] { fp8::ScalingState(fp8::Recipe().forward_dtype(at::kHalf)); },
                   {"mixprec::fp8::ScalingState", "forward_dtype", "Half"});
  expect_c10_error([] { fp8::ScalingState(fp8::Recipe().margin(-1)); }, {"margin", "[0, 64]"});
  expect_c10_error([] { fp8::ScalingState(fp8::Recipe().amax_history_len(0)); }, {"amax_history_len", "[1, 65536]"});
  auto model = make_model();
  expect_c10_error([&] { fp8::LinearImpl(*model->ptr(3)->as<torch::nn::LinearImpl>(), {}); },
                   {"mixprec::fp8::Linear", "out_features=10"});
}

TEST(Fp8Amp, InitializeO2WithFp8ConvertsAfterTheCast) {
  auto model = make_model();
  mixprec::optim::FusedAdam opt(model->parameters(), mixprec::optim::FusedAdamOptions(1e-3));
  const auto state = mixprec::amp::initialize(
      *model, opt, mixprec::amp::AmpOptions(mixprec::amp::OptLevel::O2, at::kBFloat16).fp8(fp8::Recipe()));
  EXPECT_EQ(state.fp8.converted, (std::vector<std::string>{"0", "2"}));
  auto* layer = model->ptr(0)->as<fp8::LinearImpl>();
  ASSERT_NE(layer, nullptr);
  EXPECT_EQ(layer->weight.scalar_type(), at::kBFloat16);
  const at::Tensor x = state.cast_input(random_tensor({32, 32}, at::kFloat, c10::kCPU));
  const at::Tensor loss = model->forward(x).to(at::kFloat).pow(2).mean();
  loss.backward();
  opt.step();
  EXPECT_TRUE(loss.isfinite().item<bool>());
  EXPECT_FALSE(bitwise_equal(layer->state.scale, torch::ones({3})));  // all three casts ran
  // O1 does not cast the model: refused, and the model is untouched.
  auto o1 = make_model();
  expect_c10_error(
      [&] { mixprec::amp::initialize(*o1, mixprec::amp::AmpOptions(mixprec::amp::OptLevel::O1).fp8(fp8::Recipe())); },
      {"mixprec::amp::initialize", "fp8", "O2 or O3", "O1"});
  EXPECT_NE(o1->ptr(0)->as<torch::nn::LinearImpl>(), nullptr);
  EXPECT_EQ(o1->ptr(0)->as<torch::nn::LinearImpl>()->weight.scalar_type(), at::kFloat);
}

}  // namespace
