// Misuse of mixprec::amp::GradScaler and bad scales (issue 20): options, update(new_scale) and
// checkpoints refused by name and changing nothing; a scale of 0, NaN, inf or a tiny subnormal
// never reaches the weights of a fused or a torch::optim optimizer, and update() then backs off
// to the 2^-126 floor (NaN stays NaN, inf stays inf).
#include <gtest/gtest.h>
#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "api_support.h"
#include "test_support.h"

namespace {

using namespace mixprec::test;
using namespace mixprec::test::api;
using mixprec::amp::GradScaler;
using mixprec::amp::GradScalerOptions;
using mixprec::optim::FusedAdamW;
using mixprec::optim::FusedAdamWOptions;

constexpr double kFloor = 1.1754943508222875e-38;  // 2^-126, the smallest normal float32

at::Tensor a_loss(const c10::Device& device) { return torch::ones({}, at::TensorOptions().device(device)); }

// The scaler's observable state (reads the device).
struct ScalerState {
  double scale;
  int64_t growth, skipped;
  explicit ScalerState(const GradScaler& s)
      : scale(s.get_scale()), growth(s.growth_tracker()), skipped(s.skipped_steps()) {}
  void expect_same(const GradScaler& s) const {
    EXPECT_TRUE(s.get_scale() == scale || (std::isnan(scale) && std::isnan(s.get_scale())));
    EXPECT_EQ(s.growth_tracker(), growth);
    EXPECT_EQ(s.skipped_steps(), skipped);
  }
};

class ApiGradScalerMisuse : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(ApiGradScalerMisuse);

TEST_P(ApiGradScalerMisuse, BadOptionsAreRefusedNamingTheOptionAndWhatIsExpected) {
  using O = GradScalerOptions;
  const std::vector<std::pair<O, std::vector<std::string>>> cases = {
      {O().init_scale(0.0), {"invalid init_scale 0;", "expected a normal float32 in [2^-126, 3.4028235e+38]"}},
      {O().init_scale(1e-40), {"invalid init_scale 1e-40;"}},  // a float32 subnormal: 1/scale is inf
      {O().init_scale(1e39), {"invalid init_scale 1e+39;"}},   // inf as a float32
      {O().init_scale(-2.0), {"invalid init_scale -2;"}},
      {O().init_scale(kNaN), {"invalid init_scale nan;"}},
      {O().init_scale(kInf), {"invalid init_scale inf;"}},
      {O().growth_factor(1.0), {"invalid growth_factor 1;", "finite number > 1"}},
      {O().growth_factor(kInf), {"invalid growth_factor inf;"}},
      {O().growth_factor(kNaN), {"invalid growth_factor nan;"}},
      {O().backoff_factor(1.0), {"invalid backoff_factor 1;", "in (0, 1)"}},
      {O().backoff_factor(0.0), {"invalid backoff_factor 0;"}},
      {O().backoff_factor(kNaN), {"invalid backoff_factor nan;"}},
      {O().growth_interval(0), {"invalid growth_interval 0;", "[1, 2^31 - 1]"}},
      {O().growth_interval(int64_t{1} << 31), {"invalid growth_interval 2147483648;"}},
      {O().hysteresis(0), {"invalid hysteresis 0;"}},
      {O().hysteresis(int64_t{1} << 31), {"invalid hysteresis 2147483648;"}},
      {O().min_scale(-1.0), {"invalid min_scale -1;", "finite float32 >= 0"}},
      {O().min_scale(kNaN), {"invalid min_scale nan;"}},
      {O().min_scale(kInf), {"invalid min_scale inf;"}},
      {O().max_scale(0.0), {"invalid max_scale 0;", "normal float32"}},
      {O().max_scale(kInf), {"invalid max_scale inf;"}},
      {O().max_scale(kNaN), {"invalid max_scale nan;"}},
      {O().min_scale(4.0).max_scale(2.0).init_scale(3.0), {"invalid max_scale 2;", ">= min_scale (4)"}},
      {O().init_scale(1.0).min_scale(2.0), {"invalid init_scale 1;", ">= min_scale (2)"}},
      {O().max_scale(1024.0), {"invalid init_scale 65536;", "<= max_scale (1024)"}},
  };
  for (const auto& c : cases) {
    auto needles = c.second;
    needles.push_back("mixprec::amp::GradScaler");
    expect_c10_error([&] { GradScaler s(c.first); }, needles);
  }
  // The bounds themselves are fine.
  GradScaler ok(O().init_scale(2.0).min_scale(2.0).max_scale(2.0).growth_interval((int64_t{1} << 31) - 1));
  EXPECT_EQ(ok.get_scale(), 2.0);
}

TEST_P(ApiGradScalerMisuse, UpdateWithABadNewScaleChangesNothing) {
  auto ps = make_params({{9}}, at::kFloat, device());
  FusedAdamW opt(ps, FusedAdamWOptions(0.01));
  GradScaler scaler(GradScalerOptions().init_scale(256.0).growth_interval(1));
  scaler.scale(a_loss(device()));
  set_grads(ps, random_grads(ps, 256.0));
  inject(ps[0].grad(), {3}, kInf);  // this iteration overflows: update() must still count it
  scaler.step(opt);
  const ScalerState before(scaler);
  for (const double bad : {kNaN, kInf, -kInf, 0.0, -0.0, -8.0, 1e-40, 1e39}) {
    expect_c10_error([&] { scaler.update(bad); },
                     {"mixprec::amp::GradScaler.update: invalid new_scale", "expected a normal float32"});
    before.expect_same(scaler);
  }
  scaler.update(64.0);  // the iteration's record survived the refusals
  EXPECT_EQ(scaler.get_scale(), 64.0);
  EXPECT_EQ(scaler.skipped_steps(), before.skipped + 1);

  // Outside the scaler's own bounds.
  GradScaler bounded(GradScalerOptions().init_scale(256.0).min_scale(16.0).max_scale(1024.0));
  bounded.scale(a_loss(device()));
  expect_c10_error([&] { bounded.update(2048.0); },
                   {"GradScaler.update: invalid new_scale 2048;", "<= max_scale (1024)"});
  expect_c10_error([&] { bounded.update(8.0); }, {"GradScaler.update: invalid new_scale 8;", ">= min_scale (16)"});
  EXPECT_EQ(bounded.get_scale(), 256.0);
}

std::string scaler_checkpoint(double scale, int64_t growth, int64_t hysteresis_tracker, double max_scale) {
  torch::serialize::OutputArchive a;
  a.write("scale", c10::IValue(scale));
  a.write("growth_factor", c10::IValue(2.0));
  a.write("backoff_factor", c10::IValue(0.5));
  a.write("growth_interval", c10::IValue(int64_t{10}));
  a.write("_growth_tracker", c10::IValue(growth));
  a.write("hysteresis", c10::IValue(int64_t{2}));
  a.write("_hysteresis_tracker", c10::IValue(hysteresis_tracker));
  a.write("max_scale", c10::IValue(max_scale));
  a.write("_skipped_steps", c10::IValue(int64_t{0}));
  std::ostringstream os;
  a.save_to(os);
  return os.str();
}

TEST_P(ApiGradScalerMisuse, CheckpointsOutOfRangeAreRefusedAndChangeNothing) {
  GradScaler s(GradScalerOptions().init_scale(512.0).growth_interval(7));
  s.scale(a_loss(device()));  // device state exists: a load would fill it
  const ScalerState before(s);
  const int64_t big = int64_t{1} << 31;
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {scaler_checkpoint(8.0, big, 1, 1e6), {"'_growth_tracker' must be in [0, 2^31 - 1]"}},
      {scaler_checkpoint(8.0, 0, 3, 1e6), {"'_hysteresis_tracker' must be in [0, hysteresis = 2], got 3"}},
      {scaler_checkpoint(1e-40, 0, 1, 1e6), {"invalid init_scale 1e-40;"}},
      {scaler_checkpoint(4096.0, 0, 1, 1024.0), {"invalid init_scale 4096;", "<= max_scale (1024)"}},
      {scaler_checkpoint(kNaN, 0, 1, 1e6), {"invalid init_scale nan;"}},
  };
  for (const auto& c : cases) {
    auto needles = c.second;
    needles.push_back("mixprec::amp::GradScaler.load");
    expect_c10_error([&] { load_from_string(s, c.first); }, needles);
    before.expect_same(s);
    EXPECT_EQ(s.options().growth_interval(), 7);
    EXPECT_FALSE(s.options().max_scale().has_value());
  }
  load_from_string(s, scaler_checkpoint(8.0, 3, 1, 1e6));  // in range: loads
  EXPECT_EQ(s.get_scale(), 8.0);
  EXPECT_EQ(s.growth_tracker(), 3);
}

// One iteration whose scale was spoiled after backward: grads are finite (as they are when the
// scale turns bad between scale() and step()), so only the scale can tell the step is bad.
template <class Opt, class Snapshot>
void expect_bad_scale_skips(Opt& opt, const std::vector<at::Tensor>& ps, const c10::Device& device, double bad,
                            const Snapshot& snapshot) {
  GradScaler scaler(GradScalerOptions().init_scale(1024.0).growth_interval(1));
  scaler.scale(a_loss(device));
  set_grads(ps, random_grads(ps, 1024.0));
  scaler.step(opt);  // a good step first, so the optimizer has state to protect
  scaler.update();
  scaler.scale(a_loss(device));
  set_grads(ps, random_grads(ps));
  scaler.scale_tensor().fill_(bad);
  const auto before = clone_all(snapshot());
  scaler.step(opt);
  expect_unchanged(snapshot(), before, "after a step with scale " + std::to_string(bad));
  scaler.update();
  const double want = std::isnan(bad) || std::isinf(bad) ? bad : kFloor;  // the floor, even from 0
  EXPECT_TRUE(scaler.get_scale() == want || (std::isnan(want) && std::isnan(scaler.get_scale())))
      << "scale " << bad << " became " << scaler.get_scale();
  EXPECT_EQ(scaler.skipped_steps(), 1);
}

TEST_P(ApiGradScalerMisuse, ZeroNaNInfOrSubnormalScalesNeverReachTheWeights) {
  // 1e-40 is a float32 subnormal whose inverse overflows float32; -4 would negate the update.
  for (const double bad : {0.0, -0.0, kNaN, kInf, 1e-40, -4.0}) {
    SCOPED_TRACE(bad);
    auto ps = make_params({{65537}, {7}}, at::kFloat, device());
    FusedAdamW fused(ps, FusedAdamWOptions(0.01));
    expect_bad_scale_skips(fused, ps, device(), bad, [&] { return all_state(fused); });
    auto qs = make_params({{65537}, {7}}, at::kFloat, device());
    torch::optim::SGD plain(qs, torch::optim::SGDOptions(0.1).momentum(0.9));
    expect_bad_scale_skips(plain, qs, device(), bad, [&] {
      std::vector<at::Tensor> out;
      for (const auto& q : qs) out.push_back(q.detach());
      return out;
    });
  }
}

}  // namespace
