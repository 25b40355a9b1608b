// Host time per step of mixprec's C++ fused optimizers and GradScaler: 292 tiny tensors of the
// GPT-2-medium layout (24 layers, width 8), so the kernels cost next to nothing and what is timed is
// the bookkeeping around them. Beside each step(), the same op called with lists built beforehand:
// the floor the optimizer's own per-step work (lists, state, checks) adds to.
//
//   ./optim_host_step [--cuda] [--steps N (>= 15)] [--warmup N] [--layers N] [--width N]
// With --cuda the tensors are on cuda:0 and each timed step ends in a device synchronization.
#include <mixprec/mixprec.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.h"

namespace {

using namespace mixprec_bench;
using namespace mixprec::optim;

std::vector<torch::Tensor> leaves(const std::vector<Shape>& shapes, torch::ScalarType dtype, const torch::Device& d) {
  std::vector<torch::Tensor> out;
  for (const auto& s : shapes) out.push_back(torch::randn(s).to(d, dtype).requires_grad_(true));
  return out;
}

// Grads of ps, `sets` of them: step k uses set k % sets (1: the same grad tensors every step, as
// zero_grad(set_to_none=false) leaves them; 2: new grad tensors each step, as after set_to_none).
struct Grads {
  std::vector<std::vector<torch::Tensor>> sets;
  size_t next = 0;
  Grads(const std::vector<torch::Tensor>& ps, int n) : sets(n) {
    for (auto& s : sets)
      for (const auto& p : ps) s.push_back(torch::randn(p.sizes()).to(p.device(), p.scalar_type()).mul_(1e-3));
  }
  void install(std::vector<torch::Tensor>& ps) {
    const auto& s = sets[next++ % sets.size()];
    for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = s[i];
  }
};

}  // namespace

int main(int argc, char** argv) {
  TimingArgs timing{200, 20};
  int64_t layers = 24, width = 8;
  bool cuda = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--cuda") cuda = true;
    else if (a == "--layers" && i + 1 < argc) layers = std::atoll(argv[++i]);
    else if (a == "--width" && i + 1 < argc) width = std::atoll(argv[++i]);
    else if (!timing.take(a, i, argc, argv)) {
      std::fprintf(stderr, "usage: %s [--cuda] [--steps N] [--warmup N] [--layers N] [--width N]\n", argv[0]);
      return 2;
    }
  }
  if (!timing.valid()) return 2;
  if (cuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "--cuda: no CUDA device here\n");
    return 2;
  }
  const int steps = timing.steps, warmup = timing.warmup;
  const torch::Device dev = cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  const std::vector<Shape> shapes = gpt_shapes(layers, width, 8 * width, 2 * width);
  int64_t n = 0;
  for (const auto& s : shapes) n += numel(s);
  std::printf(
      "mixprec C++ optimizer host time: torch %s, %s, %d threads, %zu tensors, %lld elements; median of %d "
      "steps after %d\n",
      TORCH_VERSION, cuda ? "cuda:0" : "CPU", at::get_num_threads(), shapes.size(), static_cast<long long>(n), steps,
      warmup);
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;

  const auto report = [&](const char* name, std::pair<double, double> t) {
    std::printf("%-44s median %8.1f us  min %8.1f us\n", name, 1e3 * t.first, 1e3 * t.second);
  };
  // step() of an optimizer over fresh leaves of `dtype`, with `grad_sets` sets of grads.
  const auto time_opt = [&](const char* name, torch::ScalarType dtype, int grad_sets, auto make) {
    auto ps = leaves(shapes, dtype, dev);
    Grads g(ps, grad_sets);
    std::unique_ptr<FusedOptimizer> opt = make(ps);
    report(name, time_steps(
                     [&] {
                       g.install(ps);
                       opt->step();
                     },
                     dev, warmup, steps));
  };
  time_opt("FusedAdamW fp32", torch::kFloat, 1, [](auto& ps) { return std::make_unique<FusedAdamW>(ps); });
  time_opt("FusedAdamW fp32, new grad tensors each step", torch::kFloat, 2,
           [](auto& ps) { return std::make_unique<FusedAdamW>(ps); });
  time_opt("FusedAdamW fp16 + fp32 masters", torch::kHalf, 1,
           [](auto& ps) { return std::make_unique<FusedAdamW>(ps, FusedAdamWOptions().master_weights(true)); });
  time_opt("FusedSGD fp32, momentum 0.9", torch::kFloat, 1,
           [](auto& ps) { return std::make_unique<FusedSGD>(ps, FusedSGDOptions(0.1).momentum(0.9)); });
  time_opt("FusedLAMB fp32", torch::kFloat, 1, [](auto& ps) { return std::make_unique<FusedLAMB>(ps); });
  time_opt("FusedAdagrad fp32", torch::kFloat, 1, [](auto& ps) { return std::make_unique<FusedAdagrad>(ps); });
  time_opt("FusedNovoGrad fp32", torch::kFloat, 1, [](auto& ps) { return std::make_unique<FusedNovoGrad>(ps); });

  {  // The floor: mixprec::adam_ over lists built once (what FusedAdamW fp32 calls per step).
    auto ps = leaves(shapes, torch::kFloat, dev);
    Grads g(ps, 1);
    g.install(ps);
    std::vector<torch::Tensor> grads, m, v;
    for (const auto& p : ps) {
      grads.push_back(p.grad());
      m.push_back(torch::zeros_like(p));
      v.push_back(torch::zeros_like(p));
    }
    mixprec::StepArgs args;
    args.step_tensor = torch::zeros({1}, torch::TensorOptions().device(dev));
    const mixprec::AdamArgs a = FusedAdamWOptions().args();
    report("mixprec::adam_ alone (lists built once)",
           time_steps([&] { mixprec::adam_(ps, grads, m, v, {}, {}, a, args); }, dev, warmup, steps));
  }
  {  // GradScaler around FusedAdamW: scale, step (its inf check included), update.
    auto ps = leaves(shapes, torch::kFloat, dev);
    Grads g(ps, 1);
    FusedAdamW opt(ps);
    mixprec::amp::GradScaler scaler;
    const torch::Tensor loss = torch::ones({1}, torch::TensorOptions().device(dev));
    report("GradScaler scale + step + update, FusedAdamW", time_steps(
                                                               [&] {
                                                                 g.install(ps);
                                                                 scaler.scale(loss);
                                                                 scaler.step(opt);
                                                                 scaler.update();
                                                               },
                                                               dev, warmup, steps));
    // The inf check step() runs for a fused optimizer (no unscaling), without sorting grads by device.
    std::vector<torch::Tensor> gs;
    for (const auto& p : ps) gs.push_back(p.grad());
    const torch::Tensor found = torch::zeros({}, torch::TensorOptions().device(dev));
    report("non_finite_check_and_unscale_ alone",
           time_steps([&] { mixprec::non_finite_check_and_unscale_(gs, found); }, dev, warmup, steps));
  }
  return 0;
}
