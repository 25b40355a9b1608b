// rms_norm called through the public C++ header on CPU and CUDA: output and gradients against
// torch's rms_norm in float64 (an fp32 weight on a bf16 input too), rstd, and bad input.
#include <gtest/gtest.h>

#include <mixprec/ops.h>
#include <torch/torch.h>
#include <limits>

#include "test_support.h"

namespace {

using namespace mixprec::test;

class RmsNorm : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(RmsNorm);

TEST_P(RmsNorm, OutputAndGradientsMatchFloat64) {
  const at::Tensor x0 = random_tensor({5, 33, 96}, at::kFloat, device());
  const at::Tensor w0 = random_tensor({96}, at::kFloat, device());
  const at::Tensor dy = random_tensor({5, 33, 96}, at::kFloat, device());
  // (input dtype, weight dtype) of mixprec's run, and the bound against float64.
  for (const auto& [dtype, weight_dtype, tol] :
       {std::tuple{at::kFloat, at::kFloat, 1e-5}, std::tuple{at::kBFloat16, at::kFloat, 1e-2}}) {
    auto run = [&](bool ours, at::ScalarType in, at::ScalarType wt) {
      at::Tensor x = x0.to(in, false, true).requires_grad_(true), w = w0.to(wt, false, true).requires_grad_(true);
      const at::Tensor y = ours ? mixprec::rms_norm(x, {96}, w, 1e-5) : at::rms_norm(x, {96}, w, 1e-5);
      y.backward(dy.to(in));
      return std::vector<at::Tensor>{y.detach(), x.grad(), w.grad()};
    };
    const auto ours = run(true, dtype, weight_dtype), ref = run(false, at::kDouble, at::kDouble);
    EXPECT_EQ(ours[0].scalar_type(), dtype);
    EXPECT_EQ(ours[2].scalar_type(), weight_dtype);
    for (size_t i = 0; i < ours.size(); ++i) {
      const at::Tensor r = ref[i].cpu();
      const double err = (ours[i].cpu().to(at::kDouble) - r).norm().item<double>() / r.norm().item<double>();
      EXPECT_LT(err, tol) << dtype << " output/grad " << i;
    }
  }
}

TEST_P(RmsNorm, ForwardReturnsRowRstdAndEpsDefaultsToTorchs) {
  const at::Tensor x = random_tensor({7, 40}, at::kHalf, device());
  const auto [out, rstd] = mixprec::rms_norm_forward(x, {40}, std::nullopt, 1e-5);
  const at::Tensor x64 = x.cpu().to(at::kDouble);
  EXPECT_TRUE(torch::allclose(rstd.cpu().to(at::kDouble), (x64.square().mean(1) + 1e-5).rsqrt(), 1e-5, 1e-6));
  EXPECT_EQ(out.scalar_type(), at::kHalf);
  // eps = nullopt: float32's epsilon, the type torch's F.rms_norm computes fp16 in (fp16's own
  // 2^-10 would change these small rows' output several-fold).
  const at::Tensor small = x * 0.01;
  const at::Tensor want =
      at::rms_norm(small.to(at::kDouble), {40}, std::nullopt, std::numeric_limits<float>::epsilon()).cpu();
  const at::Tensor got = mixprec::rms_norm(small, {40}).cpu().to(at::kDouble);
  EXPECT_LT((got - want).norm().item<double>() / want.norm().item<double>(), 2e-3);
}

TEST_P(RmsNorm, BadInputNamesOpAndArgument) {
  const at::Tensor x = random_tensor({4, 6}, at::kFloat, device());
  const at::Tensor before = x.clone();
  expect_c10_error([&] { mixprec::rms_norm(x, {5}); }, {"mixprec::rms_norm_forward: input", "normalized_shape"});
  expect_c10_error([&] { mixprec::rms_norm(x, {6}, x[0].slice(0, 0, 5)); }, {"mixprec::rms_norm_forward: weight"});
  expect_c10_error([&] { mixprec::rms_norm_forward(x, {6}, x[0].to(at::kHalf), 1e-5); },
                   {"mixprec::rms_norm_forward: weight", "float32"});
  EXPECT_TRUE(bitwise_equal(x, before));
}

}  // namespace
