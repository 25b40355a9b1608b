// FusedSGD, FusedAdagrad, FusedLAMB and FusedNovoGrad through the C++ API: results against
// torch::optim::SGD/Adagrad run in float64 and against float64 transcriptions of the LAMB and
// NovoGrad rules (csrc/kernels/lamb.h, novograd.h); for each family also master weights, a skipped
// step and a checkpoint round trip. Each class calls the same op with the same arguments as its
// Python twin in python/mixprec/optimizers/. A family whose op has no kernel yet is skipped.
#include <gtest/gtest.h>
#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <memory>
#include <sstream>

#include "test_support.h"

namespace {

using namespace mixprec::test;
using namespace mixprec::optim;

// The ops of the families are written alongside this API; until one has a kernel for the
// device, its tests skip rather than fail.
bool has_kernel(const char* op, c10::DeviceType device) {
  const auto handle = c10::Dispatcher::singleton().findSchema({op, ""});
  if (!handle) return false;
  return handle->hasKernelForDispatchKey(device == c10::kCUDA ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU);
}

#define SKIP_WITHOUT_KERNEL(op)                                                                           \
  do {                                                                                                    \
    if (!has_kernel("mixprec::" op, GetParam()))                                                          \
      GTEST_SKIP() << "mixprec::" op " has no kernel for this device yet: its C++ optimizer is untested"; \
  } while (0)

std::vector<at::Tensor> make_params(const std::vector<std::vector<int64_t>>& sh, at::ScalarType dtype,
                                    const c10::Device& device) {
  std::vector<at::Tensor> ps;
  for (const auto& s : sh) ps.push_back(random_tensor(s, dtype, device).requires_grad_(true));
  return ps;
}

std::vector<std::vector<int64_t>> shapes(std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> small(2, 3000);
  return {{7}, {65537}, {small(rng)}, {21, 13}};
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& ps, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().to(dtype).clone().requires_grad_(true));
  return out;
}

std::vector<at::Tensor> random_grads(const std::vector<at::Tensor>& ps, at::ScalarType dtype) {
  std::vector<at::Tensor> gs;
  for (const auto& p : ps) gs.push_back(random_tensor(p.sizes(), dtype, p.device()));
  return gs;
}

void set_grads(const std::vector<at::Tensor>& ps, const std::vector<at::Tensor>& gs) {
  for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = gs[i].to(ps[i].scalar_type());
}

using Factory = std::function<std::unique_ptr<FusedOptimizer>(std::vector<at::Tensor>, bool master_weights)>;

// Every state tensor of every param, in order (for "nothing changed" and "bit-identical" checks).
std::vector<at::Tensor> all_state(FusedOptimizer& opt) {
  std::vector<at::Tensor> out;
  for (const auto& g : opt.param_groups())
    for (const auto& p : g.params()) {
      out.push_back(p.detach());
      const auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it == opt.state().end()) continue;
      for (const auto& kv : static_cast<FusedParamState&>(*it->second).defined_tensors()) out.push_back(kv.second);
    }
  return out;
}

// fp16 params with masters against fp32 params starting from the same values: the master is the
// fp32 weight (same fp32 math), and the model holds its rounding.
void expect_masters_track_fp32(const Factory& make, const c10::Device& device, std::mt19937_64& rng) {
  auto low = make_params(shapes(rng), at::kHalf, device);
  auto full = copies(low, at::kFloat);
  const auto start = copies(low, at::kDouble);
  auto a = make(low, true);
  auto b = make(full, false);
  for (int step = 0; step < 3; ++step) {
    const auto gs = random_grads(low, at::kHalf);
    set_grads(low, gs);
    set_grads(full, gs);
    a->step();
    b->step();
  }
  const auto masters = a->master_params();
  EXPECT_LT(displacement_err(masters, full, start), 1e-5) << "masters";
  for (size_t i = 0; i < low.size(); ++i) {
    ASSERT_EQ(masters[i].scalar_type(), at::kFloat) << i;
    EXPECT_TRUE(bitwise_equal(low[i].detach(), masters[i].to(at::kHalf))) << "param " << i;
  }
}

// found_inf set: params, masters, state and step counts stay bit-identical.
void expect_skip_changes_nothing(const Factory& make, const c10::Device& device, std::mt19937_64& rng) {
  auto ps = make_params(shapes(rng), at::kHalf, device);
  auto opt = make(ps, true);
  set_grads(ps, random_grads(ps, at::kHalf));
  opt->step();
  const auto before = clone_all(all_state(*opt));
  const at::Tensor step_before = opt->step_count_tensor(0).clone();
  set_grads(ps, random_grads(ps, at::kHalf));
  opt->set_grad_scaling({torch::full({1}, 8.0, at::TensorOptions().device(device)),
                         torch::ones({1}, at::TensorOptions().device(device))});
  opt->step();
  opt->set_grad_scaling({});
  expect_unchanged(all_state(*opt), before, opt->name() + " skipped step");
  EXPECT_TRUE(bitwise_equal(opt->step_count_tensor(0), step_before));
}

// Two steps, save, load into a fresh optimizer over copies, two more steps on both: bit-identical.
void expect_round_trip(const Factory& make, const c10::Device& device, std::mt19937_64& rng) {
  auto a = make_params(shapes(rng), at::kHalf, device);
  auto b = copies(a, at::kHalf);
  auto original = make(a, true);
  auto restored = make(b, false);  // options (master weights too) come from the checkpoint
  for (int step = 0; step < 2; ++step) {
    set_grads(a, random_grads(a, at::kHalf));
    original->step();
  }
  torch::serialize::OutputArchive out;
  original->save(out);
  std::ostringstream os;
  out.save_to(os);
  torch::serialize::InputArchive in;
  std::istringstream is(os.str());
  in.load_from(is);
  restored->load(in);
  for (size_t i = 0; i < a.size(); ++i) b[i].detach().copy_(a[i].detach());
  for (int step = 0; step < 2; ++step) {
    const auto gs = random_grads(a, at::kHalf);
    set_grads(a, gs);
    set_grads(b, gs);
    original->step();
    restored->step();
  }
  const auto sa = all_state(*original), sb = all_state(*restored);
  ASSERT_EQ(sa.size(), sb.size()) << original->name();
  for (size_t i = 0; i < sa.size(); ++i)
    EXPECT_TRUE(bitwise_equal(sa[i], sb[i])) << original->name() << " tensor " << i;
  EXPECT_EQ(restored->step_count(0), 4);
}

void generic_checks(const Factory& make, const c10::Device& device, std::mt19937_64& rng) {
  {
    SCOPED_TRACE("masters");
    expect_masters_track_fp32(make, device, rng);
  }
  {
    SCOPED_TRACE("skip");
    expect_skip_changes_nothing(make, device, rng);
  }
  {
    SCOPED_TRACE("round trip");
    expect_round_trip(make, device, rng);
  }
}

class ApiFamilies : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(ApiFamilies);

// ---- SGD ----------------------------------------------------------------------------------------
TEST_P(ApiFamilies, SGDMatchesTorchSGDIncludingLateMomentumBuffers) {
  SKIP_WITHOUT_KERNEL("sgd_");
  auto rng = host_rng();
  struct Config {
    double momentum, dampening, weight_decay;
    bool nesterov;
  };
  for (const Config& c : {Config{0.9, 0.0, 0.01, true}, Config{0.8, 0.3, 0.0, false}, Config{0.0, 0.0, 0.05, false}}) {
    auto ps = make_params(shapes(rng), at::kFloat, device());
    const auto start = copies(ps, at::kDouble);
    auto ref = copies(ps, at::kDouble);
    FusedSGD ours(ps, FusedSGDOptions(0.1)
                          .momentum(c.momentum)
                          .dampening(c.dampening)
                          .weight_decay(c.weight_decay)
                          .nesterov(c.nesterov));
    torch::optim::SGD peer(ref, torch::optim::SGDOptions(0.1)
                                    .momentum(c.momentum)
                                    .dampening(c.dampening)
                                    .weight_decay(c.weight_decay)
                                    .nesterov(c.nesterov));
    for (int step = 0; step < 5; ++step) {
      const auto gs = random_grads(ps, at::kFloat);
      set_grads(ps, gs);
      set_grads(ref, gs);
      if (step < 2) {  // the last param gets its first gradient at step 3: its buffer starts late
        ps.back().mutable_grad() = at::Tensor();
        ref.back().mutable_grad() = at::Tensor();
      }
      ours.step();
      peer.step();
    }
    EXPECT_LT(displacement_err(ps, ref, start), 1e-5) << "momentum " << c.momentum << " dampening " << c.dampening;
  }
  generic_checks(
      [](std::vector<at::Tensor> p, bool mw) -> std::unique_ptr<FusedOptimizer> {
        return std::make_unique<FusedSGD>(std::move(p),
                                          FusedSGDOptions(0.05).momentum(0.9).dampening(0.1).master_weights(mw));
      },
      device(), rng);
}

TEST_P(ApiFamilies, SGDRefusesBadOptions) {
  auto ps = make_params({{3}}, at::kFloat, device());
  expect_c10_error([&] { FusedSGD(ps, FusedSGDOptions(0.1).nesterov(true)); }, {"FusedSGD", "Nesterov"});
  expect_c10_error([&] { FusedSGD(ps, FusedSGDOptions(0.1).momentum(-1)); }, {"FusedSGD", "momentum"});
  expect_c10_error([&] { FusedSGD(ps, FusedSGDOptions(NAN)); }, {"FusedSGD", "invalid learning rate nan;"});
  expect_c10_error([&] { FusedSGD(ps, FusedSGDOptions(0.1).dampening(INFINITY)); },
                   {"FusedSGD", "invalid dampening inf"});
}

// state_dtype(kMomentumInParamDtype): fp16/bf16 buffers of fp16/bf16 params, torch::optim::SGD's
// trajectory bit for bit where its products are exact (powers of two; see kernels/sgd.h), float32
// buffers where a master is updated; a dtype other than float32 or the marker is refused.
TEST_P(ApiFamilies, SGDMomentumInParamDtypeIsTorchSGDBitForBit) {
  SKIP_WITHOUT_KERNEL("sgd_");
  for (const auto dtype : {at::kHalf, at::kBFloat16}) {
    auto ps = make_params({{37}, {5, 7}}, dtype, device());
    auto ref = copies(ps, dtype);
    FusedSGD ours(ps, FusedSGDOptions(0.25).momentum(0.125).nesterov(true).state_dtype(kMomentumInParamDtype));
    torch::optim::SGD peer(ref, torch::optim::SGDOptions(0.25).momentum(0.125).nesterov(true));
    for (int step = 0; step < 6; ++step) {
      const auto gs = random_grads(ps, dtype);
      set_grads(ps, gs);
      set_grads(ref, gs);
      ours.step();
      peer.step();
      for (size_t i = 0; i < ps.size(); ++i) {
        const auto& buf =
            static_cast<FusedSGDParamState&>(*ours.state().at(ps[i].unsafeGetTensorImpl())).momentum_buffer();
        EXPECT_EQ(buf.scalar_type(), dtype);
        EXPECT_TRUE(at::equal(ps[i].detach().cpu(), ref[i].detach().cpu()))
            << dtype << " step " << step << " param " << i;
        EXPECT_TRUE(at::equal(buf.cpu(),
                              static_cast<torch::optim::SGDParamState&>(*peer.state().at(ref[i].unsafeGetTensorImpl()))
                                  .momentum_buffer()
                                  .cpu()));
      }
    }
    // With masters the master is what the step updates: float32 buffers; the default is float32.
    for (const bool master : {true, false}) {
      auto qs = make_params({{9}}, dtype, device());
      auto o = FusedSGDOptions(0.1).momentum(0.9).master_weights(master);
      FusedSGD opt(qs, master ? o.state_dtype(kMomentumInParamDtype) : o);
      set_grads(qs, random_grads(qs, dtype));
      opt.step();
      EXPECT_EQ(static_cast<FusedSGDParamState&>(*opt.state().at(qs[0].unsafeGetTensorImpl()))
                    .momentum_buffer()
                    .scalar_type(),
                at::kFloat);
    }
  }
  auto ps = make_params({{3}}, at::kHalf, device());
  expect_c10_error([&] { FusedSGD(ps, FusedSGDOptions(0.1).momentum(0.9).state_dtype(at::kHalf)); },
                   {"FusedSGD", "state_dtype must be float32 or kMomentumInParamDtype, got Half"});
}

// ---- Adagrad --------------------------------------------------------------------------------------
TEST_P(ApiFamilies, AdagradMatchesTorchAdagrad) {
  SKIP_WITHOUT_KERNEL("adagrad_");
  auto rng = host_rng();
  auto ps = make_params(shapes(rng), at::kFloat, device());
  const auto start = copies(ps, at::kDouble);
  auto ref = copies(ps, at::kDouble);
  FusedAdagrad ours(ps, FusedAdagradOptions(0.1).lr_decay(0.05).weight_decay(0.1).initial_accumulator_value(0.2));
  torch::optim::Adagrad peer(
      ref, torch::optim::AdagradOptions(0.1).lr_decay(0.05).weight_decay(0.1).initial_accumulator_value(0.2));
  for (int step = 0; step < 5; ++step) {
    const auto gs = random_grads(ps, at::kFloat);
    set_grads(ps, gs);
    set_grads(ref, gs);
    ours.step();
    peer.step();
  }
  EXPECT_LT(displacement_err(ps, ref, start), 1e-5);
  generic_checks(
      [](std::vector<at::Tensor> p, bool mw) -> std::unique_ptr<FusedOptimizer> {
        return std::make_unique<FusedAdagrad>(std::move(p),
                                              FusedAdagradOptions(0.05).weight_decay(0.01).master_weights(mw));
      },
      device(), rng);
}

// ---- LAMB -----------------------------------------------------------------------------------------
// A float64 transcription of the rule in csrc/kernels/lamb.h (Apex's FusedLAMB).
struct LambRef {
  std::vector<at::Tensor> w, m, v;
  void step(const std::vector<at::Tensor>& grads, const FusedLAMBOptions& o, int t, double global_norm) {
    const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
    const double clip = o.clips() && global_norm > o.max_grad_norm() ? global_norm / o.max_grad_norm() : 1.0;
    const double bc1 = o.bias_correction() ? 1 - std::pow(b1, t) : 1,
                 bc2 = o.bias_correction() ? 1 - std::pow(b2, t) : 1;
    const double b3 = o.grad_averaging() ? 1 - b1 : 1;
    for (size_t i = 0; i < w.size(); ++i) {
      at::Tensor g = grads[i].to(at::kCPU, at::kDouble) / clip;
      if (!o.adam_w_mode()) g = g + o.weight_decay() * w[i];
      m[i] = b1 * m[i] + b3 * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      at::Tensor u = (m[i] / bc1) / ((v[i] / bc2).sqrt() + o.eps());
      if (o.adam_w_mode()) u = u + o.weight_decay() * w[i];
      double ratio = 1;
      if (o.weight_decay() != 0 || o.use_nvlamb()) {
        const double wn = w[i].norm().item<double>(), un = u.norm().item<double>();
        if (wn != 0 && un != 0) ratio = wn / un;
      }
      w[i] = w[i] - o.lr() * ratio * u;
    }
  }
};

TEST_P(ApiFamilies, LAMBMatchesFloat64RuleWithGlobalClippingAcrossGroups) {
  SKIP_WITHOUT_KERNEL("lamb_");
  auto rng = host_rng();
  auto g1 = make_params({{7}, {65537}}, at::kFloat, device());
  auto g2 = make_params({{300}, {17, 5}}, at::kFloat, device());
  const auto s1 = copies(g1, at::kDouble), s2 = copies(g2, at::kDouble);
  // Group 0 decays (trust ratio); group 1 does not (plain lr * u), and clips on a tiny bound.
  const FusedLAMBOptions o1 = FusedLAMBOptions(0.05).weight_decay(0.1).max_grad_norm(5.0);
  const FusedLAMBOptions o2 = FusedLAMBOptions(0.02).weight_decay(0.0).max_grad_norm(5.0).adam_w_mode(false);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(g1, std::make_unique<FusedLAMBOptions>(o1));
  groups.emplace_back(g2, std::make_unique<FusedLAMBOptions>(o2));
  FusedLAMB ours(groups, FusedLAMBOptions());
  LambRef r1{copies(g1, at::kDouble), {}, {}}, r2{copies(g2, at::kDouble), {}, {}};
  for (auto* r : {&r1, &r2})
    for (auto& w : r->w) {
      w = w.detach().cpu();
      r->m.push_back(at::zeros_like(w));
      r->v.push_back(at::zeros_like(w));
    }
  for (int t = 1; t <= 4; ++t) {
    const auto a = random_grads(g1, at::kFloat), b = random_grads(g2, at::kFloat);
    set_grads(g1, a);
    set_grads(g2, b);
    double sq = 0;
    for (const auto& g : a) sq += g.to(at::kDouble).square().sum().item<double>();
    for (const auto& g : b) sq += g.to(at::kDouble).square().sum().item<double>();
    ours.step();
    r1.step(a, o1, t, std::sqrt(sq));
    r2.step(b, o2, t, std::sqrt(sq));
  }
  EXPECT_LT(displacement_err(g1, r1.w, s1), 1e-5) << "group 0";
  EXPECT_LT(displacement_err(g2, r2.w, s2), 1e-5) << "group 1";
  generic_checks(
      [](std::vector<at::Tensor> p, bool mw) -> std::unique_ptr<FusedOptimizer> {
        return std::make_unique<FusedLAMB>(std::move(p), FusedLAMBOptions(0.01).master_weights(mw));
      },
      device(), rng);
}

// ---- NovoGrad -------------------------------------------------------------------------------------
// A float64 transcription of the rule in csrc/kernels/novograd.h (Apex's FusedNovoGrad).
struct NovoGradRef {
  std::vector<at::Tensor> w, m;
  std::vector<double> v;
  void step(const std::vector<at::Tensor>& grads, const FusedNovoGradOptions& o, int t) {
    const double b1 = std::get<0>(o.betas()), b2 = std::get<1>(o.betas());
    const bool l2 = o.norm_type() == 2;
    const double c1 = o.bias_correction() ? 1 - std::pow(b1, t) : 1;
    const double c2 = o.bias_correction() ? std::sqrt(1 - std::pow(b2, t)) : 1;
    const double b3 = o.grad_averaging() ? 1 - b1 : 1;
    for (size_t i = 0; i < w.size(); ++i) {
      const at::Tensor g = grads[i].to(at::kCPU, at::kDouble);
      const double n = l2 ? g.norm().item<double>() : g.abs().max().item<double>();
      if (t == 1 && !o.init_zero()) v[i] = n;
      else v[i] = l2 ? std::sqrt(b2 * v[i] * v[i] + (1 - b2) * n * n) : b2 * v[i] + (1 - b2) * n;
      const double d = v[i] / c2 + o.eps();
      if (o.reg_inside_moment()) {
        m[i] = b1 * m[i] + b3 * (g / d + o.weight_decay() * w[i]);
        w[i] = w[i] - o.lr() * m[i] / c1;
      } else {
        m[i] = b1 * m[i] + b3 * g;
        w[i] = w[i] - o.lr() * (m[i] / c1 / d + o.weight_decay() * w[i]);
      }
    }
  }
};

TEST_P(ApiFamilies, NovoGradMatchesFloat64RuleInEveryMode) {
  SKIP_WITHOUT_KERNEL("novograd_");
  auto rng = host_rng();
  for (bool reg_inside : {false, true}) {
    for (double norm_type : {2.0, 0.0}) {
      const bool init_zero = reg_inside;  // both seedings, across the loop
      // lr large enough that the displacement, not the fp32 rounding of the weights, is measured.
      const FusedNovoGradOptions o = FusedNovoGradOptions(2.0)
                                         .weight_decay(0.02)
                                         .betas({0.9, 0.98})
                                         .reg_inside_moment(reg_inside)
                                         .norm_type(norm_type)
                                         .init_zero(init_zero);
      auto ps = make_params(shapes(rng), at::kFloat, device());
      const auto start = copies(ps, at::kDouble);
      FusedNovoGrad ours(ps, o);
      NovoGradRef r;
      for (const auto& p : ps) {
        r.w.push_back(p.detach().to(at::kCPU, at::kDouble));
        r.m.push_back(at::zeros_like(r.w.back()));
        r.v.push_back(0.0);
      }
      for (int t = 1; t <= 4; ++t) {
        const auto gs = random_grads(ps, at::kFloat);
        set_grads(ps, gs);
        ours.step();
        r.step(gs, o, t);
      }
      const at::Tensor v = ours.exp_avg_sq(0).cpu().to(at::kDouble);
      const std::string what = "reg_inside " + std::to_string(reg_inside) + " norm " + std::to_string(norm_type);
      EXPECT_LT(displacement_err(ps, r.w, start), 1e-5) << what;
      for (size_t i = 0; i < ps.size(); ++i)
        EXPECT_NEAR(v[i].item<double>(), r.v[i], 1e-5 * r.v[i]) << what << " param " << i;
    }
  }
}

TEST_P(ApiFamilies, NovoGradKeepsTheMomentsOfParamsWithoutGradients) {
  SKIP_WITHOUT_KERNEL("novograd_");
  auto rng = host_rng();
  auto ps = make_params({{40}, {30}, {20}}, at::kFloat, device());
  FusedNovoGrad ours(ps, FusedNovoGradOptions(0.01));
  set_grads(ps, random_grads(ps, at::kFloat));
  ours.step();
  const at::Tensor before = ours.exp_avg_sq(0).clone();
  const at::Tensor idle = ps[1].detach().clone();
  set_grads(ps, random_grads(ps, at::kFloat));
  ps[1].mutable_grad() = at::Tensor();
  ours.step();
  const at::Tensor after = ours.exp_avg_sq(0);
  EXPECT_TRUE(bitwise_equal(after[1], before[1])) << "the idle param's moment changed";
  EXPECT_FALSE(bitwise_equal(after[0], before[0])) << "an active param's moment did not change";
  EXPECT_TRUE(bitwise_equal(ps[1].detach(), idle));
  generic_checks(
      [](std::vector<at::Tensor> p, bool mw) -> std::unique_ptr<FusedOptimizer> {
        return std::make_unique<FusedNovoGrad>(std::move(p),
                                               FusedNovoGradOptions(0.01).weight_decay(0.01).master_weights(mw));
      },
      device(), rng);
}

TEST_P(ApiFamilies, NovoGradRefusesABadNormType) {
  auto ps = make_params({{3}, {4}}, at::kFloat, device());
  expect_c10_error([&] { FusedNovoGrad(ps, FusedNovoGradOptions(0.1).norm_type(1)); },
                   {"FusedNovoGrad", "norm_type", "got 1"});
}

}  // namespace
