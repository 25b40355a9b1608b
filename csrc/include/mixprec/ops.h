// mixprec's ops for C++ (LibTorch) callers: typed calls through PyTorch's dispatcher, so C++
// reaches exactly the kernels that Python's torch.ops.mixprec does. Host-compilable, header-only.
// Semantics of each op are documented with its schema in csrc/ops/library.cpp and in
// python/mixprec/_ops.py; the library (mixprec::mixprec) must be linked for the ops to exist.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace mixprec {
namespace detail {
// Defined in libmixprec. Referencing it keeps the library linked even under --as-needed: its
// static initializers are what register the ops with the dispatcher.
const char* built_torch_version();
inline const char* const kLinkedAgainstTorch = built_torch_version();
}  // namespace detail
// Sets found_inf to 1 if any grad holds inf/NaN; with inv_scale also multiplies the grads by it,
// in place or into `out`; per_tensor_found[i] = 1 for each grad i that held inf/NaN.
inline void non_finite_check_and_unscale_(at::TensorList grads, const std::optional<at::Tensor>& found_inf,
                                          const std::optional<at::Tensor>& inv_scale = std::nullopt,
                                          at::TensorList out = {},
                                          const std::optional<at::Tensor>& per_tensor_found = std::nullopt) {
  using Sig = void(at::TensorList, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, at::TensorList,
                   const std::optional<at::Tensor>&);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mixprec::non_finite_check_and_unscale_", "")
                             .typed<Sig>();
  op.call(grads, found_inf, inv_scale, out, per_tensor_found);
}

// Multiplies every tensor in place by the device scalar `scale` (gradient clipping).
inline void scale_(at::TensorList tensors, const at::Tensor& scale) {
  non_finite_check_and_unscale_(tensors, std::nullopt, scale);
}

struct ScaleUpdateOptions {
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t hysteresis = 1;
  double min_scale = 0.0;
  double max_scale = 0.0;  // 0: no cap
};

// Dynamic loss-scale update on the device (see library.cpp for the exact rule).
inline void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& found_inf,
                          const ScaleUpdateOptions& options = {},
                          const std::optional<at::Tensor>& hysteresis_tracker = std::nullopt,
                          const std::optional<at::Tensor>& skipped_steps = std::nullopt) {
  using Sig = void(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                   const std::optional<at::Tensor>&, const at::Tensor&, double, double, int64_t, int64_t, double,
                   double);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::update_scale_", "").typed<Sig>();
  op.call(scale, growth_tracker, hysteresis_tracker, skipped_steps, found_inf, options.growth_factor,
          options.backoff_factor, options.growth_interval, options.hysteresis, options.min_scale, options.max_scale);
}

// (total, per_tensor): the 2- or inf-norm of all tensors together (0-dim float32) and of each
// (float32 [n], empty unless per_tensor).
inline std::tuple<at::Tensor, at::Tensor> multi_tensor_norm(at::TensorList tensors, double ord = 2.0,
                                                            bool per_tensor = false) {
  using Sig = std::tuple<at::Tensor, at::Tensor>(at::TensorList, double, bool);
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mixprec::multi_tensor_norm", "").typed<Sig>();
  return op.call(tensors, ord, per_tensor);
}

}  // namespace mixprec
