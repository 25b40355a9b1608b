// The C++ fused optimizers' shared machinery through FusedAdam/FusedAdamW: results against
// torch::optim::AdamW/Adam run in float64, master weights, param groups, in-kernel loss scaling and
// skipping, checkpoints (round trips and corrupt ones), and errors.
//
// Equivalence to the Python front: mixprec::optim::FusedAdam calls the same op (mixprec::adam_)
// with the same arguments, state and step tensor as python/mixprec/optimizers/fused_adam.py, whose
// tests compare it with torch.optim.AdamW; torch::optim::AdamW implements the same update, so
// agreeing with it here closes the loop on the same inputs.
#include <gtest/gtest.h>
#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include <sstream>

#include "test_support.h"

namespace {

using namespace mixprec::test;
using mixprec::optim::FusedAdam;
using mixprec::optim::FusedAdamOptions;
using mixprec::optim::FusedAdamParamState;
using mixprec::optim::FusedAdamW;
using mixprec::optim::FusedAdamWOptions;

// Shapes straddling the 65536-element chunk, a matrix and a tiny tensor.
std::vector<std::vector<int64_t>> shapes(std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> small(2, 3000);
  return {{7}, {65537}, {small(rng)}, {33, 17}, {1}};
}

std::vector<at::Tensor> make_params(const std::vector<std::vector<int64_t>>& sh, at::ScalarType dtype,
                                    const c10::Device& device) {
  std::vector<at::Tensor> ps;
  for (const auto& s : sh) ps.push_back(random_tensor(s, dtype, device).requires_grad_(true));
  return ps;
}

// Leaf copies in `dtype` (float64 references) of `ps`.
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

void set_grads(const std::vector<at::Tensor>& ps, const std::vector<at::Tensor>& gs, double factor = 1.0) {
  for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = (gs[i] * factor).to(ps[i].scalar_type());
}

template <class State, class Opt> State& torch_state(Opt& opt, const at::Tensor& p) {
  return static_cast<State&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

class ApiAdam : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(ApiAdam);

TEST_P(ApiAdam, AdamWMatchesTorchAdamWInFloat64) {
  auto rng = host_rng();
  for (bool amsgrad : {false, true}) {
    auto ps = make_params(shapes(rng), at::kFloat, device());
    const auto start = copies(ps, at::kDouble);
    auto ref = copies(ps, at::kDouble);
    const double lr = 0.05, wd = std::uniform_real_distribution<double>(0.01, 0.2)(rng);
    FusedAdamW ours(ps, FusedAdamWOptions(lr).weight_decay(wd).betas({0.8, 0.95}).eps(1e-6).amsgrad(amsgrad));
    torch::optim::AdamW peer(
        ref, torch::optim::AdamWOptions(lr).weight_decay(wd).betas({0.8, 0.95}).eps(1e-6).amsgrad(amsgrad));
    for (int step = 0; step < 5; ++step) {
      const auto gs = random_grads(ps, at::kFloat);
      set_grads(ps, gs);
      set_grads(ref, gs);
      ours.step();
      peer.step();
    }
    EXPECT_EQ(ours.step_count(0), 5);
    const std::string what = "amsgrad=" + std::to_string(amsgrad);
    EXPECT_LT(displacement_err(ps, ref, start), 1e-5) << what;
    std::vector<at::Tensor> m, v, vmax, peer_m, peer_v, peer_vmax;  // moments of every param, as lists
    for (size_t i = 0; i < ps.size(); ++i) {
      auto& os = static_cast<FusedAdamParamState&>(*ours.state().at(ps[i].unsafeGetTensorImpl()));
      auto& ts = torch_state<torch::optim::AdamWParamState>(peer, ref[i]);
      m.push_back(os.exp_avg());
      v.push_back(os.exp_avg_sq());
      peer_m.push_back(ts.exp_avg());
      peer_v.push_back(ts.exp_avg_sq());
      if (amsgrad) {
        vmax.push_back(os.max_exp_avg_sq());
        peer_vmax.push_back(ts.max_exp_avg_sq());
      }
      EXPECT_FALSE(os.master_param().defined()) << "fp32 params need no master";
    }
    EXPECT_LT(rel_err(m, peer_m), 1e-5) << what;
    EXPECT_LT(rel_err(v, peer_v), 1e-5) << what;
    if (amsgrad) EXPECT_LT(rel_err(vmax, peer_vmax), 1e-5) << what;
  }
}

TEST_P(ApiAdam, AdamL2ModeMatchesTorchAdam) {
  auto rng = host_rng();
  auto ps = make_params(shapes(rng), at::kFloat, device());
  const auto start = copies(ps, at::kDouble);
  auto ref = copies(ps, at::kDouble);
  FusedAdam ours(ps, FusedAdamOptions(0.05).weight_decay(0.1).adam_w_mode(false));
  torch::optim::Adam peer(ref, torch::optim::AdamOptions(0.05).weight_decay(0.1));
  for (int step = 0; step < 4; ++step) {
    const auto gs = random_grads(ps, at::kFloat);
    set_grads(ps, gs);
    set_grads(ref, gs);
    ours.step();
    peer.step();
  }
  EXPECT_LT(displacement_err(ps, ref, start), 1e-5);
}

TEST_P(ApiAdam, MaximizeEqualsNegatedGradients) {
  auto rng = host_rng();
  auto a = make_params(shapes(rng), at::kFloat, device());
  auto b = copies(a, at::kFloat);
  FusedAdamW max_opt(a, FusedAdamWOptions(0.01).maximize(true));
  FusedAdamW min_opt(b, FusedAdamWOptions(0.01));
  for (int step = 0; step < 3; ++step) {
    const auto gs = random_grads(a, at::kFloat);
    set_grads(a, gs);
    set_grads(b, gs, -1.0);
    max_opt.step();
    min_opt.step();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << i;
}

TEST_P(ApiAdam, MasterWeightsFollowFloat64ReferenceAndRoundIntoTheModel) {
  auto rng = host_rng();
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    auto ps = make_params(shapes(rng), dtype, device());
    const auto start = copies(ps, at::kDouble);
    auto ref = copies(ps, at::kDouble);
    FusedAdamW ours(ps, FusedAdamWOptions(0.05).weight_decay(0.05).master_weights(true));
    torch::optim::AdamW peer(ref, torch::optim::AdamWOptions(0.05).weight_decay(0.05));
    for (int step = 0; step < 4; ++step) {
      const auto gs = random_grads(ps, dtype);  // the model's grads are low precision
      set_grads(ps, gs);
      set_grads(ref, gs);
      ours.step();
      peer.step();
    }
    const auto masters = ours.master_params();
    ASSERT_EQ(masters.size(), ps.size());
    EXPECT_LT(displacement_err(masters, ref, start), 1e-5) << dtype << " masters";
    for (size_t i = 0; i < ps.size(); ++i) {
      ASSERT_EQ(masters[i].scalar_type(), at::kFloat);
      EXPECT_TRUE(bitwise_equal(ps[i].detach(), masters[i].to(dtype)))
          << dtype << " param " << i << " is not its master's rounding";
    }
  }
}

TEST_P(ApiAdam, BFloat16MomentsStayCloseToFloat32) {
  auto rng = host_rng();
  auto a = make_params(shapes(rng), at::kFloat, device());
  auto b = copies(a, at::kFloat);
  const auto start = copies(a, at::kDouble);
  FusedAdamW low(a, FusedAdamWOptions(0.05).state_dtype(at::kBFloat16));
  FusedAdamW peer(b, FusedAdamWOptions(0.05));  // fp32 moments, rounded to bf16 after each step
  for (int step = 0; step < 3; ++step) {
    const auto gs = random_grads(a, at::kFloat);
    set_grads(a, gs);
    set_grads(b, gs);
    low.step();
    peer.step();
    torch::NoGradGuard no_grad;
    for (const auto& p : b) {
      auto& s = static_cast<FusedAdamParamState&>(*peer.state().at(p.unsafeGetTensorImpl()));
      s.exp_avg().copy_(s.exp_avg().to(at::kBFloat16));
      s.exp_avg_sq().copy_(s.exp_avg_sq().to(at::kBFloat16));
    }
  }
  auto& s = static_cast<FusedAdamParamState&>(*low.state().at(a[0].unsafeGetTensorImpl()));
  EXPECT_EQ(s.exp_avg().scalar_type(), at::kBFloat16);
  // The update uses the fp32 moments of this step and stores them rounded, as the peer does: the
  // same trajectory up to fp32 rounding. (Against unrounded fp32 moments the gap is about 1%, and
  // more where a moment nearly cancels, so that is no bound to test against.)
  EXPECT_LT(displacement_err(a, b, start), 1e-5);
}

TEST_P(ApiAdam, ParamGroupsKeepTheirOwnOptionsAndParamsWithoutGradsStayUntouched) {
  auto rng = host_rng();
  auto g1 = make_params({{100}, {65537}}, at::kFloat, device());
  auto g2 = make_params({{50}, {7}}, at::kFloat, device());
  auto idle = make_params({{9}}, at::kFloat, device());
  const auto idle_before = clone_all({idle[0].detach()});
  auto r1 = copies(g1, at::kDouble), r2 = copies(g2, at::kDouble);
  const auto s1 = copies(g1, at::kDouble), s2 = copies(g2, at::kDouble);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{g1[0], g1[1]});
  groups.emplace_back(std::vector<at::Tensor>{g2[0], g2[1], idle[0]},
                      std::make_unique<FusedAdamOptions>(FusedAdamWOptions(0.2).weight_decay(0.3).betas({0.5, 0.9})));
  FusedAdamW ours(groups, FusedAdamWOptions(0.02).weight_decay(0.04));
  // One torch optimizer per group: no question of how torch merges group options.
  torch::optim::AdamW p1(r1, torch::optim::AdamWOptions(0.02).weight_decay(0.04));
  torch::optim::AdamW p2(r2, torch::optim::AdamWOptions(0.2).weight_decay(0.3).betas({0.5, 0.9}));
  EXPECT_EQ(ours.param_groups()[1].options().get_lr(), 0.2);
  for (int step = 0; step < 3; ++step) {
    const auto a = random_grads(g1, at::kFloat), b = random_grads(g2, at::kFloat);
    set_grads(g1, a);
    set_grads(r1, a);
    set_grads(g2, b);
    set_grads(r2, b);
    ours.step();
    p1.step();
    p2.step();
  }
  EXPECT_LT(displacement_err(g1, r1, s1), 1e-5) << "group 0";
  EXPECT_LT(displacement_err(g2, r2, s2), 1e-5) << "group 1";
  EXPECT_TRUE(bitwise_equal(idle[0].detach(), idle_before[0])) << "a param without grad changed";
  EXPECT_EQ(ours.state().count(idle[0].unsafeGetTensorImpl()), 0u) << "a param without grad got state";

  // A group added later keeps what it sets (torch 2.13's add_param_group would give it the bare
  // defaults) and inherits what it leaves at FusedAdamWOptions' defaults: here weight_decay.
  auto extra = make_params({{11}}, at::kFloat, device());
  ours.add_param_group(torch::optim::OptimizerParamGroup(
      std::vector<at::Tensor>{extra[0]}, std::make_unique<FusedAdamOptions>(FusedAdamWOptions(0.7).amsgrad(true))));
  const auto& added = static_cast<const FusedAdamOptions&>(ours.param_groups()[2].options());
  EXPECT_EQ(added.lr(), 0.7);
  EXPECT_TRUE(added.amsgrad());
  EXPECT_EQ(added.weight_decay(), 0.04);
  const auto& second = static_cast<const FusedAdamOptions&>(ours.param_groups()[1].options());
  EXPECT_EQ(second.weight_decay(), 0.3);
  EXPECT_EQ(second.eps(), 1e-8);
}

TEST_P(ApiAdam, LearningRateSchedulersDriveTheGroups) {
  auto ps = make_params({{5}}, at::kFloat, device());
  FusedAdamW ours(ps, FusedAdamWOptions(0.1));
  torch::optim::StepLR sched(ours, /*step_size=*/2, /*gamma=*/0.5);
  for (int epoch = 1; epoch <= 3; ++epoch) {
    set_grads(ps, random_grads(ps, at::kFloat));
    ours.step();
    sched.step();  // LibTorch's StepLR decays when its count reaches a multiple of step_size
    EXPECT_DOUBLE_EQ(ours.param_groups()[0].options().get_lr(), epoch >= 3 ? 0.05 : 0.1) << "after epoch " << epoch;
  }
}

TEST_P(ApiAdam, ClosureRunsWithGradAndItsLossIsReturned) {
  auto ps = make_params({{6}}, at::kFloat, device());
  FusedAdamW ours(ps, FusedAdamWOptions(0.1));
  const at::Tensor loss = ours.step([&] {
    EXPECT_TRUE(at::GradMode::is_enabled());
    ours.zero_grad();
    at::Tensor l = (ps[0] * ps[0]).sum();
    l.backward();
    return l;
  });
  ASSERT_TRUE(loss.defined());
  EXPECT_EQ(ours.step_count(0), 1);
}

TEST_P(ApiAdam, GradScaleDividesInsideTheKernelAndFoundInfSkipsEverything) {
  auto rng = host_rng();
  auto a = make_params(shapes(rng), at::kFloat, device());
  auto b = copies(a, at::kFloat);
  const auto start = copies(a, at::kDouble);
  FusedAdamW scaled(a, FusedAdamWOptions(0.05).weight_decay(0.1));
  FusedAdamW plain(b, FusedAdamWOptions(0.05).weight_decay(0.1));
  const double s = 1024.0;
  const at::Tensor scale = torch::full({1}, s, opts());
  const at::Tensor clean = torch::zeros({1}, opts()), overflow = torch::ones({1}, opts());
  for (int step = 0; step < 3; ++step) {
    const auto gs = random_grads(a, at::kFloat);
    set_grads(a, gs, s);  // a power of two: scaling is exact
    set_grads(b, gs);
    scaled.set_grad_scaling({scale, clean});
    scaled.step();
    plain.step();
  }
  EXPECT_LT(displacement_err(a, b, start), 1e-6);

  // found_inf set: params, moments and the step count stay bit-identical.
  std::vector<at::Tensor> before;
  for (const auto& p : a) {
    auto& st = static_cast<FusedAdamParamState&>(*scaled.state().at(p.unsafeGetTensorImpl()));
    before.push_back(p.detach().clone());
    before.push_back(st.exp_avg().clone());
    before.push_back(st.exp_avg_sq().clone());
  }
  const at::Tensor step_before = scaled.step_count_tensor(0).clone();
  set_grads(a, random_grads(a, at::kFloat), s);
  scaled.set_grad_scaling({scale, overflow});
  scaled.step();
  std::vector<at::Tensor> after;
  for (const auto& p : a) {
    auto& st = static_cast<FusedAdamParamState&>(*scaled.state().at(p.unsafeGetTensorImpl()));
    after.push_back(p.detach());
    after.push_back(st.exp_avg());
    after.push_back(st.exp_avg_sq());
  }
  expect_unchanged(after, before, "skipped step");
  EXPECT_TRUE(bitwise_equal(scaled.step_count_tensor(0), step_before));
  scaled.set_grad_scaling({});
  EXPECT_FALSE(scaled.grad_scaling().found_inf.has_value());
}

// ---- checkpoints --------------------------------------------------------------------------------
std::string save_to_string(const torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive archive;
  opt.save(archive);
  std::ostringstream os;
  archive.save_to(os);
  return os.str();
}

void load_from_string(torch::optim::Optimizer& opt, const std::string& bytes) {
  torch::serialize::InputArchive archive;
  std::istringstream is(bytes);
  archive.load_from(is);
  opt.load(archive);
}

TEST_P(ApiAdam, CheckpointRoundTripContinuesBitIdentically) {
  auto rng = host_rng();
  for (at::ScalarType dtype : {at::kFloat, at::kHalf}) {
    auto a = make_params(shapes(rng), dtype, device());
    auto b = copies(a, dtype);
    std::vector<torch::optim::OptimizerParamGroup> ga, gb;
    ga.emplace_back(std::vector<at::Tensor>{a[0], a[1], a[2]});
    ga.emplace_back(std::vector<at::Tensor>{a[3], a[4]},
                    std::make_unique<FusedAdamOptions>(FusedAdamOptions(0.03).amsgrad(true)));
    gb.emplace_back(std::vector<at::Tensor>{b[0], b[1], b[2]});
    gb.emplace_back(std::vector<at::Tensor>{b[3], b[4]});  // options come from the checkpoint
    FusedAdamW original(ga, FusedAdamWOptions(0.01).master_weights(dtype != at::kFloat));
    FusedAdamW restored(gb, FusedAdamWOptions(0.5));
    for (int step = 0; step < 3; ++step) {
      set_grads(a, random_grads(a, dtype));
      original.step();
    }
    original.param_groups()[0].options().set_lr(0.02);  // as a scheduler would
    load_from_string(restored, save_to_string(original));
    for (size_t i = 0; i < a.size(); ++i) b[i].detach().copy_(a[i].detach());  // the model's own checkpoint
    EXPECT_EQ(restored.param_groups()[0].options().get_lr(), 0.02);
    EXPECT_TRUE(static_cast<FusedAdamOptions&>(restored.param_groups()[1].options()).amsgrad());
    EXPECT_EQ(restored.step_count(0), 3);
    for (int step = 0; step < 2; ++step) {
      const auto gs = random_grads(a, dtype);
      set_grads(a, gs);
      set_grads(b, gs);
      original.step();
      restored.step();
    }
    const auto ma = original.master_params(), mb = restored.master_params();
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(a[i].detach(), b[i].detach())) << dtype << " param " << i;
      EXPECT_TRUE(bitwise_equal(ma[i], mb[i])) << dtype << " master " << i;
      if (dtype != at::kFloat) EXPECT_EQ(ma[i].scalar_type(), at::kFloat);
    }
    EXPECT_EQ(restored.step_count(1), 5);
  }
}

// What load() must leave alone when it refuses: options, state tensors and step counts.
struct Snapshot {
  double lr;
  at::Tensor exp_avg, step;
  explicit Snapshot(FusedAdamW& o, const at::Tensor& p)
      : lr(o.param_groups()[0].options().get_lr()),
        exp_avg(static_cast<FusedAdamParamState&>(*o.state().at(p.unsafeGetTensorImpl())).exp_avg().clone()),
        step(o.step_count_tensor(0).clone()) {}
  void expect_same(FusedAdamW& o, const at::Tensor& p) const {
    EXPECT_EQ(o.param_groups()[0].options().get_lr(), lr);
    EXPECT_TRUE(
        bitwise_equal(static_cast<FusedAdamParamState&>(*o.state().at(p.unsafeGetTensorImpl())).exp_avg(), exp_avg));
    EXPECT_TRUE(bitwise_equal(o.step_count_tensor(0), step));
  }
};

TEST_P(ApiAdam, CorruptOrForeignCheckpointsAreRefusedAndChangeNothing) {
  auto ps = make_params({{10}, {20}}, at::kFloat, device());
  FusedAdamW target(ps, FusedAdamWOptions(0.01));
  set_grads(ps, random_grads(ps, at::kFloat));
  target.step();
  const Snapshot snap(target, ps[0]);

  // Another parameter count, other shapes, another class, torch's own AdamW, mismatched groups.
  auto three = make_params({{10}, {20}, {3}}, at::kFloat, device());
  FusedAdamW more(three, FusedAdamWOptions(0.3));
  auto reshaped = make_params({{10}, {21}}, at::kFloat, device());
  FusedAdamW other_shape(reshaped, FusedAdamWOptions(0.3));
  set_grads(reshaped, random_grads(reshaped, at::kFloat));
  other_shape.step();
  FusedAdam plain_adam(copies(ps, at::kFloat), FusedAdamOptions(0.3));
  torch::optim::AdamW torch_adamw(copies(ps, at::kFloat), torch::optim::AdamWOptions(0.3));
  std::vector<torch::optim::OptimizerParamGroup> two;
  auto cp = copies(ps, at::kFloat);
  two.emplace_back(std::vector<at::Tensor>{cp[0]});
  two.emplace_back(std::vector<at::Tensor>{cp[1]});
  FusedAdamW two_groups(two, FusedAdamWOptions(0.3));

  expect_c10_error([&] { load_from_string(target, save_to_string(more)); }, {"FusedAdamW.load", "3 params"});
  snap.expect_same(target, ps[0]);
  expect_c10_error([&] { load_from_string(target, save_to_string(other_shape)); },
                   {"FusedAdamW.load", "state[1]['exp_avg']", "shape"});
  snap.expect_same(target, ps[0]);
  expect_c10_error([&] { load_from_string(target, save_to_string(plain_adam)); }, {"FusedAdamW.load", "FusedAdam"});
  expect_c10_error([&] { load_from_string(target, save_to_string(torch_adamw)); },
                   {"FusedAdamW.load", "not a mixprec optimizer checkpoint"});
  expect_c10_error([&] { load_from_string(target, save_to_string(two_groups)); },
                   {"FusedAdamW.load", "2 param groups"});
  snap.expect_same(target, ps[0]);

  // An fp16 model whose checkpoint lacks masters although master weights are on.
  auto half = make_params({{10}, {20}}, at::kHalf, device());
  FusedAdamW no_masters(half, FusedAdamWOptions(0.01));
  set_grads(half, random_grads(half, at::kHalf));
  no_masters.step();
  FusedAdamW wants_masters(copies(half, at::kHalf), FusedAdamWOptions(0.01).master_weights(true));
  // The options travel with the checkpoint (master_weights off there): that one loads...
  load_from_string(wants_masters, save_to_string(no_masters));
  // ...but a checkpoint whose options want masters yet whose state has none is refused.
  FusedAdamW masters_on(copies(half, at::kHalf), FusedAdamWOptions(0.01).master_weights(true));
  set_grads(masters_on.param_groups()[0].params(), random_grads(half, at::kHalf));
  masters_on.step();
  for (auto& kv : masters_on.state()) static_cast<FusedAdamParamState&>(*kv.second).master_param(at::Tensor());
  expect_c10_error([&] { load_from_string(wants_masters, save_to_string(masters_on)); }, {"has no 'master_param'"});
}

// ---- errors -------------------------------------------------------------------------------------
TEST_P(ApiAdam, BadHyperParametersAndOptionsAreRefused) {
  auto ps = make_params({{4}}, at::kFloat, device());
  expect_c10_error([&] { FusedAdam(ps, FusedAdamOptions(-1.0)); }, {"FusedAdam", "invalid learning rate -1;"});
  expect_c10_error([&] { FusedAdam(ps, FusedAdamOptions(1e-3).betas({0.9, 1.0})); }, {"FusedAdam", "betas (0.9, 1)"});
  expect_c10_error([&] { FusedAdam(ps, FusedAdamOptions(1e-3).eps(-1e-8)); }, {"FusedAdam", "invalid eps -1e-08;"});
  expect_c10_error([&] { FusedAdam(ps, FusedAdamOptions(1e-3).weight_decay(-0.1)); }, {"FusedAdam", "weight_decay"});
  expect_c10_error([&] { FusedAdam(ps, FusedAdamOptions(1e-3).state_dtype(at::kDouble)); }, {"state_dtype"});
  expect_c10_error([&] { FusedAdamW(ps, FusedAdamOptions(1e-3).adam_w_mode(false)); }, {"FusedAdamW", "adam_w_mode"});

  // A group given another optimizer's options, and a group made bad after construction.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(ps, std::make_unique<torch::optim::AdamOptions>(1e-3));
  expect_c10_error([&] { FusedAdam(groups, FusedAdamOptions(1e-3)); }, {"param_groups[0]", "another optimizer"});
  FusedAdam ok(ps, FusedAdamOptions(1e-3));
  set_grads(ps, random_grads(ps, at::kFloat));
  const at::Tensor before = ps[0].detach().clone();
  static_cast<FusedAdamOptions&>(ok.param_groups()[0].options()).eps(-1.0);
  expect_c10_error([&] { ok.step(); }, {"param_groups[0]", "eps"});
  EXPECT_TRUE(bitwise_equal(ps[0].detach(), before));
}

TEST_P(ApiAdam, UnsupportedGradientsAreRefusedNamingTheOp) {
  auto ps = make_params({{4}, {3}}, at::kFloat, device());
  FusedAdam opt(ps, FusedAdamOptions(1e-3));
  ps[0].mutable_grad() = random_tensor({4}, at::kFloat, device());
  ps[1].mutable_grad() = random_tensor({6}, at::kFloat, device()).slice(0, 0, 6, 2);  // gapped
  const auto before = clone_all({ps[0].detach(), ps[1].detach()});
  // Refused by the optimizer before any op runs (the op would refuse it too, but one group at a time).
  expect_c10_error([&] { opt.step(); }, {"FusedAdam: param_groups[0]: params[1].grad has strides [2]; expected the "
                                         "parameter's layout, strides [1]"});
  expect_unchanged({ps[0].detach(), ps[1].detach()}, before, "params");
  ps[1].mutable_grad() = at::zeros({3}, opts()).to_sparse();
  expect_c10_error([&] { opt.step(); }, {"sparse"});
}

TEST(ApiAdamDevices, ParamsOnTwoDevicesInOneGroupAreRefused) {
  MIXPREC_SKIP_WITHOUT_CUDA();
  auto a = torch::randn({4}).requires_grad_(true);
  auto b = torch::randn({4}, torch::kCUDA).requires_grad_(true);
  a.mutable_grad() = torch::randn({4});
  b.mutable_grad() = torch::randn({4}, torch::kCUDA);
  FusedAdamW opt(std::vector<at::Tensor>{a, b}, FusedAdamWOptions(1e-3));
  expect_c10_error([&] { opt.step(); }, {"mixes devices"});
}

}  // namespace
