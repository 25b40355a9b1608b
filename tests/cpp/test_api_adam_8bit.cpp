// FusedAdam with 8-bit block-quantized moments (state_dtype c10::kChar, issue 24) in the C++ front:
// its state, its step against the op on the same state, checkpoints, and refusals.
// The code map itself is tested against a float64 reference in tests/python/test_adam_8bit.py.
#include <gtest/gtest.h>
#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include "api_support.h"

namespace {

using namespace mixprec::test;
using mixprec::optim::FusedAdam;
using mixprec::optim::FusedAdamOptions;
using mixprec::optim::FusedAdamParamState;
using mixprec::optim::FusedAdamW;
using mixprec::optim::FusedAdamWOptions;
using mixprec::test::api::copies;
using mixprec::test::api::load_from_string;
using mixprec::test::api::save_to_string;

constexpr int64_t kBlock = 256;

// A partial block, exactly one block, and sizes past a 65536-element chunk.
std::vector<at::Tensor> params8(const c10::Device& device) {
  std::vector<at::Tensor> ps;
  for (auto s : std::vector<std::vector<int64_t>>{{7}, {kBlock}, {65536 + 300}, {33, 17}})
    ps.push_back(random_tensor(s, at::kFloat, device).requires_grad_(true));
  return ps;
}

FusedAdamParamState& state8(FusedAdamW& opt, const at::Tensor& p) {
  return static_cast<FusedAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
}

std::vector<at::Tensor> all_state(FusedAdamW& opt, const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) {
    auto& s = state8(opt, p);
    for (const auto& t : {s.exp_avg(), s.exp_avg_sq(), s.exp_avg_scale(), s.exp_avg_sq_scale()}) out.push_back(t);
  }
  return out;
}

void set_same_grads(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    a[i].mutable_grad() = random_tensor(a[i].sizes(), at::kFloat, a[i].device());
    b[i].mutable_grad() = a[i].grad().clone();
  }
}

class ApiAdam8Bit : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(ApiAdam8Bit);

TEST_P(ApiAdam8Bit, StateIsCodesAndScalesAndTheStepIsTheOpsOnThem) {
  auto a = params8(device());
  auto b = copies(a);
  FusedAdamW opt(a, FusedAdamWOptions(0.01).state_dtype(at::kChar));
  // The op by hand on zero state: what the Python front passes for the same group.
  std::vector<at::Tensor> m, v, sm, sv;
  for (const auto& p : b) {
    m.push_back(at::zeros_like(p, at::kChar));
    v.push_back(at::zeros_like(p, at::kByte));
    sm.push_back(at::zeros({(p.numel() + kBlock - 1) / kBlock}, p.options().dtype(at::kFloat)));
    sv.push_back(at::zeros_like(sm.back()));
  }
  mixprec::AdamArgs args;
  args.weight_decay = 1e-2;
  mixprec::StepArgs step;
  step.lr = 0.01;
  step.step_tensor = at::zeros({1}, b[0].options().dtype(at::kFloat));
  for (int k = 0; k < 3; ++k) {
    set_same_grads(a, b);
    opt.step();
    std::vector<at::Tensor> grads;
    for (const auto& p : b) grads.push_back(p.grad());
    at::NoGradGuard no_grad;
    mixprec::adam_(b, grads, m, v, {}, {}, args, step, sm, sv);
  }
  for (size_t i = 0; i < a.size(); ++i) {
    auto& s = state8(opt, a[i]);
    EXPECT_EQ(s.exp_avg().scalar_type(), at::kChar);
    EXPECT_EQ(s.exp_avg_sq().scalar_type(), at::kByte);
    EXPECT_EQ(s.exp_avg_scale().numel(), (a[i].numel() + kBlock - 1) / kBlock);
    EXPECT_TRUE(bitwise_equal(a[i].detach(), b[i].detach())) << "param " << i;
    EXPECT_TRUE(bitwise_equal(s.exp_avg(), m[i])) << "exp_avg codes " << i;
    EXPECT_TRUE(bitwise_equal(s.exp_avg_sq(), v[i])) << "exp_avg_sq codes " << i;
    EXPECT_TRUE(bitwise_equal(s.exp_avg_scale(), sm[i])) << "exp_avg scales " << i;
    EXPECT_TRUE(bitwise_equal(s.exp_avg_sq_scale(), sv[i])) << "exp_avg_sq scales " << i;
    EXPECT_TRUE(s.exp_avg_scale().gt(0).all().item<bool>()) << "a step writes every block's scale";
  }
}

TEST_P(ApiAdam8Bit, CheckpointRestoresTheModeAndContinuesBitIdentically) {
  auto a = params8(device());
  auto b = copies(a);
  FusedAdamW original(a, FusedAdamWOptions(0.01).state_dtype(at::kChar));
  FusedAdamW restored(b, FusedAdamWOptions(0.01));  // float32: the checkpoint's state_dtype comes with it
  for (int k = 0; k < 2; ++k) {
    set_same_grads(a, b);
    original.step();
  }
  load_from_string(restored, save_to_string(original));
  for (size_t i = 0; i < a.size(); ++i) b[i].detach().copy_(a[i].detach());  // the model's own checkpoint
  EXPECT_EQ(static_cast<FusedAdamOptions&>(restored.param_groups()[0].options()).state_dtype(), at::kChar);
  const auto sa = all_state(original, a), sb = all_state(restored, b);
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_TRUE(bitwise_equal(sb[i], sa[i])) << "state tensor " << i;
  set_same_grads(a, b);
  original.step();
  restored.step();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(bitwise_equal(a[i].detach(), b[i].detach())) << "param " << i;
}

TEST_P(ApiAdam8Bit, BadOptionsAndCheckpointsAreRefusedAndChangeNothing) {
  auto a = params8(device());
  expect_c10_error([&] { FusedAdamW(a, FusedAdamWOptions(0.01).state_dtype(at::kChar).amsgrad(true)); },
                   {"amsgrad", "8-bit moments"});
  expect_c10_error([&] { FusedAdamW(a, FusedAdamWOptions(0.01).state_dtype(at::kByte)); },
                   {"state_dtype must be float32, bfloat16 or int8"});
  FusedAdamW target(a, FusedAdamWOptions(0.01).state_dtype(at::kChar));
  auto b = copies(a);
  set_same_grads(a, b);
  target.step();
  // A checkpoint whose scales are the wrong size for their param, and one of float moments into
  // an 8-bit group whose options say int8 (hand-edited: options travel with the state).
  FusedAdamW bad(b, FusedAdamWOptions(0.01).state_dtype(at::kChar));
  bad.step();
  state8(bad, b[2]).exp_avg_scale(at::zeros({5}, b[2].options()));
  const auto before = all_state(target, a);
  std::vector<at::Tensor> snap;
  for (const auto& t : before) snap.push_back(t.clone());
  expect_c10_error([&] { load_from_string(target, save_to_string(bad)); },
                   {"FusedAdamW.load", "state[2]['exp_avg_scale']", "one scale per 256"});
  state8(bad, b[2]).exp_avg_scale(at::zeros({(b[2].numel() + kBlock - 1) / kBlock}, b[2].options()));
  state8(bad, b[1]).exp_avg(at::zeros_like(b[1]));
  expect_c10_error([&] { load_from_string(target, save_to_string(bad)); }, {"state[1]['exp_avg']", "must be Char"});
  expect_unchanged(all_state(target, a), snap, "refused load");
}

}  // namespace
