// linear_bias_grad, linear_weight_bias_grad and linear called through the public C++ header on CPU
// and CUDA: the column sum and the weight gradient against float64, linear's gradients against
// ATen's own linear, and bad input.
#include <gtest/gtest.h>
#include <mixprec/ops.h>
#include <torch/torch.h>

#include <cmath>

#include "test_support.h"

namespace {

using namespace mixprec::test;

class Linear : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(Linear);

TEST_P(Linear, BiasGradIsTheRowSumInFp32) {
  for (const at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (const int64_t cols : {1, 9, 1280}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + ", cols = " + std::to_string(cols));
      const at::Tensor grad = random_tensor({1025, cols}, dtype, device());
      const at::Tensor got = mixprec::linear_bias_grad(grad);
      ASSERT_EQ(got.scalar_type(), dtype);
      const at::Tensor ref = grad.cpu().to(at::kDouble).sum(0);
      // fp32 accumulation of 1025 values, then one rounding to the dtype (its unit roundoff).
      const double roundoff = dtype == at::kFloat  ? std::ldexp(1.0, -24)
                              : dtype == at::kHalf ? std::ldexp(1.0, -11)
                                                   : std::ldexp(1.0, -8);
      const at::Tensor bound =
          1025 * std::ldexp(1.0, -23) * grad.cpu().to(at::kDouble).abs().sum(0) + 2 * roundoff * ref.abs();
      EXPECT_TRUE(((got.cpu().to(at::kDouble) - ref).abs() <= bound + 1e-30).all().item<bool>());
    }
  }
}

TEST_P(Linear, GradientsMatchTorchsLinear) {
  const at::Tensor x0 = random_tensor({3, 17, 8}, at::kFloat, device());
  const at::Tensor w0 = random_tensor({5, 8}, at::kFloat, device());
  const at::Tensor b0 = random_tensor({5}, at::kFloat, device());
  const at::Tensor dy = random_tensor({3, 17, 5}, at::kFloat, device());
  auto run = [&](bool ours) {
    at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true),
               b = b0.clone().requires_grad_(true);
    // The peer is at::linear, what Python's torch.nn.functional.linear calls. The C++ frontend's
    // torch::nn::functional::linear is not it: for input of more than 2 dims it runs matmul and then
    // adds the bias, where at::linear folds the rows into one addmm (on CUDA, cuBLASLt adds the
    // bias in the GEMM's epilogue), so its rounding differs and the outputs are not bitwise equal.
    const at::Tensor y = ours ? mixprec::linear(x, w, b) : at::linear(x, w, b);
    y.backward(dy);
    return std::vector<at::Tensor>{y.detach(), x.grad(), w.grad(), b.grad()};
  };
  const auto ours = run(true), torchs = run(false);
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(ours[i], torchs[i])) << "output/grad " << i;
  EXPECT_TRUE(torch::allclose(ours[3], torchs[3], 1e-5, 1e-5)) << "bias grad";
}

TEST_P(Linear, WeightAndBiasGradsTogetherWithinFp32Accumulation) {
  // On CUDA in fp16/bf16 one cuBLASLt GEMM; elsewhere torch's mm and linear_bias_grad.
  for (const at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const int64_t rows = 513;
    const at::Tensor grad = random_tensor({rows, 40}, dtype, device());
    const at::Tensor input = random_tensor({rows, 24}, dtype, device());
    const auto [grad_weight, grad_bias] = mixprec::linear_weight_bias_grad(grad, input);
    ASSERT_EQ(grad_weight.sizes(), (at::IntArrayRef{40, 24}));
    ASSERT_EQ(grad_bias.sizes(), (at::IntArrayRef{40}));
    const at::Tensor g = grad.cpu().to(at::kDouble), x = input.cpu().to(at::kDouble);
    const double eps = dtype == at::kFloat  ? std::ldexp(1.0, -10)  // torch's fp32 mm may run in TF32
                       : dtype == at::kHalf ? std::ldexp(1.0, -10)
                                            : std::ldexp(1.0, -7);
    const at::Tensor ref_w = g.t().mm(x), ref_b = g.sum(0);
    const at::Tensor bound_w = rows * std::ldexp(1.0, -23) * g.abs().t().mm(x.abs()) + eps * ref_w.abs() +
                               (dtype == at::kFloat ? rows * eps * g.abs().t().mm(x.abs()) : at::zeros_like(ref_w));
    const at::Tensor bound_b = rows * std::ldexp(1.0, -23) * g.abs().sum(0) + eps * ref_b.abs();
    EXPECT_TRUE(((grad_weight.cpu().to(at::kDouble) - ref_w).abs() <= bound_w + 1e-30).all().item<bool>());
    EXPECT_TRUE(((grad_bias.cpu().to(at::kDouble) - ref_b).abs() <= bound_b + 1e-30).all().item<bool>());
  }
}

TEST_P(Linear, BadInputNamesOpAndArgument) {
  const at::Tensor x = random_tensor({2, 4}, at::kFloat, device());
  const at::Tensor w = random_tensor({3, 4}, at::kFloat, device());
  expect_c10_error([&] { mixprec::linear(x, w.view({12})); }, {"mixprec::linear: weight", "2-D"});
  expect_c10_error([&] { mixprec::linear(x, w, w[0]); }, {"mixprec::linear: bias", "[3]"});
  expect_c10_error([&] { mixprec::linear_bias_grad(x.t()); }, {"mixprec::linear_bias_grad: grad", "not contiguous"});
  expect_c10_error([&] { mixprec::linear_bias_grad(x.to(at::kDouble)); },
                   {"mixprec::linear_bias_grad: grad", "Double"});
  expect_c10_error([&] { mixprec::linear_weight_bias_grad(x, w); },
                   {"mixprec::linear_weight_bias_grad: input", "same number of rows"});
  expect_c10_error([&] { mixprec::linear_weight_bias_grad(x, x.to(at::kHalf)); },
                   {"mixprec::linear_weight_bias_grad: input", "one dtype"});
}

}  // namespace
