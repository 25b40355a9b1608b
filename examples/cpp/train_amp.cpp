// Trains a small MLP (with BatchNorm) on a synthetic regression task with O2-style mixed precision
// through mixprec's C++ API: the model in fp16 (bf16 with --bf16) except BatchNorm, fp32 master
// weights inside FusedAdamW, dynamic loss scaling with GradScaler. Prints loss, loss scale and step
// time; runs on the GPU when there is one, else on the CPU. Exits non-zero if training failed.
//
//   ./train_amp [--steps N] [--bf16] [--opt-level O0|O1|O2|O3] [--cpu]
#include <mixprec/mixprec.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

struct Args {
  int steps = 300;
  bool bf16 = false;
  bool cpu = false;
  mixprec::amp::OptLevel level = mixprec::amp::OptLevel::O2;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--steps" && i + 1 < argc) {
      a.steps = std::atoi(argv[++i]);
    } else if (s == "--bf16") {
      a.bf16 = true;
    } else if (s == "--cpu") {
      a.cpu = true;
    } else if (s == "--opt-level" && i + 1 < argc) {
      const std::string l = argv[++i];
      if (l == "O0") a.level = mixprec::amp::OptLevel::O0;
      else if (l == "O1") a.level = mixprec::amp::OptLevel::O1;
      else if (l == "O2") a.level = mixprec::amp::OptLevel::O2;
      else if (l == "O3") a.level = mixprec::amp::OptLevel::O3;
      else {
        std::fprintf(stderr, "unknown opt level %s\n", l.c_str());
        std::exit(2);
      }
    } else {
      std::fprintf(stderr, "usage: %s [--steps N] [--bf16] [--opt-level O0|O1|O2|O3] [--cpu]\n", argv[0]);
      std::exit(2);
    }
  }
  return a;
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  torch::manual_seed(0);
  const bool cuda = !args.cpu && torch::cuda::is_available();
  const torch::Device device = cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  const auto dtype = args.bf16 ? torch::kBFloat16 : torch::kHalf;

  // The task: y = teacher(x) + noise, a fixed random network the student learns to imitate.
  const int64_t in = 64, hidden = 256, out = 8, batch = 256;
  torch::nn::Sequential teacher(torch::nn::Linear(in, 32), torch::nn::Tanh(), torch::nn::Linear(32, out));
  teacher->to(device);
  torch::nn::Sequential model(torch::nn::Linear(in, hidden), torch::nn::BatchNorm1d(hidden), torch::nn::ReLU(),
                              torch::nn::Linear(hidden, hidden), torch::nn::ReLU(), torch::nn::Linear(hidden, out));
  model->to(device);

  mixprec::optim::FusedAdamW optimizer(model->parameters(), mixprec::optim::FusedAdamWOptions(2e-3).weight_decay(1e-4));
  // One call: cast the model (BatchNorm stays fp32), seed exact fp32 masters in the optimizer.
  const mixprec::amp::AmpState amp =
      mixprec::amp::initialize(*model, optimizer, mixprec::amp::AmpOptions(args.level, dtype));
  mixprec::amp::GradScaler scaler(amp.scaler_options());

  std::printf("mixprec C++ example: %s, %s, opt level %s, %d steps, loss scaling %s\n", cuda ? "CUDA" : "CPU",
              args.bf16 ? "bfloat16" : "float16", mixprec::amp::to_string(args.level), args.steps,
              scaler.is_enabled() ? "dynamic" : "off");
  double first_loss = 0, last_loss = 0, total_ms = 0;
  int timed = 0;
  for (int step = 1; step <= args.steps; ++step) {
    const torch::Tensor x = torch::randn({batch, in}, device);
    torch::Tensor y;
    {
      torch::NoGradGuard no_grad;
      y = teacher->forward(x) + 0.01 * torch::randn({batch, out}, device);
    }
    if (cuda) torch::cuda::synchronize();
    const double t0 = now_ms();
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      auto autocast = amp.autocast_guard(device.type());  // enabled at O1 only
      const torch::Tensor pred = model->forward(amp.cast_input(x));
      loss = torch::mse_loss(pred.to(torch::kFloat), y);  // the loss in fp32
    }
    scaler.scale(loss).backward();
    scaler.step(optimizer);  // for mixprec's optimizers: unscale and overflow skip inside the kernel
    scaler.update();
    if (cuda) torch::cuda::synchronize();
    const double ms = now_ms() - t0;
    if (step > 5) {  // after warm-up
      total_ms += ms;
      ++timed;
    }
    const double l = loss.item<double>();  // read for printing only; training itself never syncs
    if (step == 1) first_loss = l;
    last_loss = l;
    if (step == 1 || step % 50 == 0 || step == args.steps)
      std::printf("step %4d  loss %.5f  scale %8.0f  step %.3f ms\n", step, l, scaler.get_scale(), ms);
  }
  std::printf("done: loss %.5f -> %.5f, %lld skipped steps, mean step %.3f ms\n", first_loss, last_loss,
              static_cast<long long>(scaler.skipped_steps()), timed ? total_ms / timed : 0.0);
  const auto masters = optimizer.master_params();
  std::printf("first layer: model weight %s, master weight %s\n", c10::toString(model->parameters()[0].scalar_type()),
              c10::toString(masters[0].scalar_type()));
  if (!(last_loss < 0.5 * first_loss)) {
    std::fprintf(stderr, "training did not reduce the loss enough\n");
    return 1;
  }
  return 0;
}
