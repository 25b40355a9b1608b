// cross_entropy_forward / cross_entropy_backward called through the public C++ header on CPU and
// CUDA: losses, lse and the gradient against float64 log_softmax, ignored rows, and bad input.
#include <gtest/gtest.h>
#include <mixprec/ops.h>
#include <torch/torch.h>

#include <cmath>

#include "test_support.h"

namespace {

using namespace mixprec::test;

const at::ScalarType kFloatTypes[] = {at::kFloat, at::kHalf, at::kBFloat16};
constexpr int64_t kIgnore = -100;

class CrossEntropy : public DeviceTest {};
MIXPREC_INSTANTIATE_DEVICE_TESTS(CrossEntropy);

TEST_P(CrossEntropy, MatchesFloat64LogSoftmaxWithIgnoredRows) {
  for (const at::ScalarType dtype : kFloatTypes) {
    for (const int64_t vocab : {1, 9, 1025}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + ", V = " + std::to_string(vocab));
      const int64_t rows = 37;
      const at::Tensor logits = random_tensor({rows, vocab}, dtype, device(), 8.0);
      at::Tensor target = torch::randint(vocab, {rows}, torch::kLong);
      target.index_put_({torch::rand({rows}) < 0.25}, kIgnore);
      target = target.to(device());
      const at::Tensor g = random_tensor({rows}, at::kFloat, device());

      const auto [losses, lse] = mixprec::cross_entropy_forward(logits, target, kIgnore);
      const at::Tensor grad = mixprec::cross_entropy_backward(g, logits, target, lse, kIgnore);
      ASSERT_EQ(losses.scalar_type(), at::kFloat);
      ASSERT_EQ(grad.scalar_type(), dtype);
      ASSERT_TRUE(grad.sizes().equals(logits.sizes()));

      // float64 reference of the stored logits: losses, lse and g * (softmax - onehot).
      const at::Tensor x = logits.to(torch::kCPU, torch::kDouble);
      const at::Tensor t = target.cpu();
      const at::Tensor keep = t != kIgnore;
      const at::Tensor safe_t = torch::where(keep, t, torch::zeros_like(t));
      const at::Tensor logp = torch::log_softmax(x, 1);
      const at::Tensor ref_losses = torch::where(keep, -logp.gather(1, safe_t.unsqueeze(1)).squeeze(1), 0.0);
      const at::Tensor onehot = torch::one_hot(safe_t, vocab).to(torch::kDouble);
      // p_t - 1 as minus the others' sum: 1 - p_t can be below even float64's resolution.
      const at::Tensor others = logp.exp() * (1.0 - onehot);
      const at::Tensor p_minus_onehot = others - onehot * others.sum(1, true);
      const at::Tensor ref_grad =
          torch::where(keep.unsqueeze(1), g.cpu().to(torch::kDouble).unsqueeze(1) * p_minus_onehot, 0.0);
      // Tiny losses of dominant targets sit below fp32's resolution of log(1 + tiny): measured
      // against the lse they are computed from, as in the Python tests' bound.
      const double loss_err = (losses.cpu().to(torch::kDouble) - ref_losses).norm().item<double>() /
                              (torch::logsumexp(x, 1).norm().item<double>() + 1e-30);
      EXPECT_LT(loss_err, 1e-6) << "losses";
      EXPECT_LT(rel_err(lse, torch::logsumexp(x, 1)), 1e-5) << "lse";
      const at::Tensor peer =
          (g.cpu().unsqueeze(1) * (torch::softmax(x.to(torch::kFloat), 1) - onehot.to(torch::kFloat))).to(dtype);
      // fp32: 1e-5 plus lse's own fp32 rounding, which every exp(x - lse) carries (|lse| * 2^-24).
      const double lse_rounding = 2.0 * torch::logsumexp(x, 1).abs().max().item<double>() * std::ldexp(1.0, -24);
      const double bound = dtype == at::kFloat
                               ? 1e-5 + lse_rounding
                               : 2.0 * rel_err(torch::where(keep.unsqueeze(1), peer, 0), ref_grad) + 1e-6;
      EXPECT_LT(rel_err(grad, ref_grad), bound) << "grad";
      EXPECT_TRUE(torch::equal(grad.cpu().index({~keep}), torch::zeros_like(grad.cpu().index({~keep}))));
    }
  }
}

TEST_P(CrossEntropy, BadInputNamesOpAndArgumentAndChangesNothing) {
  const at::Tensor logits = random_tensor({4, 6}, at::kHalf, device());
  const at::Tensor target = torch::zeros({4}, torch::TensorOptions().dtype(torch::kLong).device(device()));
  const auto before = clone_all({logits, target});
  expect_c10_error([&] { mixprec::cross_entropy_forward(logits, target.to(torch::kInt)); },
                   {"mixprec::cross_entropy_forward: target", "Long"});
  expect_c10_error([&] { mixprec::cross_entropy_forward(logits.t(), target); },
                   {"mixprec::cross_entropy_forward: logits", "not contiguous"});
  expect_c10_error(
      [&] {
        mixprec::cross_entropy_backward(torch::ones({3}, logits.options().dtype(at::kFloat)), logits, target,
                                        torch::zeros({4}, logits.options().dtype(at::kFloat)));
      },
      {"mixprec::cross_entropy_backward: grad_losses", "[4]"});
  expect_unchanged({logits, target}, before, "argument");
}

}  // namespace
