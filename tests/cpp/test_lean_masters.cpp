// The C++ front's lean weights: master_remainder(true) (bf16 params, int16 remainders for fp32
// masters) bit for bit against fp32 masters, across checkpoints, its refusal; stochastic rounding.
#include <gtest/gtest.h>
#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include "api_support.h"
#include "test_support.h"

namespace {

using namespace mixprec::test;
using mixprec::optim::FusedAdam;
using mixprec::optim::FusedAdamOptions;
using mixprec::optim::FusedSGD;
using mixprec::optim::FusedSGDOptions;
using mixprec::test::api::load_from_string;
using mixprec::test::api::save_to_string;

// The fp32 master that (bf16 weight, int16 remainder) hold (kernels/optim_common.h's rebuild).
at::Tensor rebuild(const at::Tensor& weight, const at::Tensor& remainder) {
  const at::Tensor low = remainder.cpu().to(at::kLong).bitwise_and(0xFFFF);
  const at::Tensor high =
      weight.detach().cpu().view(at::kShort).to(at::kLong).bitwise_and(0xFFFF) - low.gt(0x8000).to(at::kLong);
  at::Tensor b = high.bitwise_left_shift(16).bitwise_or(low).bitwise_and(0xFFFFFFFFLL);
  b = at::where(b.ge(int64_t{1} << 31), b - (int64_t{1} << 32), b);
  return b.to(at::kInt).view(at::kFloat);
}

std::vector<at::Tensor> bf16_params(const c10::Device& device) {
  std::vector<at::Tensor> ps;
  for (int64_t n : {7, 513, 65537, 1}) ps.push_back(random_tensor({n}, at::kBFloat16, device).requires_grad_(true));
  return ps;
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (const auto& p : ps) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

void same_grads(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    a[i].mutable_grad() = random_tensor(a[i].sizes(), at::kBFloat16, a[i].device());
    b[i].mutable_grad() = a[i].grad().clone();
  }
}

// The master_param slot: fp32, or with master_remainder(true) the int16 remainder.
const at::Tensor& master_slot(const torch::optim::Optimizer& opt, const at::Tensor& p) {
  return static_cast<const mixprec::optim::FusedParamState&>(*opt.state().at(p.unsafeGetTensorImpl())).master_param();
}

template <class Opt> at::Tensor master_of(Opt& opt, const at::Tensor& p) {
  const at::Tensor m = master_slot(opt, p);
  return m.scalar_type() == at::kShort ? rebuild(p, m) : m.cpu();
}

// Every master bit-identical; the weights equal except at exact ties (low half 0x8000), where the
// remainder's weight is the neighbour toward zero.
template <class A, class B>
void expect_same_masters(A& reference, const std::vector<at::Tensor>& ra, B& lean, const std::vector<at::Tensor>& rb,
                         int step) {
  for (size_t i = 0; i < ra.size(); ++i) {
    const at::Tensor m = master_of(reference, ra[i]);
    ASSERT_TRUE(bitwise_equal(master_of(lean, rb[i]), m)) << "step " << step << " master " << i;
    const at::Tensor tie = m.view(at::kInt).bitwise_and(0xFFFF).eq(0x8000);
    const at::Tensor wa = ra[i].detach().cpu(), wb = rb[i].detach().cpu();
    ASSERT_TRUE(bitwise_equal(wa.masked_fill(tie, 0), wb.masked_fill(tie, 0))) << "step " << step << " weight " << i;
  }
}

class ApiLeanMasters : public DeviceTest {};

TEST_P(ApiLeanMasters, RemainderRunIsTheFp32MasterRunBitForBit) {
  auto a = bf16_params(device());
  auto b = copies(a);
  FusedAdam reference(a, FusedAdamOptions(3e-3).weight_decay(0.01).master_weights(true));
  FusedAdam lean(b, FusedAdamOptions(3e-3).weight_decay(0.01).master_weights(true).master_remainder(true));
  for (int step = 0; step < 300; ++step) {
    same_grads(a, b);
    reference.step();
    lean.step();
    expect_same_masters(reference, a, lean, b, step);
  }
  for (const auto& p : b) EXPECT_EQ(master_slot(lean, p).scalar_type(), at::kShort);  // 2 bytes, not 4
}

TEST_P(ApiLeanMasters, CheckpointsMoveBetweenRemainderAndFp32Masters) {
  for (bool from_remainder : {true, false}) {
    auto a = bf16_params(device());
    FusedSGD source(a, FusedSGDOptions(0.1).momentum(0.9).master_weights(true).master_remainder(from_remainder));
    for (int step = 0; step < 5; ++step) {
      same_grads(a, copies(a));
      source.step();
    }
    auto b = copies(a);  // the model's weights travel with the model
    FusedSGD target(b, FusedSGDOptions(0.1).momentum(0.9).master_weights(true).master_remainder(!from_remainder));
    load_from_string(target, save_to_string(source));
    // The checkpoint's options come with it, as every option does; the form is then chosen again.
    auto& options = static_cast<FusedSGDOptions&>(target.param_groups()[0].options());
    ASSERT_EQ(options.master_remainder(), from_remainder);
    options.master_remainder(!from_remainder);
    for (int step = 5; step < 20; ++step) {
      same_grads(a, b);
      source.step();
      target.step();
      expect_same_masters(source, a, target, b, step);
    }
    // After its first step each master has the form its group keeps, as in the Python front: an
    // fp32 master under the weight an fp32-master step writes (rounded to nearest even), or a
    // remainder.
    for (const auto& p : b) {
      const at::Tensor& slot = master_slot(target, p);
      ASSERT_EQ(slot.scalar_type(), from_remainder ? at::kFloat : at::kShort);
      if (from_remainder) EXPECT_TRUE(bitwise_equal(p.detach().cpu(), slot.cpu().to(at::kBFloat16)));
    }
  }
}

TEST_P(ApiLeanMasters, RemainderWithoutBf16ParamsIsRefusedAndChangesNothing) {
  for (at::ScalarType bad : {at::kHalf, at::kFloat}) {
    auto ps = bf16_params(device());
    ps.push_back(random_tensor({5}, bad, device()).requires_grad_(true));
    FusedAdam opt(ps, FusedAdamOptions(1e-3).master_weights(true).master_remainder(true));
    for (const auto& p : ps) p.mutable_grad() = random_tensor(p.sizes(), p.scalar_type(), p.device());
    const auto before = clone_all(ps);
    expect_c10_error([&] { opt.step(); }, {"FusedAdam", "params[4]", "master_remainder needs bfloat16 params"});
    expect_unchanged(ps, before, "params");
    EXPECT_TRUE(opt.state().empty());
  }
}

TEST_P(ApiLeanMasters, StochasticRoundingIsSeededAndReproducible) {
  auto a = bf16_params(device());
  auto b = copies(a), c = copies(a);
  const auto options = [](int64_t seed) { return FusedSGDOptions(0.05).stochastic_rounding(true).seed(seed); };
  FusedSGD oa(a, options(11)), ob(b, options(11)), oc(c, options(12));
  for (int step = 0; step < 5; ++step) {
    same_grads(a, b);
    for (size_t i = 0; i < a.size(); ++i) c[i].mutable_grad() = a[i].grad().clone();
    oa.step();
    ob.step();
    oc.step();
  }
  bool differs = false;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "param " << i;
    differs = differs || !bitwise_equal(a[i], c[i]);
  }
  EXPECT_TRUE(differs) << "another seed rounded identically";
  auto d = copies(a);
  for (const auto& p : d) p.mutable_grad() = random_tensor(p.sizes(), at::kBFloat16, p.device());
  FusedSGD with_masters(d, options(1).master_weights(true));
  const auto before = clone_all(d);
  expect_c10_error([&] { with_masters.step(); }, {"stochastic_rounding", "master_params must be empty"});
  expect_unchanged(d, before, "params");
}

MIXPREC_INSTANTIATE_DEVICE_TESTS(ApiLeanMasters);

}  // namespace
