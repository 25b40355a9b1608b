// FP8 training for LibTorch: a Linear whose three GEMMs run on FP8 operands (at::_scaled_mm on
// CUDA, an exact-cast fp32 emulation on the CPU), per-tensor scales on the device. The C++ twin
// of python/mixprec/fp8 (same recipe fields, numerics and state keys; see docs/fp8.md).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/options/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/archive.h>

#include <mixprec/export.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mixprec::fp8 {

// _scaled_mm's rule: every GEMM dimension (in, out and the token count) a multiple of 16.
constexpr int64_t kAlign = 16;

enum class Scaling {
  kCurrent,  // each tensor scaled by fp8_max / its own amax, measured just before its cast
  kDelayed,  // the scale comes from the amax history of earlier casts; the cast records its amax
};

// How a Linear runs its GEMMs in FP8 (python: mixprec.fp8.Fp8Recipe, same defaults).
struct MIXPREC_API Recipe {
  // (Before the fields: TORCH_ARG leaves the struct's access private.)
  static Recipe e4m3();  // E4M3 for the gradients too
  // The history length kept: 1 under current scaling.
  int64_t history_len() const { return scaling() == Scaling::kDelayed ? amax_history_len() : 1; }
  // Raises (naming `where` and the field) unless every field is valid.
  void check(const char* where) const;

  TORCH_ARG(c10::ScalarType, forward_dtype) = c10::kFloat8_e4m3fn;  // input and weight
  TORCH_ARG(c10::ScalarType, backward_dtype) = c10::kFloat8_e5m2;   // output gradient
  TORCH_ARG(Scaling, scaling) = Scaling::kCurrent;
  TORCH_ARG(int64_t, amax_history_len) = 16;       // delayed scaling's window
  TORCH_ARG(std::string, amax_reduction) = "max";  // or "most_recent"
  TORCH_ARG(double, margin) = 0.0;                 // scales divided by 2^margin
};

MIXPREC_API double fp8_max(c10::ScalarType dtype);  // 448 (E4M3) or 57344 (E5M2)

// Roles of a Linear's three casts, the rows of its state.
enum Role : int64_t { kInput = 0, kWeight = 1, kGradOutput = 2 };

// One Linear's scaling state: float32 scale [3], amax [3] and amax_history [3, history_len] on
// the device, rows in Role order; the same keys as python's Fp8ScalingState.state_dict(). The
// fp8_linear op (mixprec/ops.h) updates it in place with each cast.
class MIXPREC_API ScalingState {
 public:
  explicit ScalingState(Recipe recipe = {}, c10::Device device = c10::kCPU);

  c10::ScalarType dtype_of(int64_t role) const;
  const Recipe& recipe() const noexcept { return recipe_; }
  // Moves the buffers (a no-op when they are there already).
  void to(c10::Device device);

  at::Tensor scale, amax, amax_history;
  int64_t fallbacks = 0;  // calls that ran plain linear: shapes FP8 cannot take

  // Keys "scale", "amax", "amax_history". load() checks all of it first (shapes of this recipe,
  // finite positive scales): a refused load changes nothing.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  Recipe recipe_;
};

// (a * scale_a) @ (b * scale_b) (+ bias) for FP8 a (row-major) and b (column-major), fp32
// accumulation, rounded once to out_dtype: at::_scaled_mm on CUDA, exact widening to fp32 and
// an fp32 matmul elsewhere (or when emulate is true). The fp8_scaled_mm op, as python's.
MIXPREC_API at::Tensor scaled_mm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                 const at::Tensor& scale_b, c10::ScalarType out_dtype, const at::Tensor& bias = {},
                                 std::optional<bool> emulate = std::nullopt);

// torch::nn::functional::linear through FP8 GEMMs with `state`'s scales where the shapes allow
// (float input and weight, in/out features and token count multiples of 16), else plain linear
// (counted in state.fallbacks). Differentiable: backward casts the output gradient. The
// mixprec::fp8_linear op, so python's Fp8Linear computes the same bits.
MIXPREC_API at::Tensor linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                              ScalingState& state);

// Why `module` cannot become an fp8::Linear, or nullopt if it can: a torch::nn::Linear with
// in_features and out_features multiples of 16 and a float weight.
MIXPREC_API std::optional<std::string> ineligibility(const torch::nn::Module& module);

// torch::nn::Linear's parameters ("weight", "bias": a plain Linear's checkpoint loads) with FP8
// GEMMs. The scaling state is a member, not a buffer: it follows the input's device and is saved
// by save_state().
class MIXPREC_API LinearImpl : public torch::nn::Cloneable<LinearImpl> {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, Recipe recipe = {})
      : LinearImpl(torch::nn::LinearOptions(in_features, out_features), std::move(recipe)) {}
  explicit LinearImpl(const torch::nn::LinearOptions& options, Recipe recipe = {});
  // Takes over `linear`'s weight and bias tensors themselves (an optimizer holding them keeps
  // working); raises if it is not eligible.
  LinearImpl(const torch::nn::LinearImpl& linear, Recipe recipe);

  void reset() override;
  void reset_parameters();  // as torch::nn::Linear: kaiming_uniform(a=sqrt(5)), bias U(+-1/sqrt(in))
  at::Tensor forward(const at::Tensor& input);

  torch::nn::LinearOptions options;
  at::Tensor weight, bias;
  ScalingState state;
};
TORCH_MODULE(Linear);

// What convert() did: the names converted and, for each Linear left alone, why.
struct ConvertResult {
  std::vector<std::string> converted;
  std::vector<std::pair<std::string, std::string>> skipped;
};

// Replaces every eligible torch::nn::Linear held by a torch::nn::Sequential in `model` (itself or
// nested) with an fp8::Linear sharing its parameters. A Linear that another module holds as a
// member is reported in skipped: LibTorch calls such members directly, so build those modules
// with fp8::Linear instead. Validates the recipe before changing anything.
MIXPREC_API ConvertResult convert(torch::nn::Module& model, const Recipe& recipe = {});

// The scaling states of every fp8::Linear in `model`, by module name (python: amp.state_dict()'s
// "fp8" entry). load_state checks every entry first: a refused load changes nothing.
MIXPREC_API void save_state(const torch::nn::Module& model, torch::serialize::OutputArchive& archive);
MIXPREC_API void load_state(torch::nn::Module& model, torch::serialize::InputArchive& archive);

}  // namespace mixprec::fp8
