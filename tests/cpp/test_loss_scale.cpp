// The loss-scaling ops (non_finite_check_and_unscale_, scale_, update_scale_) called through the
// public C++ header on CPU and CUDA, against float64 references, a plain C++ scale-update rule and
// torch's own _amp_* ops.
#include <gtest/gtest.h>
#include <mixprec/ops.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "test_support.h"

namespace {

using namespace mixprec::test;

const at::ScalarType kFloatTypes[] = {at::kFloat, at::kHalf, at::kBFloat16};

// Gradients as a loss scaler sees them: scaled up by ~1000, one per size, dtypes cycling.
std::vector<at::Tensor> make_grads(const std::vector<int64_t>& sizes, const c10::Device& device, int dtype_shift = 0) {
  std::vector<at::Tensor> g;
  for (size_t i = 0; i < sizes.size(); ++i)
    g.push_back(random_tensor({sizes[i]}, kFloatTypes[(i + dtype_shift) % 3], device, 1000.0));
  return g;
}

// A random inverse scale that is not a power of two, so rounding actually happens.
float random_inv_scale(std::mt19937_64& rng) { return 1.f / std::uniform_real_distribution<float>(700.f, 1300.f)(rng); }

// out == in_before * inv within docs/architecture.md's bounds (float64 reference) where the input was
// finite; where it was inf/NaN the output holds the same non-finite product.
void expect_unscaled(const at::Tensor& out, const at::Tensor& in_before, float inv, const std::string& what) {
  const at::Tensor in = in_before.cpu(), o = out.cpu();
  const at::Tensor finite = in.isfinite();
  const at::Tensor ref64 = in.to(at::kDouble) * static_cast<double>(inv);
  const at::Tensor peer = (in.to(at::kFloat) * inv).to(out.scalar_type());  // plain PyTorch
  const at::Tensor r = ref64.masked_select(finite);
  EXPECT_LT(rel_err(o.masked_select(finite), r), error_bound(out.scalar_type(), peer.masked_select(finite), r)) << what;
  EXPECT_TRUE(equal_nan_aware(o.masked_select(~finite).to(at::kDouble), ref64.masked_select(~finite)))
      << what << ": non-finite inputs must stay non-finite with their sign";
}

at::Tensor one_hot(int64_t n, const std::vector<int64_t>& hot, const c10::Device& device) {
  at::Tensor t = torch::zeros({n});
  for (int64_t i : hot) t[i] = 1.f;
  return t.to(device);
}

class LossScale : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(LossScale);

TEST_P(LossScale, UnscaleInPlaceMatchesFloat64Reference) {
  auto rng = host_rng();
  std::vector<at::Tensor> grads = make_grads(boundary_sizes(rng), device());
  // Contiguous views at odd offsets take the unaligned path; base[0] guards against stray writes.
  const at::Tensor base = random_tensor({65537 + 1}, at::kHalf, device(), 1000.0);
  grads.push_back(base.narrow(0, 1, 65537));
  const at::Tensor guard = base[0].clone();
  const auto before = clone_all(grads);
  const float inv = random_inv_scale(rng);
  auto found_inf = torch::zeros({1}, opts());
  auto per_tensor = torch::zeros({static_cast<int64_t>(grads.size())}, opts());
  mixprec::non_finite_check_and_unscale_(grads, found_inf, torch::full({1}, inv, opts()), {}, per_tensor);
  EXPECT_EQ(found_inf.item<float>(), 0.f);
  EXPECT_EQ(per_tensor.count_nonzero().item<int64_t>(), 0);
  for (size_t i = 0; i < grads.size(); ++i)
    expect_unscaled(grads[i], before[i], inv, "grads[" + std::to_string(i) + "]");
  EXPECT_TRUE(bitwise_equal(base[0], guard)) << "wrote before the start of an offset view";
}

TEST_P(LossScale, UnscaleFlagsInfAndNaNAtFirstLastAndRandomPositions) {
  auto rng = host_rng();
  const std::vector<int64_t> sizes{7, 65535, 65537};
  for (double value : {kInf, -kInf, kNaN}) {
    for (int where = 0; where < 3; ++where) {
      std::vector<at::Tensor> grads = make_grads(sizes, device(), where);
      const int64_t t = std::uniform_int_distribution<int64_t>(0, grads.size() - 1)(rng);
      const int64_t pos = first_last_random(grads[t].numel(), rng)[where];
      inject(grads[t], {pos}, value);
      SCOPED_TRACE("value " + std::to_string(value) + " in grads[" + std::to_string(t) + "] at " + std::to_string(pos));
      const auto before = clone_all(grads);
      const float inv = random_inv_scale(rng);
      auto found_inf = torch::zeros({1}, opts());
      auto per_tensor = torch::zeros({static_cast<int64_t>(grads.size())}, opts());
      mixprec::non_finite_check_and_unscale_(grads, found_inf, torch::full({1}, inv, opts()), {}, per_tensor);
      EXPECT_EQ(found_inf.item<float>(), 1.f);
      EXPECT_TRUE(torch::equal(per_tensor, one_hot(grads.size(), {t}, device()))) << per_tensor;
      for (size_t i = 0; i < grads.size(); ++i)
        expect_unscaled(grads[i], before[i], inv, "grads[" + std::to_string(i) + "]");
    }
  }
}

TEST_P(LossScale, UnscaleIntoAnotherDtypeListLeavesGradsAndWritesEveryElement) {
  auto rng = host_rng();
  const std::pair<at::ScalarType, at::ScalarType> pairs[] = {
      {at::kHalf, at::kFloat},  {at::kBFloat16, at::kFloat}, {at::kFloat, at::kHalf},       {at::kFloat, at::kBFloat16},
      {at::kFloat, at::kFloat}, {at::kHalf, at::kHalf},      {at::kBFloat16, at::kBFloat16}};
  const auto sizes = boundary_sizes(rng);
  std::vector<at::Tensor> grads, out;
  for (size_t i = 0; i < sizes.size() + 1; ++i) {
    const auto [in_t, out_t] = pairs[i % std::size(pairs)];
    const int64_t n = i < sizes.size() ? sizes[i] : 4097;
    grads.push_back(random_tensor({n}, in_t, device(), 1000.0));
    // Poisoned: any element the op fails to write stays NaN and fails the error bound.
    out.push_back(torch::full({n}, kNaN, opts(out_t)));
  }
  const at::Tensor out_base = torch::full({4097 + 3}, kNaN, opts(out.back().scalar_type()));
  out.back() = out_base.narrow(0, 3, 4097);  // misaligned destination
  const int64_t bad = std::uniform_int_distribution<int64_t>(0, grads.size() - 1)(rng);
  inject(grads[bad], first_last_random(grads[bad].numel(), rng), kInf);
  const auto before = clone_all(grads);
  const float inv = random_inv_scale(rng);
  auto found_inf = torch::zeros({1}, opts());
  auto per_tensor = torch::zeros({static_cast<int64_t>(grads.size())}, opts());
  mixprec::non_finite_check_and_unscale_(grads, found_inf, torch::full({1}, inv, opts()), out, per_tensor);
  EXPECT_EQ(found_inf.item<float>(), 1.f);
  EXPECT_TRUE(torch::equal(per_tensor, one_hot(grads.size(), {bad}, device())));
  expect_unchanged(grads, before, "grads");
  for (size_t i = 0; i < grads.size(); ++i) expect_unscaled(out[i], before[i], inv, "out[" + std::to_string(i) + "]");
  EXPECT_TRUE(out_base.narrow(0, 0, 3).isnan().all().item<bool>()) << "wrote before the start of an offset view";
}

TEST_P(LossScale, OutWithoutInvScaleIsAPlainConversion) {
  std::vector<at::Tensor> grads = make_grads({65537, 333, 65536}, device());
  std::vector<at::Tensor> out{torch::full({65537}, kNaN, opts(at::kHalf)), torch::full({333}, kNaN, opts(at::kFloat)),
                              torch::full({65536}, kNaN, opts(at::kBFloat16))};
  auto found_inf = torch::zeros({1}, opts());
  mixprec::non_finite_check_and_unscale_(grads, found_inf, std::nullopt, out);
  EXPECT_EQ(found_inf.item<float>(), 0.f);
  for (size_t i = 0; i < out.size(); ++i)
    EXPECT_TRUE(bitwise_equal(out[i], grads[i].to(out[i].scalar_type()))) << "out[" << i << "]";
}

TEST_P(LossScale, CheckOnlyLeavesDataBitwiseUnchanged) {
  auto rng = host_rng();
  std::vector<at::Tensor> grads = make_grads(boundary_sizes(rng), device());
  const int64_t n = grads.size();
  inject(grads[1], {0}, kNaN);
  inject(grads[3], {grads[3].numel() - 1}, kInf);
  inject(grads[n - 1], {first_last_random(grads[n - 1].numel(), rng)[2]}, -kInf);
  const auto before = clone_all(grads);
  auto found_inf = torch::zeros({1}, opts());
  auto per_tensor = torch::zeros({n}, opts());
  mixprec::non_finite_check_and_unscale_(grads, found_inf, std::nullopt, {}, per_tensor);
  EXPECT_EQ(found_inf.item<float>(), 1.f);
  EXPECT_TRUE(torch::equal(per_tensor, one_hot(n, {1, 3, n - 1}, device()))) << per_tensor;
  expect_unchanged(grads, before, "grads");

  // Clean data never clears a flag an earlier call set (several calls share one found_inf).
  std::vector<at::Tensor> clean = make_grads({65537, 10}, device());
  const auto clean_before = clone_all(clean);
  auto zero = torch::zeros({1}, opts());
  mixprec::non_finite_check_and_unscale_(clean, zero);
  mixprec::non_finite_check_and_unscale_(clean, found_inf, torch::full({1}, 0.5f, opts()));
  EXPECT_EQ(zero.item<float>(), 0.f);
  EXPECT_EQ(found_inf.item<float>(), 1.f);
  EXPECT_TRUE(bitwise_equal(clean[0], clean_before[0] * 0.5));
}

TEST_P(LossScale, ScaleMultipliesInPlace) {
  auto rng = host_rng();
  std::vector<at::Tensor> ts = make_grads(boundary_sizes(rng), device());
  inject(ts[2], {0}, kInf);  // scale_ does not check: inf just stays inf
  const auto before = clone_all(ts);
  const float s = random_inv_scale(rng) * 1000.f;
  mixprec::scale_(ts, torch::full({1}, s, opts()));
  for (size_t i = 0; i < ts.size(); ++i) expect_unscaled(ts[i], before[i], s, "tensors[" + std::to_string(i) + "]");
}

TEST_P(LossScale, UnscaleEqualsTorchAmpForeachNonFiniteCheckAndUnscale) {
  auto rng = host_rng();
  for (bool with_bad : {false, true}) {
    std::vector<at::Tensor> ours = make_grads(boundary_sizes(rng), device());
    if (with_bad) {
      inject(ours[0], {0}, kNaN);
      inject(ours[4], {ours[4].numel() - 1}, -kInf);
    }
    std::vector<at::Tensor> theirs = clone_all(ours);
    const auto inv = torch::full({1}, random_inv_scale(rng), opts());
    auto found_ours = torch::zeros({1}, opts()), found_theirs = torch::zeros({1}, opts());
    mixprec::non_finite_check_and_unscale_(ours, found_ours, inv);
    // One call per tensor: torch's op takes any dtype mix then, on every version and device. Its
    // CUDA kernel has no bf16 (torch 2.11): there the peer is torch's op on an fp32 copy, rounded
    // back, which is what its CPU bf16 path computes (fp32 math, one rounding).
    for (auto& t : theirs) {
      if (t.scalar_type() == at::kBFloat16 && t.is_cuda()) {
        auto wide = t.to(at::kFloat);
        at::_amp_foreach_non_finite_check_and_unscale_({wide}, found_theirs, inv);
        t.copy_(wide);
      } else {
        at::_amp_foreach_non_finite_check_and_unscale_({t}, found_theirs, inv);
      }
    }
    EXPECT_TRUE(bitwise_equal(found_ours, found_theirs)) << "with_bad " << with_bad;
    for (size_t i = 0; i < ours.size(); ++i) EXPECT_TRUE(equal_nan_aware(ours[i], theirs[i])) << "grads[" << i << "]";
  }
}

TEST_P(LossScale, EmptyListsAndZeroSizeTensors) {
  auto found_inf = torch::zeros({1}, opts());
  const auto inv = torch::full({1}, 0.5f, opts());
  mixprec::non_finite_check_and_unscale_({}, found_inf, inv);
  mixprec::non_finite_check_and_unscale_({}, found_inf);
  mixprec::scale_({}, inv);
  EXPECT_EQ(found_inf.item<float>(), 0.f);

  std::vector<at::Tensor> grads{torch::empty({0}, opts()), torch::empty({4, 0}, opts(at::kHalf)),
                                random_tensor({100}, at::kBFloat16, device()), torch::empty({0}, opts(at::kBFloat16))};
  std::vector<at::Tensor> out{torch::empty({0}, opts(at::kHalf)), torch::empty({4, 0}, opts()),
                              torch::full({100}, kNaN, opts()), torch::empty({0}, opts())};
  inject(grads[2], {99}, kInf);
  const auto before = clone_all(grads);
  for (int mode = 0; mode < 3; ++mode) {  // check only, into out, in place
    auto found = torch::zeros({1}, opts());
    auto per_tensor = torch::zeros({4}, opts());
    mixprec::non_finite_check_and_unscale_(grads, found, mode > 0 ? std::optional<at::Tensor>(inv) : std::nullopt,
                                           mode == 1 ? at::TensorList(out) : at::TensorList(), per_tensor);
    EXPECT_EQ(found.item<float>(), 1.f) << "mode " << mode;
    EXPECT_TRUE(torch::equal(per_tensor, one_hot(4, {2}, device()))) << "mode " << mode;
    if (mode == 0) expect_unchanged(grads, before, "grads");
    if (mode == 1) expect_unscaled(out[2], before[2], 0.5f, "out[2]");
  }
  expect_unscaled(grads[2], before[2], 0.5f, "grads[2]");

  std::vector<at::Tensor> all_empty{torch::empty({0}, opts()), torch::empty({0, 3}, opts(at::kHalf))};
  auto found = torch::zeros({1}, opts());
  mixprec::non_finite_check_and_unscale_(all_empty, found, inv);
  EXPECT_EQ(found.item<float>(), 0.f);
}

TEST_P(LossScale, MoreTensorsThanOneLaunchTableHolds) {
  // One dtype per list so that each call is a single group larger than one launch's table
  // (~830 tensors with 2 lists, ~1090 with 1).
  auto rng = host_rng();
  std::uniform_int_distribution<int64_t> size(1, 700);
  for (int mode = 0; mode < 3; ++mode) {  // fp16 -> fp32 out, fp32 in place, fp32 check only
    std::vector<at::Tensor> grads, out;
    for (int i = 0; i < 1200; ++i) {
      const int64_t n = size(rng);
      grads.push_back(random_tensor({n}, mode == 0 ? at::kHalf : at::kFloat, device(), 1000.0));
      if (mode == 0) out.push_back(torch::full({n}, kNaN, opts()));
    }
    const int64_t mid = std::uniform_int_distribution<int64_t>(1, 1198)(rng);
    inject(grads[mid], {0}, kNaN);
    inject(grads[1199], {grads[1199].numel() - 1}, kInf);
    const auto before = clone_all(grads);
    const float inv = random_inv_scale(rng);
    auto found = torch::zeros({1}, opts());
    auto per_tensor = torch::zeros({1200}, opts());
    const auto inv_scale = mode < 2 ? std::optional<at::Tensor>(torch::full({1}, inv, opts())) : std::nullopt;
    mixprec::non_finite_check_and_unscale_(grads, found, inv_scale, out, per_tensor);
    EXPECT_EQ(found.item<float>(), 1.f) << "mode " << mode;
    EXPECT_TRUE(torch::equal(per_tensor, one_hot(1200, {mid, 1199}, device()))) << "mode " << mode;
    const auto& written = mode == 0 ? out : grads;
    if (mode == 2) expect_unchanged(grads, before, "grads");
    else
      EXPECT_LT(rel_err(at::cat(written).masked_select(at::cat(before).isfinite()),
                        at::cat(before).to(at::kDouble).masked_select(at::cat(before).isfinite()) * inv),
                mode == 0 ? 1e-6 : 1e-5)
          << "mode " << mode;
  }
}

TEST_P(LossScale, UnscaleErrorsNameOpArgumentAndIndexAndModifyNothing) {
  const char* op = "mixprec::non_finite_check_and_unscale_";
  std::vector<at::Tensor> grads = make_grads({65537, 100, 3000}, device());
  std::vector<at::Tensor> out{torch::zeros({65537}, opts()), torch::zeros({100}, opts()), torch::zeros({3000}, opts())};
  inject(grads[0], {5}, kInf);  // a call that got through would set found_inf and per_tensor_found
  auto found = torch::zeros({1}, opts());
  auto inv = torch::full({1}, 0.5f, opts());
  auto per_tensor = torch::zeros({3}, opts());
  const auto run = [&](std::vector<at::Tensor> g, std::vector<at::Tensor> o, at::Tensor f, at::Tensor s, at::Tensor pt,
                       const std::vector<std::string>& needles) {
    SCOPED_TRACE(needles.back());
    std::vector<at::Tensor> all = g;
    all.insert(all.end(), o.begin(), o.end());
    for (const auto& t : {found, inv, per_tensor, f, s, pt}) all.push_back(t);
    const auto before = clone_all(all);
    std::vector<std::string> n{op};
    n.insert(n.end(), needles.begin(), needles.end());
    expect_c10_error([&] { mixprec::non_finite_check_and_unscale_(g, f, s, o, pt); }, n);
    expect_unchanged(all, before, "argument");
  };
  const auto with = [](std::vector<at::Tensor> v, size_t i, at::Tensor t) {
    v[i] = t;
    return v;
  };
  const std::vector<at::Tensor> short_out(out.begin(), out.begin() + 2);
  run(grads, short_out, found, inv, per_tensor, {"out"});
  run(with(grads, 2, torch::ones({3000}, opts(at::kDouble))), out, found, inv, per_tensor, {"grads[2]"});
  run(with(grads, 2, torch::ones({3000}, opts(at::kInt))), out, found, inv, per_tensor, {"grads[2]"});
  run(with(grads, 1, torch::ones({10, 20}, opts()).t()), with(out, 1, torch::zeros({20, 10}, opts())), found, inv,
      per_tensor, {"grads[1]", "contiguous"});
  run(grads, with(out, 2, torch::zeros({2999}, opts())), found, inv, per_tensor, {"out[2]"});
  run(grads, with(out, 2, torch::zeros({3000}, opts(at::kDouble))), found, inv, per_tensor, {"out[2]"});
  run(grads, out, torch::zeros({1}, opts(at::kDouble)), inv, per_tensor, {"found_inf"});
  run(grads, out, torch::zeros({2}, opts()), inv, per_tensor, {"found_inf"});
  run(grads, out, found, torch::full({1}, 0.5, opts(at::kHalf)), per_tensor, {"inv_scale"});
  run(grads, out, found, torch::full({2}, 0.5, opts()), per_tensor, {"inv_scale"});
  run(grads, out, found, inv, torch::zeros({2}, opts()), {"per_tensor_found"});
  run(grads, out, found, inv, torch::zeros({3}, opts(at::kDouble)), {"per_tensor_found"});
  if (device().is_cuda()) {
    const auto cpu = at::TensorOptions().dtype(at::kFloat);
    run(with(grads, 2, grads[2].cpu()), out, found, inv, per_tensor, {"grads[2]"});
    run(grads, with(out, 1, torch::zeros({100}, cpu)), found, inv, per_tensor, {"out[1]"});
    run(grads, out, found, torch::full({1}, 0.5f, cpu), per_tensor, {"inv_scale"});
    run(grads, out, found, inv, torch::zeros({3}, cpu), {"per_tensor_found"});
  }
}

// ---- update_scale_ ------------------------------------------------------------------------------

// The documented rule in plain C++, computed in double and stored as the op stores it (float
// scale, int32 trackers). Factors are float-representable, so float or double math agree exactly.
struct RefScaler {
  mixprec::ScaleUpdateOptions o;
  float scale;
  int32_t growth = 0, hysteresis_left;
  int64_t skipped = 0;
  int growths = 0, backoffs = 0, tolerated = 0, min_clamps = 0, max_clamps = 0, inf_blocked = 0;

  RefScaler(const mixprec::ScaleUpdateOptions& opt, float s) : o(opt), scale(s), hysteresis_left(opt.hysteresis) {}

  void step(bool overflow) {
    if (overflow) {
      ++skipped;
      growth = 0;
      if (--hysteresis_left > 0) {
        ++tolerated;
        return;
      }
      const double backed = static_cast<double>(scale) * o.backoff_factor;
      if (backed < o.min_scale) ++min_clamps;
      // Never below 2^-126 (the smallest normal float32); NaN stays NaN.
      if (!std::isnan(scale)) scale = static_cast<float>(std::max({backed, o.min_scale, 0x1p-126}));
      hysteresis_left = static_cast<int32_t>(o.hysteresis);
      ++backoffs;
      return;
    }
    if (++growth < o.growth_interval) return;
    double grown = static_cast<double>(scale) * o.growth_factor;
    if (o.max_scale > 0 && grown > o.max_scale) {
      grown = o.max_scale;
      ++max_clamps;
    }
    if (std::isfinite(static_cast<float>(grown))) {
      scale = static_cast<float>(grown);
      ++growths;
    } else {
      ++inf_blocked;
    }
    growth = 0;
    hysteresis_left = static_cast<int32_t>(o.hysteresis);
  }
};

// Overflow patterns in bursts: clean runs up to twice the growth interval, overflow runs up to
// one more than the hysteresis, so every rule is reached.
std::vector<bool> overflow_pattern(std::mt19937_64& rng, int64_t steps, int64_t interval, int64_t hysteresis) {
  std::vector<bool> p;
  std::uniform_int_distribution<int64_t> clean(0, 2 * interval), bad(1, hysteresis + 1);
  while (static_cast<int64_t>(p.size()) < steps) {
    p.insert(p.end(), clean(rng), false);
    p.insert(p.end(), bad(rng), true);
  }
  p.resize(steps);
  return p;
}

float random_factor(std::mt19937_64& rng, float lo, float hi) {
  return std::uniform_real_distribution<float>(lo, hi)(rng);
}

TEST_P(LossScale, UpdateScaleFollowsTheRuleComputedInDouble) {
  auto rng = host_rng();
  struct Config {
    mixprec::ScaleUpdateOptions o;
    float init;
    bool tracker;
  };
  const float g = random_factor(rng, 1.1f, 3.f), b = random_factor(rng, 0.3f, 0.9f);
  const std::vector<Config> configs{
      {{2.0, 0.5, 3, 1, 0.0, 0.0}, 65536.f, false},
      {{g, b, 4, 3, 0.0, 0.0}, 1024.f, true},
      {{2.0, 0.5, 2, 2, 1.0, 0.0}, 8.f, true},                 // backs off onto min_scale
      {{g, b, 1, 1, 0.0, 70000.5}, 1000.f, false},             // grows onto max_scale
      {{4.0, b, 1, 2, 0.0, 0.0}, std::ldexp(1.f, 124), true},  // would grow into inf
  };
  for (size_t c = 0; c < configs.size(); ++c) {
    const Config& cfg = configs[c];
    SCOPED_TRACE("config " + std::to_string(c));
    RefScaler ref(cfg.o, cfg.init);
    auto scale = torch::full({1}, cfg.init, opts());
    auto growth = torch::zeros({1}, opts(at::kInt));
    auto hyst = torch::full({1}, static_cast<int32_t>(cfg.o.hysteresis), opts(at::kInt));
    auto skipped = torch::zeros({1}, opts(at::kLong));
    auto found = torch::zeros({1}, opts());
    int64_t steps = 0;
    const auto step = [&](bool overflow) {
      found.fill_(overflow ? 1.f : 0.f);
      mixprec::update_scale_(scale, growth, found, cfg.o, cfg.tracker ? std::optional<at::Tensor>(hyst) : std::nullopt,
                             skipped);
      ref.step(overflow);
      EXPECT_EQ(scale.item<float>(), ref.scale) << "step " << steps;
      EXPECT_EQ(growth.item<int32_t>(), ref.growth) << "step " << steps;
      if (cfg.tracker) {
        EXPECT_EQ(hyst.item<int32_t>(), ref.hysteresis_left) << "step " << steps;
      }
      EXPECT_EQ(skipped.item<int64_t>(), ref.skipped) << "step " << steps;
      EXPECT_EQ(found.item<float>(), overflow ? 1.f : 0.f) << "found_inf is read-only";
      ++steps;
    };
    for (bool overflow : overflow_pattern(rng, 100, cfg.o.growth_interval, cfg.o.hysteresis)) {
      step(overflow);
      if (HasFailure()) return;
    }
    // Then drive the state until each rule this config is there for has fired at least once.
    const auto drive = [&](bool overflow, const std::function<bool()>& done) {
      for (int k = 0; k < 4000 && !done() && !HasFailure(); ++k) step(overflow);
    };
    drive(true, [&] { return ref.backoffs > 0; });
    if (cfg.o.hysteresis > 1) drive(true, [&] { return ref.tolerated > 0; });
    if (cfg.o.min_scale > 0) drive(true, [&] { return ref.min_clamps > 0; });
    if (cfg.o.max_scale > 0) drive(false, [&] { return ref.max_clamps > 0; });
    if (c == 4) drive(false, [&] { return ref.inf_blocked > 0; });
    drive(false, [&] { return ref.growths + ref.inf_blocked > 0; });  // near inf every growth may be blocked
    EXPECT_GT(ref.backoffs, 0);
    EXPECT_GT(c == 4 ? ref.growths + ref.inf_blocked : ref.growths, 0);
    if (cfg.o.hysteresis > 1) {
      EXPECT_GT(ref.tolerated, 0);
    }
    if (cfg.o.min_scale > 0) {
      EXPECT_GT(ref.min_clamps, 0);
    }
    if (cfg.o.max_scale > 0) {
      EXPECT_GT(ref.max_clamps, 0);
    }
    if (c == 4) {
      EXPECT_GT(ref.inf_blocked, 0);
    }
  }
  // Not exercised by the random bursts above: growth blocked at inf must keep the scale finite.
  auto scale = torch::full({1}, std::numeric_limits<float>::max(), opts());
  auto growth = torch::zeros({1}, opts(at::kInt));
  mixprec::update_scale_(scale, growth, torch::zeros({1}, opts()), {2.0, 0.5, 1});
  EXPECT_EQ(scale.item<float>(), std::numeric_limits<float>::max());
  EXPECT_EQ(growth.item<int32_t>(), 0);
}

TEST_P(LossScale, UpdateScaleEqualsTorchAmpUpdateScale) {
  auto rng = host_rng();
  for (int trial = 0; trial < 3; ++trial) {
    const mixprec::ScaleUpdateOptions o{trial == 0 ? 2.0 : random_factor(rng, 1.1f, 4.f),
                                        trial == 0 ? 0.5 : random_factor(rng, 0.3f, 0.95f),
                                        std::uniform_int_distribution<int64_t>(1, 5)(rng)};
    const float init = trial == 2 ? std::ldexp(1.f, 120) : 65536.f;  // trial 2 meets the inf guard
    auto ours = torch::full({1}, init, opts()), theirs = ours.clone();
    auto ours_gt = torch::zeros({1}, opts(at::kInt)), theirs_gt = ours_gt.clone();
    auto found = torch::zeros({1}, opts());
    const auto pattern = overflow_pattern(rng, 100, o.growth_interval, 1);
    for (size_t s = 0; s < pattern.size(); ++s) {
      found.fill_(pattern[s] ? 1.f : 0.f);
      mixprec::update_scale_(ours, ours_gt, found, o);
      at::_amp_update_scale_(theirs, theirs_gt, found, o.growth_factor, o.backoff_factor, o.growth_interval);
      theirs.clamp_min_(0x1p-126);  // torch's rule with mixprec's floor
      ASSERT_TRUE(bitwise_equal(ours, theirs)) << "trial " << trial << " step " << s << ": " << ours << theirs;
      ASSERT_TRUE(torch::equal(ours_gt, theirs_gt)) << "trial " << trial << " step " << s;
    }
  }
}

TEST_P(LossScale, UpdateScaleErrorsNameOpAndArgumentAndModifyNothing) {
  const auto i32 = opts(at::kInt);
  auto scale = torch::full({1}, 1024.f, opts());
  auto growth = torch::full({1}, 3, i32);
  auto hyst = torch::full({1}, 2, i32);
  auto skipped = torch::full({1}, 5, opts(at::kLong));
  auto found = torch::ones({1}, opts());  // a call that got through would change every state
  const auto run = [&](at::Tensor sc, at::Tensor gt, std::optional<at::Tensor> ht, std::optional<at::Tensor> sk,
                       at::Tensor f, mixprec::ScaleUpdateOptions o, const std::string& arg) {
    SCOPED_TRACE(arg);
    std::vector<at::Tensor> all{scale, growth, hyst, skipped, found, sc, gt, f};
    const auto before = clone_all(all);
    expect_c10_error([&] { mixprec::update_scale_(sc, gt, f, o, ht, sk); }, {"mixprec::update_scale_", arg});
    expect_unchanged(all, before, "state");
  };
  const mixprec::ScaleUpdateOptions ok{2.0, 0.5, 10, 2, 1.0, 65536.0};
  const auto with = [&](auto set) {
    mixprec::ScaleUpdateOptions o = ok;
    set(o);
    return o;
  };
  run(scale, growth, hyst, skipped, found, with([](auto& o) { o.growth_factor = 0; }), "growth_factor");
  run(scale, growth, hyst, skipped, found, with([](auto& o) { o.growth_factor = kNaN; }), "growth_factor");
  run(scale, growth, hyst, skipped, found, with([](auto& o) { o.backoff_factor = -0.5; }), "backoff_factor");
  run(scale, growth, hyst, skipped, found, with([](auto& o) { o.growth_interval = 0; }), "growth_interval");
  run(scale, growth, hyst, skipped, found, with([](auto& o) { o.hysteresis = 0; }), "hysteresis");
  run(scale, growth, std::nullopt, skipped, found, ok, "hysteresis_tracker");
  run(scale, growth, hyst, skipped, found, with([](auto& o) { o.min_scale = -1; }), "min_scale");
  run(scale, growth, hyst, skipped, found, with([](auto& o) { o.max_scale = 0.5; }), "max_scale");
  run(scale, growth, hyst, skipped, found, with([](auto& o) { o.max_scale = kNaN; }), "max_scale");
  run(torch::full({1}, 1024.0, opts(at::kDouble)), growth, hyst, skipped, found, ok, "scale");
  run(torch::full({2}, 1024.f, opts()), growth, hyst, skipped, found, ok, "scale");
  run(scale, torch::full({1}, 3.f, opts()), hyst, skipped, found, ok, "growth_tracker");
  run(scale, growth, torch::full({1}, 2L, opts(at::kLong)), skipped, found, ok, "hysteresis_tracker");
  run(scale, growth, hyst, torch::full({1}, 5, i32), found, ok, "skipped_steps");
  run(scale, growth, hyst, skipped, torch::ones({1}, opts(at::kDouble)), ok, "found_inf");
  run(scale, growth, hyst, skipped, torch::ones({3}, opts()), ok, "found_inf");
  if (device().is_cuda()) {
    run(scale, growth.cpu(), hyst, skipped, found, ok, "growth_tracker");
    run(scale, growth, hyst, skipped, found.cpu(), ok, "found_inf");
    run(scale, growth, hyst.cpu(), skipped, found, ok, "hysteresis_tracker");
  }
}

}  // namespace
