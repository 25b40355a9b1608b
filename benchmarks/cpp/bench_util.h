// Helpers shared by mixprec's C++ benchmarks: GPT-2-style parameter shape sets and a timer that
// takes the median (and minimum) of timed calls after warm-up, synchronizing the device around each.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace mixprec_bench {

using Shape = std::vector<int64_t>;

// GPT-2-style parameter shapes in nn.Module order (as benchmarks/common.py's gpt_shapes): 2 + 12
// per layer + 2 tensors (292 for 24 layers).
inline std::vector<Shape> gpt_shapes(int64_t layers, int64_t width, int64_t vocab = 50304, int64_t ctx = 1024) {
  std::vector<Shape> s{{vocab, width}, {ctx, width}};
  for (int64_t l = 0; l < layers; ++l) {
    const std::vector<Shape> block{{width}, {width}, {3 * width, width}, {3 * width}, {width, width},     {width},
                                   {width}, {width}, {4 * width, width}, {4 * width}, {width, 4 * width}, {width}};
    s.insert(s.end(), block.begin(), block.end());
  }
  s.push_back({width});
  s.push_back({width});
  return s;
}

inline int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

inline void sync(const torch::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize();
}

inline double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// --steps N and --warmup N, shared by every benchmark's command line.
struct TimingArgs {
  int steps, warmup;
  // Takes argv[i] (and its value, advancing i) when it is one of the two.
  bool take(const std::string& a, int& i, int argc, char** argv) {
    if (i + 1 >= argc || (a != "--steps" && a != "--warmup")) return false;
    (a == "--steps" ? steps : warmup) = std::atoi(argv[++i]);
    return true;
  }
  // The median needs at least 15 timed steps; says so when there are fewer.
  bool valid() const {
    if (steps >= 15) return true;
    std::fprintf(stderr, "--steps must be >= 15 (the median needs them)\n");
    return false;
  }
};

// Median and minimum (ms) of `steps` timed calls of fn after `warmup` untimed ones.
inline std::pair<double, double> time_steps(const std::function<void()>& fn, const torch::Device& d, int warmup,
                                            int steps) {
  for (int i = 0; i < warmup; ++i) fn();
  sync(d);
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    sync(d);
    const double t0 = now_ms();
    fn();
    sync(d);
    ms.push_back(now_ms() - t0);
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms.size() % 2 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
  return {median, ms.front()};
}

}  // namespace mixprec_bench
