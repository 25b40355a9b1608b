// mixprec::optim::FusedAdamW against LibTorch's torch::optim::AdamW on a GPT-2 parameter set, in one
// run: both checked against each other first, then the median of >= 15 timed steps after warm-up
// (each step bracketed by device synchronization), achieved bandwidth (28 bytes per fp32 param:
// p, g, m, v read; p, m, v written) beside a device copy measured in the same run, and the ratio.
// With --o2 also FusedAdamW's O2 shape (fp16 grads read, fp32 master and moments read and written,
// fp16 model copy written: 28 bytes per param, as benchmarks/optimizer_step.py counts it).
//
//   ./adamw_step                 # GPU when present: GPT-2-medium, 354.9 M params in 292 tensors
//   ./adamw_step --cpu           # CPU: the smaller gpt2-mini set (27.8 M params)
//   options: --shapes gpt2-medium|gpt2-small|gpt2-mini|tiny  --steps N (>= 15)  --warmup N  --o2
#include <mixprec/mixprec.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_util.h"

namespace {

using namespace mixprec_bench;

std::vector<Shape> shape_set(const std::string& name) {
  if (name == "gpt2-medium") return gpt_shapes(24, 1024);
  if (name == "gpt2-small") return gpt_shapes(12, 768);
  if (name == "gpt2-mini") return gpt_shapes(6, 512, 16384);
  if (name == "tiny") return gpt_shapes(2, 128, 4096, 256);
  std::fprintf(stderr, "unknown shape set %s\n", name.c_str());
  std::exit(2);
}

std::vector<torch::Tensor> make(const std::vector<Shape>& shapes, torch::ScalarType dtype, const torch::Device& d,
                                bool leaf) {
  std::vector<torch::Tensor> out;
  for (const auto& s : shapes) {
    torch::Tensor t = torch::randn(s, torch::TensorOptions().dtype(dtype).device(d));
    out.push_back(leaf ? t.requires_grad_(true) : t);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  bool cpu = false, o2 = false;
  std::string set;
  TimingArgs timing{20, 5};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--cpu") cpu = true;
    else if (a == "--o2") o2 = true;
    else if (a == "--shapes" && i + 1 < argc) set = argv[++i];
    else if (!timing.take(a, i, argc, argv)) {
      std::fprintf(stderr, "usage: %s [--cpu] [--shapes NAME] [--steps N] [--warmup N] [--o2]\n", argv[0]);
      return 2;
    }
  }
  if (!timing.valid()) return 2;
  const int steps = timing.steps, warmup = timing.warmup;
  const bool cuda = !cpu && torch::cuda::is_available();
  const torch::Device d = cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (set.empty()) set = cuda ? "gpt2-medium" : "gpt2-mini";
  const std::vector<Shape> shapes = shape_set(set);
  int64_t n = 0;
  for (const auto& s : shapes) n += numel(s);
  std::printf(
      "mixprec C++ AdamW benchmark: torch %s, %s, set %s: %.1f M params in %zu tensors, %d warm-up + %d "
      "timed steps\n",
      TORCH_VERSION, cuda ? "cuda:0" : ("CPU, " + std::to_string(at::get_num_threads()) + " threads").c_str(),
      set.c_str(), n / 1e6, shapes.size(), warmup, steps);
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;

  // One set of gradients, shared by both optimizers (neither writes to grads).
  const auto start = make(shapes, torch::kFloat, d, false);
  const auto grads = make(shapes, torch::kFloat, d, false);
  std::vector<torch::Tensor> pt, pm;
  for (size_t i = 0; i < shapes.size(); ++i) {
    pt.push_back(start[i].clone().requires_grad_(true));
    pm.push_back(start[i].clone().requires_grad_(true));
    pt.back().mutable_grad() = grads[i];
    pm.back().mutable_grad() = grads[i];
  }
  // lr large enough that the first step's displacement dwarfs the fp32 rounding of the weights, so
  // the check below measures the update; the step's cost does not depend on it.
  const double lr = 5e-2, wd = 1e-2;
  torch::optim::AdamW peer(pt, torch::optim::AdamWOptions(lr).weight_decay(wd));
  mixprec::optim::FusedAdamW ours(pm, mixprec::optim::FusedAdamWOptions(lr).weight_decay(wd));

  // Checked before timed: one step from the same state agrees to fp32 rounding.
  peer.step();
  ours.step();
  torch::Tensor err2 = torch::zeros({}, torch::TensorOptions().dtype(torch::kDouble).device(d));
  torch::Tensor ref2 = torch::zeros_like(err2);
  for (size_t i = 0; i < shapes.size(); ++i) {
    err2 += (pm[i].to(torch::kDouble) - pt[i].to(torch::kDouble)).square().sum();
    ref2 += (pt[i].to(torch::kDouble) - start[i].to(torch::kDouble)).square().sum();
  }
  const double rel = std::sqrt(err2.item<double>() / ref2.item<double>());
  std::printf("check: relative error of the first step's update %.2e (bound 1e-5): %s\n", rel,
              rel < 1e-5 ? "ok" : "FAILED");
  if (!(rel < 1e-5)) return 1;

  // A device copy of the same number of fp32 elements: reads and writes 8 bytes per element.
  const torch::Tensor src = torch::randn({n}, torch::TensorOptions().device(d));
  torch::Tensor dst = torch::empty_like(src);
  const auto copy = time_steps([&] { dst.copy_(src); }, d, warmup, steps);
  const double copy_gbs = 8.0 * n / (copy.first * 1e6);
  std::printf("%-34s median %9.3f ms  min %9.3f ms  %8.1f GB/s\n", "device copy", copy.first, copy.second, copy_gbs);

  const auto report = [&](const char* name, std::pair<double, double> t, double bytes_per_param) {
    const double gbs = bytes_per_param * n / (t.first * 1e6);
    std::printf("%-34s median %9.3f ms  min %9.3f ms  %8.1f GB/s  %5.1f%% of copy\n", name, t.first, t.second, gbs,
                100.0 * gbs / copy_gbs);
  };
  const auto t_torch = time_steps([&] { peer.step(); }, d, warmup, steps);
  report("torch::optim::AdamW", t_torch, 28);
  const auto t_ours = time_steps([&] { ours.step(); }, d, warmup, steps);
  report("mixprec::optim::FusedAdamW", t_ours, 28);
  std::printf("speedup FusedAdamW / torch::optim::AdamW: %.2fx\n", t_torch.first / t_ours.first);

  if (o2) {
    // O2 shape: fp16 params and grads, fp32 masters and moments, the fp16 copy written in the same pass.
    std::vector<torch::Tensor> ph;
    for (size_t i = 0; i < shapes.size(); ++i) {
      ph.push_back(start[i].to(torch::kHalf).requires_grad_(true));
      ph.back().mutable_grad() = grads[i].to(torch::kHalf);
    }
    mixprec::optim::FusedAdamW half(ph, mixprec::optim::FusedAdamWOptions(lr).weight_decay(wd).master_weights(true));
    report("mixprec FusedAdamW O2 (fp16+master)", time_steps([&] { half.step(); }, d, warmup, steps), 28);
  }
  return 0;
}
