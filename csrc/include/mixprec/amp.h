// mixprec's mixed precision for LibTorch: a GradScaler whose step never waits on the host for
// mixprec's optimizers, an RAII autocast guard, and Apex's opt levels O0-O3 as one call.
// The C++ twin of mixprec.GradScaler (python/mixprec/grad_scaler.py) and mixprec.amp.initialize.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <mixprec/fp8.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <mixprec/export.h>

namespace mixprec::amp {

// ---- GradScaler ---------------------------------------------------------------------------------
// torch.amp.GradScaler's options plus mixprec's hysteresis and scale bounds.
struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;   // > 1
  TORCH_ARG(double, backoff_factor) = 0.5;  // in (0, 1)
  TORCH_ARG(int64_t, growth_interval) = 2000;
  // Back off only on the hysteresis-th overflow since the scale last changed (Megatron's rule).
  TORCH_ARG(int64_t, hysteresis) = 1;
  TORCH_ARG(std::optional<double>, min_scale) = std::nullopt;  // never back off below it
  TORCH_ARG(std::optional<double>, max_scale) = std::nullopt;  // never grow above it
  // Disabled: scale() returns its input, step() calls optimizer.step(), the rest does nothing.
  TORCH_ARG(bool, enabled) = true;
};

// Dynamic loss scaling, used as torch.amp.GradScaler is:
//
//   auto loss = loss_fn(model->forward(x), y);
//   scaler.scale(loss).backward();
//   scaler.step(optimizer);
//   scaler.update();
//
// The scale, growth and hysteresis trackers and the skipped-step count live on the device of the
// first scaled loss; scale(), unscale_(), step() and update() never read them on the host.
// - mixprec::optim fused optimizers: step() runs a read-only non-finite check of the gradients
//   and hands grad_scale and found_inf to the optimizer, whose kernel unscales and skips the whole
//   step on the device when found_inf is set. No host synchronization at all.
// - any other torch::optim optimizer: its gradients are unscaled in place (one mixprec pass per
//   device), then step() reads found_inf on the host (one synchronization, as torch's scaler does)
//   and calls optimizer.step() only if every gradient was finite. torch::optim's C++ optimizers
//   keep host-side step counts, which a device-side skip could not leave untouched.
// get_scale(), skipped_steps() and save() read device values: they synchronize.
class MIXPREC_API GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // outputs * scale (the input itself when disabled).
  at::Tensor scale(const at::Tensor& outputs);
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs);

  // Divides the optimizer's gradients by the scale in place and records, on the device, whether
  // any was inf/NaN. Optional (step() does what is needed); call it to clip unscaled gradients.
  void unscale_(torch::optim::Optimizer& optimizer);

  // Steps the optimizer unless its gradients held inf/NaN (see the class comment); returns what
  // optimizer.step() returned (undefined when the step was skipped on the host).
  at::Tensor step(torch::optim::Optimizer& optimizer);

  // Updates the scale on the device from every optimizer stepped since the last update: back off
  // on overflow (after `hysteresis` of them, not below min_scale), grow after growth_interval
  // clean steps (not above max_scale).
  void update();
  // Sets the scale to new_scale (still counting this iteration's overflows as skipped steps).
  void update(double new_scale);

  double get_scale() const;        // synchronizes; init_scale before the first scale()
  int64_t skipped_steps() const;   // updates that saw inf/NaN; synchronizes
  int64_t growth_tracker() const;  // clean steps since the last change; synchronizes
  // The device tensors (undefined until the first scale()): no synchronization.
  at::Tensor scale_tensor() const { return scale_; }
  bool is_enabled() const noexcept { return options_.enabled(); }
  const GradScalerOptions& options() const noexcept { return options_; }

  // Checkpoints with the Python scaler's state_dict keys (scale, growth_factor, backoff_factor,
  // growth_interval, _growth_tracker, hysteresis, _hysteresis_tracker, min_scale, max_scale,
  // _skipped_steps). load() validates everything before changing anything.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct PerOptimizer {
    Stage stage = Stage::kReady;
    std::vector<at::Tensor> found_inf_per_device;  // one 0-dim float32 flag per device of grads
  };
  void lazy_init(const c10::Device& device);
  void check_initialized(const char* what) const;
  // Checks (and with inv_scale unscales) the optimizer's grads; one flag per device.
  std::vector<at::Tensor> check_grads(torch::optim::Optimizer& optimizer, const std::optional<at::Tensor>& inv_scale);
  at::Tensor combined_found(const std::vector<at::Tensor>& found) const;

  GradScalerOptions options_;
  // Host values used until the device tensors exist (and after load() before the first scale()).
  double init_scale_;
  int64_t init_growth_tracker_ = 0, init_hysteresis_tracker_, init_skipped_ = 0;
  at::Tensor scale_, growth_tracker_, hysteresis_tracker_, skipped_;
  std::unordered_map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer_;
};

MIXPREC_API torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                                        const GradScaler& scaler);
MIXPREC_API torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, GradScaler& scaler);

// ---- autocast -------------------------------------------------------------------------------------
// RAII autocast region, the C++ form of `with torch.autocast(device_type, dtype, enabled,
// cache_enabled)`: on entry sets the device type's autocast state, dtype and the weight-cast cache;
// on exit (also by an exception) restores all three as they were and, leaving the outermost
// region, clears the cast cache. Nested guards, enabled or disabled, compose as Python's do.
class MIXPREC_API AutocastGuard {
 public:
  // dtype: float16 or bfloat16 (default: the device type's current autocast dtype); cache_enabled
  // default: the current setting.
  explicit AutocastGuard(c10::DeviceType device_type, std::optional<c10::ScalarType> dtype = std::nullopt,
                         bool enabled = true, std::optional<bool> cache_enabled = std::nullopt);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&&) = delete;
  AutocastGuard& operator=(AutocastGuard&&) = delete;

 private:
  c10::DeviceType device_type_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_enabled_;
};

// ---- opt levels -----------------------------------------------------------------------------------
// Apex's opt levels, in float16 or bfloat16:
//   O0  fp32 training (the baseline);
//   O1  fp32 weights, the forward pass under autocast (AmpState::autocast());
//   O2  the model cast to the low dtype except BatchNorm, fp32 master weights kept by a mixprec
//       fused optimizer (written with the model copy in the same kernel pass);
//   O3  everything in the low dtype, no masters.
// Loss scaling is dynamic for float16 at O1 and O2 and off otherwise (bfloat16 has fp32's range).
enum class OptLevel { O0, O1, O2, O3 };

struct AmpOptions {
  AmpOptions(OptLevel opt_level = OptLevel::O1, c10::ScalarType dtype = c10::kHalf)  // NOLINT
      : opt_level_(opt_level), dtype_(dtype) {}
  TORCH_ARG(OptLevel, opt_level);
  TORCH_ARG(c10::ScalarType, dtype);  // kHalf or kBFloat16
  // Overrides of the level's choices (unset: the level's), checked as Apex checks them.
  TORCH_ARG(std::optional<bool>, keep_batchnorm_fp32) = std::nullopt;
  TORCH_ARG(std::optional<bool>, master_weights) = std::nullopt;
  TORCH_ARG(std::optional<bool>, dynamic_loss_scale) = std::nullopt;
  // Modules (by qualified name) also kept in fp32 when the model is cast, besides BatchNorm.
  TORCH_ARG(std::function<bool(const std::string&, const torch::nn::Module&)>, keep_fp32) = nullptr;
  // FP8 (O2/O3 only): after the cast, every eligible torch::nn::Linear in a Sequential becomes an
  // fp8::Linear with this recipe (fp8::convert; docs/cpp.md). Pass dtype kBFloat16, as python's
  // fp8=True defaults to.
  TORCH_ARG(std::optional<fp8::Recipe>, fp8) = std::nullopt;
};

// What initialize() decided and did.
struct MIXPREC_API AmpState {
  OptLevel opt_level = OptLevel::O0;
  c10::ScalarType dtype = c10::kHalf;
  std::optional<c10::ScalarType> cast_model_type;  // the dtype the model was cast to (none at O1)
  bool autocast = false;                           // O1: run the forward under autocast()
  bool keep_batchnorm_fp32 = false;
  bool master_weights = false;
  bool dynamic_loss_scale = false;
  fp8::ConvertResult fp8;  // with options.fp8: the Linears converted and those left (and why)

  // The GradScaler options for this level: enabled iff the loss scale is dynamic.
  GradScalerOptions scaler_options() const;
  // For O1 an enabled autocast region in `dtype`, else a disabled one (so code can always use it).
  // Returned by value: C++17 elides the copy of the non-movable guard.
  AutocastGuard autocast_guard(c10::DeviceType device_type) const;
  // A floating-point input cast to the model's dtype (O2/O3, Apex casts inputs the same way), or
  // returned as is.
  at::Tensor cast_input(const at::Tensor& input) const;
};

// Prepares `model` and `optimizer` for `options.opt_level()` in one call, before training starts:
// casts the model's floating-point parameters, their gradients and buffers in place (the
// optimizer keeps holding the same tensors), keeps affine BatchNorm (and keep_fp32 modules) in
// fp32 at O2, and for O2 turns on the master weights of the mixprec fused optimizer, seeded from
// the fp32 values before the cast. O2 needs a mixprec::optim fused optimizer; with a plain
// torch::optim optimizer it raises. The model's parameters must be fp32 on entry.
MIXPREC_API AmpState initialize(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                const AmpOptions& options);
// The same without an optimizer (inference, or an optimizer made afterwards: then turn on its
// master weights yourself at O2, which creates masters from the cast params).
MIXPREC_API AmpState initialize(torch::nn::Module& model, const AmpOptions& options);

MIXPREC_API const char* to_string(OptLevel level);

}  // namespace mixprec::amp
