// torch's fused-optimizer contract through the C++ front: after GradScaler::step with a
// mixprec::optim::FusedAdam, each grad holds the unscaled gradient; a skipped step leaves it alone.
#include <gtest/gtest.h>
#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include "test_support.h"

namespace {

using namespace mixprec::test;
using mixprec::amp::GradScaler;
using mixprec::amp::GradScalerOptions;
using mixprec::optim::FusedAdam;
using mixprec::optim::FusedAdamOptions;

class ApiGradWriteback : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(ApiGradWriteback);

at::Tensor a_loss(const c10::Device& device) { return torch::ones({}, at::TensorOptions().device(device)); }

TEST_P(ApiGradWriteback, FusedAdamLeavesGradsUnscaledAndSkipsLeaveThemAlone) {
  auto rng = host_rng();
  for (at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (bool masters : {false, true}) {
      if (masters && dtype == at::kFloat) continue;
      std::vector<at::Tensor> ps;
      for (int64_t n : boundary_sizes(rng)) ps.push_back(random_tensor({n}, dtype, device()).requires_grad_(true));
      FusedAdam opt(ps, FusedAdamOptions(0.01).weight_decay(0.01).master_weights(masters));
      // Not a power of two: the written-back grad is g * float32(1/scale), rounded to the dtype.
      GradScaler scaler(GradScalerOptions().init_scale(3000.0).growth_interval(1000));
      for (int step = 0; step < 2; ++step) {
        scaler.scale(a_loss(device()));
        const double scale = scaler.get_scale();
        std::vector<at::Tensor> scaled;
        for (auto& p : ps) {
          p.mutable_grad() = (random_tensor(p.sizes(), at::kFloat, device()) * scale).to(dtype);
          scaled.push_back(p.grad().clone());
        }
        scaler.step(opt);
        scaler.update();
        const at::Tensor inv = at::reciprocal(at::full({}, scale, at::kFloat));
        for (size_t i = 0; i < ps.size(); ++i) {
          const at::Tensor want = (scaled[i].cpu().to(at::kFloat) * inv).to(dtype);
          EXPECT_TRUE(bitwise_equal(ps[i].grad().cpu(), want)) << dtype << " masters " << masters << " grad " << i;
          const at::Tensor exact = scaled[i].cpu().to(at::kDouble) / scale;
          const double eps = dtype == at::kFloat ? 1.2e-7 : dtype == at::kHalf ? 9.8e-4 : 7.9e-3;  // finfo.eps
          EXPECT_LE(rel_err(ps[i].grad().cpu().to(at::kDouble), exact), eps) << dtype << " grad " << i;
        }
      }
      // An overflow in one grad: every grad (the clean ones still scaled), param and state as it was.
      scaler.scale(a_loss(device()));
      for (auto& p : ps) p.mutable_grad() = (random_tensor(p.sizes(), at::kFloat, device()) * 3000.0).to(dtype);
      inject(ps[2].grad(), first_last_random(ps[2].numel(), rng), kNaN);
      std::vector<at::Tensor> before;
      for (const auto& p : ps) {
        before.push_back(p.grad().clone());
        before.push_back(p.detach().clone());
        for (const auto& kv :
             static_cast<mixprec::optim::FusedAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()))
                 .defined_tensors())
          before.push_back(kv.second.clone());
      }
      scaler.step(opt);
      scaler.update();
      std::vector<at::Tensor> after;
      for (const auto& p : ps) {
        after.push_back(p.grad());
        after.push_back(p.detach());
        for (const auto& kv :
             static_cast<mixprec::optim::FusedAdamParamState&>(*opt.state().at(p.unsafeGetTensorImpl()))
                 .defined_tensors())
          after.push_back(kv.second);
      }
      expect_unchanged(after, before, "skipped step");
      EXPECT_EQ(scaler.skipped_steps(), 1);
    }
  }
}

TEST_P(ApiGradWriteback, WithoutAScalerGradsAreOnlyRead) {
  auto ps = std::vector<at::Tensor>{random_tensor({129}, at::kHalf, device()).requires_grad_(true)};
  FusedAdam opt(ps, FusedAdamOptions(0.01).master_weights(true));
  ps[0].mutable_grad() = random_tensor({129}, at::kHalf, device());
  const at::Tensor before = ps[0].grad().clone();
  opt.step();
  EXPECT_TRUE(bitwise_equal(ps[0].grad(), before));
}

}  // namespace
