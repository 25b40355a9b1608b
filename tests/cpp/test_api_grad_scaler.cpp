// mixprec::amp::GradScaler for LibTorch: fused and torch::optim optimizers, overflow skips in any
// gradient dtype or layout, growth, hysteresis and bounds, checkpoints and misuse.
#include <gtest/gtest.h>
#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include <sstream>

#include "test_support.h"
namespace {

using namespace mixprec::test;
using mixprec::amp::GradScaler;
using mixprec::amp::GradScalerOptions;
using mixprec::optim::FusedAdamParamState;
using mixprec::optim::FusedAdamW;
using mixprec::optim::FusedAdamWOptions;

std::vector<at::Tensor> make_params(const std::vector<std::vector<int64_t>>& sh, at::ScalarType dtype,
                                    const c10::Device& device) {
  std::vector<at::Tensor> ps;
  for (const auto& s : sh) ps.push_back(random_tensor(s, dtype, device).requires_grad_(true));
  return ps;
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// Unscaled gradients in each param's dtype: scaled by a power of two they stay exact (subnormals
// included), so a scaled run and an unscaled one can be compared bit for bit.
std::vector<at::Tensor> random_grads(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> gs;
  for (const auto& p : ps) gs.push_back(random_tensor(p.sizes(), p.scalar_type(), p.device()));
  return gs;
}

// Sets the last element of `t` (any layout) through views.
void fill_last(at::Tensor t, double value) {
  while (t.dim() > 0) t = t.select(0, t.size(0) - 1);
  t.fill_(value);
}

void set_grads(const std::vector<at::Tensor>& ps, const std::vector<at::Tensor>& gs, double factor) {
  for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = (gs[i] * factor).to(ps[i].scalar_type());
}

// A one-element loss on the params' device, so the scaler puts its state there.
at::Tensor a_loss(const c10::Device& device) { return torch::ones({}, at::TensorOptions().device(device)); }

class ApiGradScaler : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(ApiGradScaler);

TEST_P(ApiGradScaler, ScaleMultipliesAndDisabledScalerIsTransparent) {
  GradScaler scaler(GradScalerOptions().init_scale(512.0));
  const at::Tensor x = random_tensor({5}, at::kFloat, device());
  EXPECT_TRUE(bitwise_equal(scaler.scale(x), x * 512.0));
  EXPECT_EQ(scaler.get_scale(), 512.0);
  EXPECT_EQ(scaler.scale_tensor().device(), device());

  GradScaler off(GradScalerOptions().enabled(false));
  EXPECT_TRUE(off.scale(x).is_same(x));
  EXPECT_EQ(off.get_scale(), 1.0);
  auto ps = make_params({{6}}, at::kFloat, device());
  FusedAdamW opt(ps, FusedAdamWOptions(0.1));
  const at::Tensor before = ps[0].detach().clone();
  set_grads(ps, random_grads(ps), 1.0);
  off.step(opt);
  off.update();
  EXPECT_FALSE(bitwise_equal(ps[0].detach(), before)) << "a disabled scaler must still step";
}

TEST_P(ApiGradScaler, FusedOptimizerStepsLikeUnscaledAndSkipsOverflowOnTheDevice) {
  for (at::ScalarType dtype : {at::kFloat, at::kHalf}) {
    auto ps = make_params({{7}, {65537}, {33, 3}}, dtype, device());
    auto ref = copies(ps);
    const bool masters = dtype != at::kFloat;
    FusedAdamW opt(ps, FusedAdamWOptions(0.01).master_weights(masters));
    FusedAdamW plain(ref, FusedAdamWOptions(0.01).master_weights(masters));
    GradScaler scaler(GradScalerOptions().init_scale(1024.0).growth_interval(1000));
    for (int step = 0; step < 3; ++step) {
      const auto gs = random_grads(ps);
      scaler.scale(a_loss(device()));
      set_grads(ps, gs, scaler.get_scale());  // what backward() of the scaled loss leaves
      set_grads(ref, gs, 1.0);
      scaler.step(opt);
      scaler.update();
      plain.step();
    }
    // Power-of-two scale: unscaling in the kernel is exact, so the runs agree bit for bit.
    for (size_t i = 0; i < ps.size(); ++i)
      EXPECT_TRUE(bitwise_equal(ps[i].detach(), ref[i].detach())) << dtype << " " << i;
    EXPECT_FALSE(opt.grad_scaling().grad_scale.has_value()) << "the scaler must clear what it handed over";

    // An overflow: nothing changes, the scale backs off, the skip is counted.
    std::vector<at::Tensor> before;
    for (const auto& p : ps) {
      before.push_back(p.detach().clone());
      for (const auto& kv :
           static_cast<FusedAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).defined_tensors())
        before.push_back(kv.second.clone());
    }
    const at::Tensor step_before = opt.step_count_tensor(0).clone();
    scaler.scale(a_loss(device()));
    set_grads(ps, random_grads(ps), 1024.0);
    inject(ps[1].grad(), {65536}, kInf);
    scaler.step(opt);
    scaler.update();
    std::vector<at::Tensor> after;
    for (const auto& p : ps) {
      after.push_back(p.detach());
      for (const auto& kv :
           static_cast<FusedAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).defined_tensors())
        after.push_back(kv.second);
    }
    expect_unchanged(after, before, "overflowing step");
    EXPECT_TRUE(bitwise_equal(opt.step_count_tensor(0), step_before));
    EXPECT_EQ(scaler.get_scale(), 512.0);
    EXPECT_EQ(scaler.skipped_steps(), 1);
  }
}

TEST_P(ApiGradScaler, UnscaleThenStepDoesNotUnscaleTwice) {
  auto ps = make_params({{100}, {9}}, at::kFloat, device());
  auto ref = copies(ps);
  FusedAdamW opt(ps, FusedAdamWOptions(0.05));
  FusedAdamW plain(ref, FusedAdamWOptions(0.05));
  GradScaler scaler(GradScalerOptions().init_scale(256.0));
  const auto gs = random_grads(ps);
  scaler.scale(a_loss(device()));
  set_grads(ps, gs, 256.0);
  set_grads(ref, gs, 1.0);
  scaler.unscale_(opt);
  for (size_t i = 0; i < ps.size(); ++i)
    EXPECT_TRUE(bitwise_equal(ps[i].grad(), ref[i].grad())) << "unscaled grad " << i;
  scaler.step(opt);
  scaler.update();
  plain.step();
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(bitwise_equal(ps[i].detach(), ref[i].detach())) << i;
}

TEST_P(ApiGradScaler, TorchOptimizersAreUnscaledInPlaceAndSkippedOnOverflow) {
  auto ps = make_params({{50}, {65537}}, at::kFloat, device());
  auto ref = copies(ps);
  torch::optim::SGD opt(ps, torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD plain(ref, torch::optim::SGDOptions(0.1).momentum(0.9));
  GradScaler scaler(GradScalerOptions().init_scale(4096.0));
  for (int step = 0; step < 2; ++step) {
    const auto gs = random_grads(ps);
    scaler.scale(a_loss(device()));
    set_grads(ps, gs, 4096.0);
    set_grads(ref, gs, 1.0);
    scaler.step(opt);
    scaler.update();
    plain.step();
  }
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(bitwise_equal(ps[i].detach(), ref[i].detach())) << i;
  const auto before = clone_all({ps[0].detach(), ps[1].detach()});
  const at::Tensor buffer =
      static_cast<torch::optim::SGDParamState&>(*opt.state().at(ps[0].unsafeGetTensorImpl())).momentum_buffer().clone();
  scaler.scale(a_loss(device()));
  set_grads(ps, random_grads(ps), 4096.0);
  inject(ps[0].grad(), {0}, kNaN);
  EXPECT_FALSE(scaler.step(opt).defined());
  scaler.update();
  expect_unchanged({ps[0].detach(), ps[1].detach()}, before, "params after a skipped torch::optim step");
  EXPECT_TRUE(bitwise_equal(
      static_cast<torch::optim::SGDParamState&>(*opt.state().at(ps[0].unsafeGetTensorImpl())).momentum_buffer(),
      buffer));
  EXPECT_EQ(scaler.get_scale(), 2048.0);
  EXPECT_EQ(scaler.skipped_steps(), 1);
}

TEST_P(ApiGradScaler, OverflowInAnyGradientDtypeOrLayoutIsFound) {
  // fp16, bf16 and fp32 go through mixprec's pass; float64 and a non-contiguous grad through
  // torch's op. An inf in each, in turn, must skip the step.
  auto half = random_tensor({65537}, at::kHalf, device()).requires_grad_(true);
  auto bf16 = random_tensor({300}, at::kBFloat16, device()).requires_grad_(true);
  auto fp64 = random_tensor({40}, at::kDouble, device()).requires_grad_(true);
  auto strided = random_tensor({8, 6}, at::kFloat, device()).requires_grad_(true);
  const std::vector<at::Tensor> ps{half, bf16, fp64, strided};
  torch::optim::SGD opt(ps, torch::optim::SGDOptions(0.1));
  for (size_t bad = 0; bad < ps.size(); ++bad) {
    GradScaler scaler(GradScalerOptions().init_scale(2.0));
    scaler.scale(a_loss(device()));
    for (const auto& p : ps) p.mutable_grad() = random_tensor(p.sizes(), p.scalar_type(), device());
    strided.mutable_grad() = random_tensor({6, 8}, at::kFloat, device()).t();  // non-contiguous
    fill_last(ps[bad].grad(), kInf);
    const auto before =
        clone_all(std::vector<at::Tensor>{half.detach(), bf16.detach(), fp64.detach(), strided.detach()});
    scaler.step(opt);
    scaler.update();
    EXPECT_EQ(scaler.skipped_steps(), 1) << "inf in param " << bad << " was not found";
    expect_unchanged({half.detach(), bf16.detach(), fp64.detach(), strided.detach()}, before, "params");
  }
}

TEST_P(ApiGradScaler, GrowthHysteresisAndBounds) {
  auto ps = make_params({{10}}, at::kFloat, device());
  FusedAdamW opt(ps, FusedAdamWOptions(0.01));
  GradScaler scaler(
      GradScalerOptions().init_scale(64.0).growth_interval(2).hysteresis(2).min_scale(16.0).max_scale(128.0));
  const auto iterate = [&](bool overflow) {
    scaler.scale(a_loss(device()));
    set_grads(ps, random_grads(ps), scaler.get_scale());
    if (overflow) inject(ps[0].grad(), {3}, kInf);
    scaler.step(opt);
    scaler.update();
    return scaler.get_scale();
  };
  EXPECT_EQ(iterate(false), 64.0);
  EXPECT_EQ(iterate(false), 128.0) << "growth after growth_interval clean steps";
  EXPECT_EQ(iterate(false), 128.0);
  EXPECT_EQ(iterate(false), 128.0) << "capped at max_scale";
  EXPECT_EQ(iterate(true), 128.0) << "hysteresis 2: the first overflow does not back off";
  EXPECT_EQ(iterate(true), 64.0) << "the second does";
  EXPECT_EQ(iterate(true), 64.0);
  EXPECT_EQ(iterate(true), 32.0);
  EXPECT_EQ(iterate(true), 32.0);
  EXPECT_EQ(iterate(true), 16.0);
  EXPECT_EQ(iterate(true), 16.0);
  EXPECT_EQ(iterate(true), 16.0) << "floored at min_scale";
  EXPECT_EQ(scaler.skipped_steps(), 8);
  scaler.scale(a_loss(device()));
  set_grads(ps, random_grads(ps), 16.0);
  scaler.step(opt);
  // update(new_scale) keeps to the bounds too, as the Python front does.
  expect_c10_error([&] { scaler.update(1000.0); }, {"GradScaler.update: invalid new_scale 1e+03;", "max_scale (128)"});
  scaler.update(100.0);
  EXPECT_EQ(scaler.get_scale(), 100.0);
}

TEST_P(ApiGradScaler, MisuseIsReported) {
  auto ps = make_params({{4}}, at::kFloat, device());
  FusedAdamW opt(ps, FusedAdamWOptions(0.01));
  GradScaler scaler;
  set_grads(ps, random_grads(ps), 1.0);
  expect_c10_error([&] { scaler.step(opt); }, {"GradScaler", "before any scale()"});
  scaler.scale(a_loss(device()));
  expect_c10_error([&] { scaler.update(); }, {"GradScaler", "no inf checks"});
  scaler.unscale_(opt);
  expect_c10_error([&] { scaler.unscale_(opt); }, {"GradScaler", "already been called"});
  scaler.step(opt);
  expect_c10_error([&] { scaler.step(opt); }, {"GradScaler", "step() has already been called"});
  expect_c10_error([&] { scaler.unscale_(opt); }, {"GradScaler", "after step()"});
  scaler.update();
  // The numbers in these messages are formatted without std::ostream (csrc/ops/format.h).
  expect_c10_error([&] { GradScaler(GradScalerOptions().growth_factor(1.0)); }, {"invalid growth_factor 1;"});
  expect_c10_error([&] { GradScaler(GradScalerOptions().backoff_factor(1.5)); }, {"backoff_factor 1.5;"});
  expect_c10_error([&] { GradScaler(GradScalerOptions().hysteresis(0)); }, {"invalid hysteresis 0;"});
  expect_c10_error([&] { GradScaler(GradScalerOptions().min_scale(4.0).max_scale(2.0).init_scale(3.0)); },
                   {"invalid max_scale 2; expected a number >= min_scale (4)"});
}

std::string save_scaler(const GradScaler& s) {
  torch::serialize::OutputArchive archive;
  archive << s;
  std::ostringstream os;
  archive.save_to(os);
  return os.str();
}

void load_scaler(GradScaler& s, const std::string& bytes) {
  torch::serialize::InputArchive archive;
  std::istringstream is(bytes);
  archive.load_from(is);
  archive >> s;
}

TEST_P(ApiGradScaler, CheckpointRoundTripAndCorruptCheckpoints) {
  auto ps = make_params({{10}}, at::kFloat, device());
  FusedAdamW opt(ps, FusedAdamWOptions(0.01));
  GradScaler a(GradScalerOptions().init_scale(1024.0).growth_interval(3).hysteresis(2).max_scale(4096.0));
  for (bool overflow : {false, true, true, false}) {
    a.scale(a_loss(device()));
    set_grads(ps, random_grads(ps), a.get_scale());
    if (overflow) inject(ps[0].grad(), {0}, kNaN);
    a.step(opt);
    a.update();
  }
  const std::string bytes = save_scaler(a);
  GradScaler b;  // its options come from the checkpoint
  load_scaler(b, bytes);
  EXPECT_EQ(b.get_scale(), a.get_scale());
  EXPECT_EQ(b.growth_tracker(), a.growth_tracker());
  EXPECT_EQ(b.skipped_steps(), 2);
  EXPECT_EQ(b.options().hysteresis(), 2);
  EXPECT_EQ(b.options().growth_interval(), 3);
  EXPECT_EQ(b.options().max_scale(), std::optional<double>(4096.0));
  EXPECT_FALSE(b.options().min_scale().has_value());

  // Both continue identically (hysteresis tracker included: one more overflow backs off or not alike).
  auto qs = make_params({{10}}, at::kFloat, device());
  FusedAdamW opt_b(qs, FusedAdamWOptions(0.01));
  for (bool overflow : {true, false, false, false, true}) {
    for (auto* pair : {&a, &b}) {
      auto& params = pair == &a ? ps : qs;
      pair->scale(a_loss(device()));
      set_grads(params, random_grads(params), pair->get_scale());
      if (overflow) inject(params[0].grad(), {1}, kInf);
      pair->step(pair == &a ? static_cast<torch::optim::Optimizer&>(opt) : opt_b);
      pair->update();
    }
    EXPECT_EQ(a.get_scale(), b.get_scale());
  }

  // Corrupt values are refused and change nothing; so is a disabled scaler's checkpoint.
  torch::serialize::OutputArchive bad;
  bad.write("scale", c10::IValue(-1.0));
  bad.write("growth_factor", c10::IValue(2.0));
  bad.write("backoff_factor", c10::IValue(0.5));
  bad.write("growth_interval", c10::IValue(int64_t{10}));
  bad.write("_growth_tracker", c10::IValue(int64_t{0}));
  bad.write("hysteresis", c10::IValue(int64_t{1}));
  bad.write("_hysteresis_tracker", c10::IValue(int64_t{1}));
  bad.write("_skipped_steps", c10::IValue(int64_t{0}));
  std::ostringstream os;
  bad.save_to(os);
  const double scale_before = b.get_scale();
  expect_c10_error([&] { load_scaler(b, os.str()); }, {"GradScaler.load", "init_scale"});
  EXPECT_EQ(b.get_scale(), scale_before);
  EXPECT_EQ(b.options().hysteresis(), 2);
  GradScaler off(GradScalerOptions().enabled(false));
  expect_c10_error([&] { load_scaler(b, save_scaler(off)); }, {"disabled GradScaler"});
  torch::serialize::OutputArchive missing;
  missing.write("scale", c10::IValue(2.0));
  std::ostringstream os2;
  missing.save_to(os2);
  expect_c10_error([&] { load_scaler(b, os2.str()); }, {"GradScaler.load", "growth_factor"});
  EXPECT_EQ(b.get_scale(), scale_before);
}

}  // namespace
