// The loss-scaling ops called through the public C++ header, against plain ATen references.
#include <gtest/gtest.h>
#include <mixprec/ops.h>
#include <torch/torch.h>

#include <limits>

namespace {

TEST(LossScale, UnscaleInPlaceMatchesReferenceAndFlagsInf) {
  std::vector<at::Tensor> grads{torch::randn({70001}), torch::randn({33}).to(torch::kHalf)};
  grads[1][5] = std::numeric_limits<float>::infinity();
  std::vector<at::Tensor> ref;
  for (const auto& g : grads) ref.push_back((g.to(torch::kFloat) * 0.25f).to(g.scalar_type()));
  auto found_inf = torch::zeros({1});
  auto inv_scale = torch::full({1}, 0.25f);
  mixprec::non_finite_check_and_unscale_(grads, found_inf, inv_scale);
  EXPECT_EQ(found_inf.item<float>(), 1.f);
  EXPECT_TRUE(torch::equal(grads[0], ref[0]));
  EXPECT_TRUE(torch::equal(grads[1], ref[1]));
}

}  // namespace
