// layer_norm called through the public C++ header on CPU and CUDA: output and gradients against
// torch's LayerNorm in float64, the forward op's statistics, and bad input.
#include <gtest/gtest.h>
#include <mixprec/ops.h>
#include <torch/torch.h>

#include "test_support.h"

namespace {

using namespace mixprec::test;

class LayerNorm : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(LayerNorm);

TEST_P(LayerNorm, OutputAndGradientsMatchFloat64) {
  const at::Tensor x0 = random_tensor({5, 33, 96}, at::kFloat, device());
  const at::Tensor w0 = random_tensor({96}, at::kFloat, device());
  const at::Tensor b0 = random_tensor({96}, at::kFloat, device());
  const at::Tensor dy = random_tensor({5, 33, 96}, at::kFloat, device());
  auto run = [&](bool ours, at::ScalarType dtype) {
    at::Tensor x = x0.to(dtype, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true),
               w = w0.to(dtype, false, true).requires_grad_(true), b = b0.to(dtype, false, true).requires_grad_(true);
    const at::Tensor y = ours ? mixprec::layer_norm(x, {96}, w, b)
                              : torch::nn::functional::layer_norm(
                                    x, torch::nn::functional::LayerNormFuncOptions({96}).weight(w).bias(b));
    y.backward(dy.to(dtype));
    return std::vector<at::Tensor>{y.detach(), x.grad(), w.grad(), b.grad()};
  };
  const auto ours = run(true, at::kFloat), ref = run(false, at::kDouble);
  for (size_t i = 0; i < ours.size(); ++i) {
    const at::Tensor r = ref[i].cpu();
    const double err = (ours[i].cpu().to(at::kDouble) - r).norm().item<double>() / r.norm().item<double>();
    EXPECT_LT(err, 1e-5) << "output/grad " << i;
  }
}

TEST_P(LayerNorm, ForwardReturnsRowStatistics) {
  const at::Tensor x = random_tensor({7, 40}, at::kHalf, device());
  const auto [out, mean, rstd] = mixprec::layer_norm_forward(x, std::nullopt, std::nullopt, 1e-5);
  const at::Tensor x64 = x.cpu().to(at::kDouble);
  EXPECT_TRUE(torch::allclose(mean.cpu().to(at::kDouble), x64.mean(1), 1e-6, 1e-6));
  const at::Tensor var = x64.var(1, /*unbiased=*/false);
  EXPECT_TRUE(torch::allclose(rstd.cpu().to(at::kDouble), (var + 1e-5).rsqrt(), 1e-5, 1e-6));
  EXPECT_EQ(out.scalar_type(), at::kHalf);
}

TEST_P(LayerNorm, BadInputNamesOpAndArgument) {
  const at::Tensor x = random_tensor({4, 6}, at::kFloat, device());
  expect_c10_error([&] { mixprec::layer_norm(x, {5}); }, {"mixprec::layer_norm: input", "normalized_shape"});
  expect_c10_error([&] { mixprec::layer_norm(x, {6}, x[0].slice(0, 0, 5)); }, {"mixprec::layer_norm: weight"});
  expect_c10_error([&] { mixprec::layer_norm_forward(x, x[0].to(at::kHalf), std::nullopt, 1e-5); },
                   {"mixprec::layer_norm_forward: weight", "one dtype"});
}

}  // namespace
