// mixprec::amp for LibTorch beside the GradScaler (test_api_grad_scaler.cpp): the RAII AutocastGuard
// (nesting, exceptions, cache) and the opt levels O0-O3 of initialize().
#include <gtest/gtest.h>
#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include <ATen/autocast_mode.h>

#include <stdexcept>

#include "test_support.h"

namespace {

using namespace mixprec::test;
using mixprec::amp::AmpOptions;
using mixprec::amp::AutocastGuard;
using mixprec::amp::GradScaler;
using mixprec::amp::OptLevel;
using mixprec::optim::FusedAdamW;
using mixprec::optim::FusedAdamWOptions;

// ---- autocast -------------------------------------------------------------------------------------
struct AutocastState {
  bool enabled;
  at::ScalarType dtype;
  bool cache;
  static AutocastState now(c10::DeviceType d) {
    return {at::autocast::is_autocast_enabled(d), at::autocast::get_autocast_dtype(d),
            at::autocast::is_autocast_cache_enabled()};
  }
  bool operator==(const AutocastState& o) const { return enabled == o.enabled && dtype == o.dtype && cache == o.cache; }
};

TEST(ApiAutocast, GuardCastsInsideAndRestoresWhenNested) {
  const auto a = torch::randn({8, 8}), b = torch::randn({8, 8});
  const AutocastState outside = AutocastState::now(c10::kCPU);
  EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kFloat);
  {
    AutocastGuard outer(c10::kCPU, at::kBFloat16);
    EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16);
    {
      AutocastGuard off(c10::kCPU, at::kBFloat16, /*enabled=*/false);
      EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kFloat) << "a disabled inner region runs in fp32";
      {
        AutocastGuard half(c10::kCPU, at::kHalf, true, /*cache_enabled=*/false);
        EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kHalf);
        EXPECT_FALSE(at::autocast::is_autocast_cache_enabled());
      }
      EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
      EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), at::kBFloat16);
    }
    EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kBFloat16) << "the outer region is back after the inner ones";
    EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
  }
  EXPECT_TRUE(AutocastState::now(c10::kCPU) == outside);
  EXPECT_EQ(torch::mm(a, b).scalar_type(), at::kFloat);
}

TEST(ApiAutocast, ExceptionsRestoreTheStateAndBadArgumentsChangeNothing) {
  const AutocastState outside = AutocastState::now(c10::kCPU);
  try {
    AutocastGuard outer(c10::kCPU, at::kHalf, true, false);
    AutocastGuard inner(c10::kCPU, at::kBFloat16);
    throw std::runtime_error("boom");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(AutocastState::now(c10::kCPU) == outside);
  expect_c10_error([] { AutocastGuard g(c10::kCPU, at::kDouble); }, {"AutocastGuard", "dtype"});
  EXPECT_TRUE(AutocastState::now(c10::kCPU) == outside);
  {
    AutocastGuard g(c10::kCPU, at::kBFloat16);
    expect_c10_error([] { AutocastGuard bad(c10::kCPU, at::kFloat); }, {"AutocastGuard"});
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::kCPU)) << "a refused inner guard must not touch the region";
    EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), at::kBFloat16);
  }
  EXPECT_TRUE(AutocastState::now(c10::kCPU) == outside);
}

TEST(ApiAutocast, CudaGuardLeavesTheCpuStateAlone) {
  MIXPREC_SKIP_WITHOUT_CUDA();
  const AutocastState cpu = AutocastState::now(c10::kCPU);
  {
    AutocastGuard g(c10::kCUDA, at::kHalf);
    const auto a = torch::randn({8, 8}, torch::kCUDA);
    EXPECT_EQ(torch::mm(a, a).scalar_type(), at::kHalf);
    EXPECT_TRUE(AutocastState::now(c10::kCPU) == cpu);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCUDA));
}

// ---- opt levels ---------------------------------------------------------------------------------
torch::nn::Sequential small_net() {
  return torch::nn::Sequential(torch::nn::Linear(12, 16), torch::nn::BatchNorm1d(16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 4));
}

class ApiOptLevels : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(ApiOptLevels);

TEST_P(ApiOptLevels, O2CastsAllButBatchNormAndSeedsExactMasters) {
  for (at::ScalarType low : {at::kHalf, at::kBFloat16}) {
    auto net = small_net();
    net->to(device());
    std::vector<at::Tensor> originals;
    for (const auto& p : net->parameters()) originals.push_back(p.detach().clone());
    FusedAdamW opt(net->parameters(), FusedAdamWOptions(0.01));
    const auto state = mixprec::amp::initialize(*net, opt, AmpOptions(OptLevel::O2, low));
    EXPECT_TRUE(state.master_weights);
    EXPECT_EQ(state.dynamic_loss_scale, low == at::kHalf);
    EXPECT_EQ(state.scaler_options().enabled(), low == at::kHalf);
    for (const auto& kv : net->named_parameters()) {
      const bool bn = kv.key().rfind("1.", 0) == 0;  // the BatchNorm1d is module "1"
      EXPECT_EQ(kv.value().scalar_type(), bn ? at::kFloat : low) << kv.key();
    }
    for (const auto& kv : net->named_buffers())
      if (kv.value().is_floating_point()) EXPECT_EQ(kv.value().scalar_type(), at::kFloat) << kv.key();
    // The optimizer still holds the model's tensors, and masters are the exact fp32 originals.
    const auto params = net->parameters();
    const auto masters = opt.master_params();
    ASSERT_EQ(masters.size(), params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(opt.param_groups()[0].params()[i].is_same(params[i])) << i;
      EXPECT_TRUE(bitwise_equal(masters[i], originals[i])) << "master " << i;
    }
    // One training step through the scaler: the model holds its masters' rounding.
    GradScaler scaler(state.scaler_options().init_scale(256.0));  // small: this net must not overflow
    const at::Tensor x = random_tensor({6, 12}, at::kFloat, device());
    const at::Tensor loss = net->forward(state.cast_input(x)).to(at::kFloat).square().mean();
    scaler.scale(loss).backward();
    scaler.step(opt);
    scaler.update();
    const auto after = opt.master_params();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_FALSE(bitwise_equal(after[i], originals[i])) << "master " << i << " did not move";
      EXPECT_TRUE(bitwise_equal(params[i].detach(), after[i].to(params[i].scalar_type()))) << i;
    }
  }
}

TEST_P(ApiOptLevels, O0O1O3AndOverrides) {
  {
    auto net = small_net();
    net->to(device());
    const auto s = mixprec::amp::initialize(*net, AmpOptions(OptLevel::O3, at::kBFloat16));
    for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kBFloat16);
    EXPECT_FALSE(s.master_weights);
    EXPECT_FALSE(s.scaler_options().enabled());
    EXPECT_EQ(s.cast_input(torch::ones({2})).scalar_type(), at::kBFloat16);
    EXPECT_EQ(s.cast_input(torch::ones({2}, torch::kLong)).scalar_type(), at::kLong);
  }
  {
    auto net = small_net();
    net->to(device());
    const auto s = mixprec::amp::initialize(*net, AmpOptions(OptLevel::O1, at::kHalf));
    for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
    EXPECT_TRUE(s.autocast);
    EXPECT_TRUE(s.scaler_options().enabled());
    {
      auto guard = s.autocast_guard(c10::kCPU);
      EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::kCPU));
    }
    EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  }
  {
    auto net = small_net();
    net->to(device());
    const auto s = mixprec::amp::initialize(*net, AmpOptions(OptLevel::O0));
    for (const auto& p : net->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
    EXPECT_FALSE(s.scaler_options().enabled());
    auto guard = s.autocast_guard(c10::kCPU);
    EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  }
  {  // keep_fp32 keeps a named module; keep_batchnorm_fp32(false) casts BatchNorm too
    auto net = small_net();
    net->to(device());
    mixprec::amp::initialize(
        *net, AmpOptions(OptLevel::O2)
                  .keep_batchnorm_fp32(false)
                  .master_weights(false)
                  .keep_fp32([](const std::string& name, const torch::nn::Module&) { return name == "3"; }));
    for (const auto& kv : net->named_parameters())
      EXPECT_EQ(kv.value().scalar_type(), kv.key().rfind("3.", 0) == 0 ? at::kFloat : at::kHalf) << kv.key();
  }
}

// A module held by value, not by shared_ptr, as LibTorch code often has its root.
struct Net : torch::nn::Module {
  Net() : fc(register_module("fc", torch::nn::Linear(4, 4))), bn(register_module("bn", torch::nn::BatchNorm1d(4))) {
    scale = register_parameter("scale", torch::ones({4}));
  }
  torch::nn::Linear fc;
  torch::nn::BatchNorm1d bn;
  at::Tensor scale;
};

TEST_P(ApiOptLevels, ErrorsAndAModuleNotOwnedByASharedPtr) {
  Net net;
  net.to(device());
  torch::optim::SGD sgd(net.parameters(), torch::optim::SGDOptions(0.1));
  expect_c10_error([&] { mixprec::amp::initialize(net, sgd, AmpOptions(OptLevel::O2)); },
                   {"initialize", "mixprec::optim fused optimizer"});
  for (const auto& p : net.parameters())
    EXPECT_EQ(p.scalar_type(), at::kFloat) << "a refused initialize cast the model";
  expect_c10_error([&] { mixprec::amp::initialize(net, AmpOptions(OptLevel::O2, at::kFloat)); }, {"dtype"});
  expect_c10_error([&] { mixprec::amp::initialize(net, AmpOptions(OptLevel::O1).master_weights(true)); }, {"O1"});
  expect_c10_error([&] { mixprec::amp::initialize(net, AmpOptions(OptLevel::O0).master_weights(true)); },
                   {"master weights need"});
  FusedAdamW opt(net.parameters(), FusedAdamWOptions(0.01));
  mixprec::amp::initialize(net, opt, AmpOptions(OptLevel::O2));
  EXPECT_EQ(net.scale.scalar_type(), at::kHalf) << "the root's own parameter is cast";
  EXPECT_EQ(net.fc->weight.scalar_type(), at::kHalf);
  EXPECT_EQ(net.bn->weight.scalar_type(), at::kFloat);
  expect_c10_error([&] { mixprec::amp::initialize(net, opt, AmpOptions(OptLevel::O2)); }, {"pass the model in fp32"});
}

}  // namespace
