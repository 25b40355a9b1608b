// The loss-scaling ops with bad scales (issue 20), on CPU and CUDA: an inv_scale of inf, NaN or 0
// is flagged in every grad; update_scale_ keeps NaN scales NaN and never backs off below 2^-126.
#include <gtest/gtest.h>
#include <mixprec/ops.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "test_support.h"

namespace {

using namespace mixprec::test;

constexpr float kFloor = 0x1p-126f;  // the smallest normal float32

class LossScaleBadScales : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(LossScaleBadScales);

// Finite grads of every dtype around the chunk boundary, an empty one among them.
std::vector<at::Tensor> finite_grads(const c10::Device& device) {
  const at::ScalarType types[] = {at::kFloat, at::kHalf, at::kBFloat16};
  const std::vector<int64_t> sizes{1, 65539, 0, 35, 65536};
  std::vector<at::Tensor> g;
  for (size_t i = 0; i < sizes.size(); ++i) g.push_back(random_tensor({sizes[i]}, types[i % 3], device, 1000.0));
  return g;
}

TEST_P(LossScaleBadScales, InfNaNOrZeroInvScaleIsFoundInEveryTensor) {
  // inv_scale = 1/scale for scale 0, -0, NaN, inf, -inf.
  for (const double inv : {kInf, -kInf, kNaN, 0.0, -0.0}) {
    for (const bool in_place : {true, false}) {
      SCOPED_TRACE(std::to_string(inv) + (in_place ? " in place" : " out"));
      auto grads = finite_grads(device());
      const auto before = clone_all(grads);
      std::vector<at::Tensor> out;
      if (!in_place)
        for (const auto& g : grads) out.push_back(torch::full(g.sizes(), kNaN, opts()));  // poisoned
      auto found = torch::zeros({1}, opts());
      auto per_tensor = torch::zeros({static_cast<int64_t>(grads.size())}, opts());
      mixprec::non_finite_check_and_unscale_(grads, found, torch::full({1}, inv, opts()), out, per_tensor);
      EXPECT_EQ(found.item<float>(), 1.f);
      EXPECT_TRUE(torch::equal(per_tensor.cpu(), torch::tensor({1.f, 1.f, 0.f, 1.f, 1.f})));
      // The products are still torch's (the step reading them is skipped).
      const auto& written = in_place ? grads : out;
      for (size_t i = 0; i < grads.size(); ++i) {
        const at::Tensor want = (before[i].cpu().to(at::kFloat) * static_cast<float>(inv)).to(written[i].scalar_type());
        EXPECT_TRUE(equal_nan_aware(written[i].cpu(), want)) << "tensor " << i;
      }
    }
  }
}

TEST_P(LossScaleBadScales, FiniteNonZeroInvScalesAndCheckOnlyAreNotFlagged) {
  for (const double inv : {-1.0 / 1024, 1e-45, 0x1p100, 1.0}) {
    SCOPED_TRACE(inv);
    auto grads = finite_grads(device());
    auto found = torch::zeros({1}, opts());
    auto per_tensor = torch::zeros({static_cast<int64_t>(grads.size())}, opts());
    mixprec::non_finite_check_and_unscale_(grads, found, torch::full({1}, inv, opts()), {}, per_tensor);
    EXPECT_EQ(found.item<float>(), 0.f);
    EXPECT_FALSE(per_tensor.any().item<bool>());
  }
  auto found = torch::zeros({1}, opts());
  mixprec::non_finite_check_and_unscale_(finite_grads(device()), found);  // no scale, nothing to test
  EXPECT_EQ(found.item<float>(), 0.f);
}

TEST_P(LossScaleBadScales, TwoHundredOverflowsStopAtTheFloorAndGrowBack) {
  // torch's rule reaches 0 after 180 halvings of 65536; a subnormal min_scale is below the floor.
  for (const double min_scale : {0.0, 1e-40, 0x1p-100}) {
    for (const int64_t hysteresis : {1, 3}) {
      SCOPED_TRACE(std::to_string(min_scale) + " hysteresis " + std::to_string(hysteresis));
      const mixprec::ScaleUpdateOptions o{2.0, 0.5, 1, hysteresis, min_scale, 0.0};
      auto scale = torch::full({1}, 65536.f, opts());
      auto growth = torch::zeros({1}, opts(at::kInt));
      auto hyst = torch::full({1}, static_cast<int32_t>(hysteresis), opts(at::kInt));
      auto skipped = torch::zeros({1}, opts(at::kLong));
      auto found = torch::ones({1}, opts());
      for (int s = 0; s < 200 * hysteresis; ++s) mixprec::update_scale_(scale, growth, found, o, hyst, skipped);
      const float floor = std::max(kFloor, static_cast<float>(min_scale));
      EXPECT_EQ(scale.item<float>(), floor);
      EXPECT_TRUE(std::isfinite(1.f / scale.item<float>()));
      EXPECT_EQ(skipped.item<int64_t>(), 200 * hysteresis);
      found.zero_();
      mixprec::update_scale_(scale, growth, found, o, hyst, skipped);
      EXPECT_EQ(scale.item<float>(), 2 * floor);
    }
  }
}

TEST_P(LossScaleBadScales, NaNScalesStayNaNAndZeroScalesBackOffToTheFloor) {
  for (const float start :
       {std::numeric_limits<float>::quiet_NaN(), 0.f, -0.f, std::numeric_limits<float>::infinity()}) {
    SCOPED_TRACE(start);
    const mixprec::ScaleUpdateOptions o{2.0, 0.5, 2, 2, 0.0, 0.0};
    auto scale = torch::full({1}, start, opts());
    auto growth = torch::zeros({1}, opts(at::kInt));
    auto hyst = torch::full({1}, 2, opts(at::kInt));
    auto found = torch::zeros({1}, opts());
    // Clean steps (growth), then overflows (backoff after two), then clean again.
    for (const double f : {0.0, 0.0, 0.0, 1.0, 1.0, 1.0, kNaN, 0.0, 0.0}) {
      found.fill_(f);
      mixprec::update_scale_(scale, growth, found, o, hyst);
    }
    const float now = scale.item<float>();
    if (std::isnan(start)) {
      EXPECT_TRUE(std::isnan(now));
    } else if (std::isinf(start)) {
      EXPECT_EQ(now, start);
    } else {
      EXPECT_EQ(now, 2 * kFloor);  // two backoffs onto the floor, then one growth
    }
  }
}

}  // namespace
