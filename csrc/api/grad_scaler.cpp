// mixprec::amp::GradScaler (include/mixprec/amp.h): dynamic loss scaling on mixprec's ops, with the
// scale on the device and, for mixprec's fused optimizers, the skip decided inside their kernels.
#include <mixprec/amp.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <cmath>
#include <utility>

#include <mixprec/ops.h>
#include <mixprec/optim/fused_optimizer.h>

#include "api/api_util.h"
#include "kernels/loss_scale.h"  // kScaleFloor
#include "ops/device_copy.h"

namespace mixprec::amp {

namespace {
constexpr const char* kName = "mixprec::amp::GradScaler";

// A loss scale must survive the float32 scale tensor, as the Python front requires: positive,
// normal and finite (one that rounds to a subnormal, 0 or inf makes every unscaled gradient
// inf/NaN). kScaleFloor is also the lowest scale a backoff reaches.
constexpr double kMaxFloat = 3.4028234663852886e38;
void check_scale(const std::string& where, const char* name, double v) {
  MIXPREC_CHECK_VALUE(v >= kernels::kScaleFloor && v <= kMaxFloat, where, ": invalid ", name, " ", detail::num(v),
                      "; expected a normal float32 in [2^-126, 3.4028235e+38]");
}

// min_scale <= `name` <= max_scale where those are given.
void check_bounds(const GradScalerOptions& o, const std::string& where, const char* name, double v) {
  if (o.min_scale())
    MIXPREC_CHECK_VALUE(v >= *o.min_scale(), where, ": invalid ", name, " ", detail::num(v),
                        "; expected a number >= min_scale (", detail::num(*o.min_scale()), ")");
  if (o.max_scale())
    MIXPREC_CHECK_VALUE(v <= *o.max_scale(), where, ": invalid ", name, " ", detail::num(v),
                        "; expected a number <= max_scale (", detail::num(*o.max_scale()), ")");
}

// Every option, before anything is written: errors name `where` (the GradScaler call), the option
// and what is expected. The op takes growth_interval and hysteresis as 32-bit integers.
void check_options(const GradScalerOptions& o, const std::string& where) {
  constexpr int64_t kInt32Max = 2147483647;
  check_scale(where, "init_scale", o.init_scale());
  MIXPREC_CHECK_VALUE(std::isfinite(o.growth_factor()) && o.growth_factor() > 1, where, ": invalid growth_factor ",
                      detail::num(o.growth_factor()), "; expected a finite number > 1");
  MIXPREC_CHECK_VALUE(o.backoff_factor() > 0 && o.backoff_factor() < 1, where, ": invalid backoff_factor ",
                      detail::num(o.backoff_factor()), "; expected a number in (0, 1)");
  MIXPREC_CHECK_VALUE(o.growth_interval() >= 1 && o.growth_interval() <= kInt32Max, where, ": invalid growth_interval ",
                      detail::num(o.growth_interval()), "; expected an integer in [1, 2^31 - 1]");
  MIXPREC_CHECK_VALUE(o.hysteresis() >= 1 && o.hysteresis() <= kInt32Max, where, ": invalid hysteresis ",
                      detail::num(o.hysteresis()), "; expected an integer in [1, 2^31 - 1]");
  if (o.min_scale())
    MIXPREC_CHECK_VALUE(*o.min_scale() >= 0 && *o.min_scale() <= kMaxFloat, where, ": invalid min_scale ",
                        detail::num(*o.min_scale()), "; expected a finite float32 >= 0");
  if (o.max_scale()) check_scale(where, "max_scale", *o.max_scale());
  if (o.min_scale() && o.max_scale())
    MIXPREC_CHECK_VALUE(*o.max_scale() >= *o.min_scale(), where, ": invalid max_scale ", detail::num(*o.max_scale()),
                        "; expected a number >= min_scale (", detail::num(*o.min_scale()), ")");
  check_bounds(o, where, "init_scale", o.init_scale());
}

// 1 (float32, on the scale's device) when the scale cannot unscale: its float32 inverse is inf,
// NaN, 0 or negative (a scale of 0, NaN, inf, a tiny subnormal, or negative). Counted as an
// overflow, so the step is skipped and update() backs off (or keeps a NaN scale NaN), without
// a host sync. The unscale op flags most of these itself; the fused optimizers' kernels, which
// divide by the scale, and torch's op for other grads do not.
at::Tensor bad_scale_flag(const at::Tensor& inv_scale) {
  return at::logical_and(inv_scale.isfinite(), inv_scale.gt(0)).logical_not().to(at::kFloat);
}

// The reciprocal in float64, then rounded, as torch.amp.GradScaler does (bit-equal unscaling).
at::Tensor scale_inverse(const at::Tensor& scale) { return scale.to(at::kDouble).reciprocal().to(at::kFloat); }

bool op_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }
}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(std::move(options)),
      init_scale_(options_.init_scale()),
      init_hysteresis_tracker_(options_.hysteresis()) {
  if (options_.enabled()) check_options(options_, kName);
}

void GradScaler::lazy_init(const c10::Device& device) {
  if (scale_.defined()) return;
  const auto on = at::TensorOptions().device(device);
  scale_ = at::scalar_tensor(init_scale_, on.dtype(at::kFloat));
  growth_tracker_ = at::scalar_tensor(init_growth_tracker_, on.dtype(at::kInt));
  hysteresis_tracker_ = at::scalar_tensor(init_hysteresis_tracker_, on.dtype(at::kInt));
  skipped_ = at::scalar_tensor(init_skipped_, on.dtype(at::kLong));
}

void GradScaler::check_initialized(const char* what) const {
  MIXPREC_CHECK(scale_.defined(), kName, ": ", what,
                "() before any scale(): scale the loss (scaler.scale(loss).backward()) earlier in the iteration");
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!options_.enabled()) return outputs;
  lazy_init(outputs.device());
  return outputs * detail::to_device(scale_, outputs.device());
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> out;
  out.reserve(outputs.size());
  for (const auto& t : outputs) out.push_back(scale(t));
  return out;
}

std::vector<at::Tensor> GradScaler::check_grads(torch::optim::Optimizer& optimizer,
                                                const std::optional<at::Tensor>& inv_scale) {
  // Float32/16/bf16 contiguous grads: one mixprec pass per device, whatever the mix of dtypes.
  // Anything else (float64, non-contiguous, sparse values of other dtypes): torch's own op.
  // Sorted afresh each call, unlike the optimizers' lists: grads are new tensors after
  // zero_grad(set_to_none), and sorting one reads no more than checking a cached key for it would
  // (a loop of field reads; the scaler's time is its ops: the inf check alone takes ~40 us over
  // 292 tiny tensors in benchmarks/cpp/optim_host_step).
  struct PerDevice {
    c10::Device device;
    std::vector<at::Tensor> ours, others;
  };
  std::vector<PerDevice> devices;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      at::Tensor g = p.grad();
      if (g.is_sparse()) {
        // Duplicate indices are summed later; summed scaled fp16 values may overflow, so check the
        // coalesced values (as torch does).
        if (g.scalar_type() == at::kHalf) {
          p.mutable_grad() = g.coalesce();
          g = p.grad();
        }
        g = g._values();
      }
      PerDevice* d = nullptr;
      for (auto& e : devices)
        if (e.device == g.device()) d = &e;
      if (d == nullptr) {
        devices.push_back({g.device(), {}, {}});
        d = &devices.back();
      }
      (op_dtype(g.scalar_type()) && g.is_contiguous() ? d->ours : d->others).push_back(g);
    }
  }
  std::vector<at::Tensor> found;
  torch::NoGradGuard no_grad;
  for (auto& d : devices) {
    at::Tensor f = at::scalar_tensor(0.0, at::TensorOptions().dtype(at::kFloat).device(d.device));
    std::optional<at::Tensor> inv;
    if (inv_scale) inv = detail::to_device(*inv_scale, d.device);
    if (!d.ours.empty()) mixprec::non_finite_check_and_unscale_(d.ours, f, inv);
    if (!d.others.empty()) {
      const at::Tensor one =
          inv ? *inv : at::scalar_tensor(1.0, at::TensorOptions().dtype(at::kFloat).device(d.device));
      at::_amp_foreach_non_finite_check_and_unscale_(d.others, f, one);
    }
    found.push_back(f);
  }
  return found;
}

at::Tensor GradScaler::combined_found(const std::vector<at::Tensor>& found) const {
  MIXPREC_CHECK(!found.empty(), kName, ": no inf checks were recorded (no parameter of the optimizer has a gradient)");
  if (found.size() == 1) return detail::to_device(found[0], scale_.device());
  std::vector<at::Tensor> on;
  for (const auto& f : found) on.push_back(detail::to_device(f, scale_.device()).reshape({}));
  return at::stack(on).sum();
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  check_initialized("unscale_");
  PerOptimizer& st = per_optimizer_[&optimizer];
  MIXPREC_CHECK(st.stage != Stage::kUnscaled, kName,
                ": unscale_() has already been called on this optimizer since the last update()");
  MIXPREC_CHECK(st.stage != Stage::kStepped, kName, ": unscale_() is being called after step()");
  const at::Tensor inv = scale_inverse(scale_);
  st.found_inf_per_device = check_grads(optimizer, inv);
  if (!st.found_inf_per_device.empty()) st.found_inf_per_device.push_back(bad_scale_flag(inv));
  st.stage = Stage::kUnscaled;
}

at::Tensor GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return optimizer.step();
  check_initialized("step");
  PerOptimizer& st = per_optimizer_[&optimizer];
  MIXPREC_CHECK(st.stage != Stage::kStepped, kName, ": step() has already been called since the last update()");

  if (auto* fused = dynamic_cast<optim::FusedOptimizer*>(&optimizer)) {
    // The kernel unscales (unless unscale_() already did) and skips on the device.
    if (st.stage == Stage::kReady) {
      st.found_inf_per_device = check_grads(optimizer, std::nullopt);
      if (!st.found_inf_per_device.empty()) st.found_inf_per_device.push_back(bad_scale_flag(scale_inverse(scale_)));
    }
    const at::Tensor found = combined_found(st.found_inf_per_device);
    optim::GradScaling scaling;
    if (st.stage == Stage::kReady) scaling.grad_scale = scale_;
    scaling.found_inf = found;
    struct Restore {  // the optimizer's own setting comes back, also when step() throws
      optim::FusedOptimizer* opt;
      optim::GradScaling previous;
      ~Restore() { opt->set_grad_scaling(std::move(previous)); }
    } restore{fused, fused->grad_scaling()};
    fused->set_grad_scaling(std::move(scaling));
    at::Tensor result = fused->step();
    st.stage = Stage::kStepped;
    return result;
  }

  if (st.stage == Stage::kReady) unscale_(optimizer);
  const at::Tensor found = combined_found(st.found_inf_per_device);
  at::Tensor result;
  // torch::optim's optimizers keep host state (step counts): skipping means not calling step().
  if (found.item<float>() == 0.f) result = optimizer.step();
  st.stage = Stage::kStepped;
  return result;
}

void GradScaler::update() {
  if (!options_.enabled()) return;
  check_initialized("update");
  std::vector<at::Tensor> found;
  for (const auto& kv : per_optimizer_)
    for (const auto& f : kv.second.found_inf_per_device) found.push_back(f);
  MIXPREC_CHECK(!found.empty(), kName, ": no inf checks were recorded prior to update()");
  mixprec::ScaleUpdateOptions o;
  o.growth_factor = options_.growth_factor();
  o.backoff_factor = options_.backoff_factor();
  o.growth_interval = options_.growth_interval();
  o.hysteresis = options_.hysteresis();
  o.min_scale = options_.min_scale().value_or(0.0);
  o.max_scale = options_.max_scale().value_or(0.0);
  mixprec::update_scale_(scale_, growth_tracker_, combined_found(found), o, hysteresis_tracker_, skipped_);
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled()) return;
  check_initialized("update");
  const std::string where = std::string(kName) + ".update";
  check_scale(where, "new_scale", new_scale);
  check_bounds(options_, where, "new_scale", new_scale);
  std::vector<at::Tensor> found;
  for (const auto& kv : per_optimizer_)
    for (const auto& f : kv.second.found_inf_per_device) found.push_back(f);
  scale_.fill_(new_scale);
  if (!found.empty()) skipped_.add_(combined_found(found).ne(0).to(at::kLong));
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled()) return 1.0;
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

int64_t GradScaler::skipped_steps() const {
  if (!options_.enabled()) return 0;
  return skipped_.defined() ? skipped_.item<int64_t>() : init_skipped_;
}

int64_t GradScaler::growth_tracker() const {
  if (!options_.enabled()) return 0;
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : init_growth_tracker_;
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("enabled", c10::IValue(options_.enabled()));
  if (!options_.enabled()) return;
  MIXPREC_CHECK(per_optimizer_.empty(), kName,
                ": save() only at the start of an iteration or after update(), not between step() and update()");
  archive.write("scale", c10::IValue(get_scale()));
  archive.write("growth_factor", c10::IValue(options_.growth_factor()));
  archive.write("backoff_factor", c10::IValue(options_.backoff_factor()));
  archive.write("growth_interval", c10::IValue(options_.growth_interval()));
  archive.write("_growth_tracker", c10::IValue(growth_tracker()));
  archive.write("hysteresis", c10::IValue(options_.hysteresis()));
  archive.write("_hysteresis_tracker", c10::IValue(hysteresis_tracker_.defined() ? hysteresis_tracker_.item<int64_t>()
                                                                                 : init_hysteresis_tracker_));
  detail::api::write_optional_double(archive, "min_scale", options_.min_scale());
  detail::api::write_optional_double(archive, "max_scale", options_.max_scale());
  archive.write("_skipped_steps", c10::IValue(skipped_steps()));
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  using namespace mixprec::detail::api;
  if (!options_.enabled()) return;
  const std::string where = std::string(kName) + ".load";
  c10::IValue enabled;
  MIXPREC_CHECK_VALUE(!archive.try_read("enabled", enabled) || !enabled.isBool() || enabled.toBool(), where,
                      ": the checkpoint was saved from a disabled GradScaler and holds no scale");
  // Read and check everything, then change anything.
  GradScalerOptions o = options_;
  const double scale = read_double(archive, "scale", where);
  o.growth_factor(read_double(archive, "growth_factor", where));
  o.backoff_factor(read_double(archive, "backoff_factor", where));
  o.growth_interval(read_int(archive, "growth_interval", where));
  const int64_t growth = read_int(archive, "_growth_tracker", where);
  o.hysteresis(read_int(archive, "hysteresis", where));
  const int64_t hysteresis_tracker = read_int(archive, "_hysteresis_tracker", where);
  o.min_scale(read_optional_double(archive, "min_scale", where));
  o.max_scale(read_optional_double(archive, "max_scale", where));
  const int64_t skipped = read_int(archive, "_skipped_steps", where);
  o.init_scale(scale);
  check_options(o, where);
  // The trackers are int32 on the device.
  MIXPREC_CHECK_VALUE(growth >= 0 && growth <= 2147483647, where, ": '_growth_tracker' must be in [0, 2^31 - 1], got ",
                      detail::num(growth));
  MIXPREC_CHECK_VALUE(hysteresis_tracker >= 0 && hysteresis_tracker <= o.hysteresis(), where,
                      ": '_hysteresis_tracker' must be in [0, hysteresis = ", detail::num(o.hysteresis()), "], got ",
                      detail::num(hysteresis_tracker));
  MIXPREC_CHECK_VALUE(skipped >= 0, where, ": '_skipped_steps' must be >= 0, got ", detail::num(skipped));

  o.init_scale(options_.init_scale());  // the constructor's value stays what it was
  options_ = o;
  init_scale_ = scale;
  init_growth_tracker_ = growth;
  init_hysteresis_tracker_ = hysteresis_tracker;
  init_skipped_ = skipped;
  if (scale_.defined()) {  // fills: no sync
    scale_.fill_(scale);
    growth_tracker_.fill_(growth);
    hysteresis_tracker_.fill_(hysteresis_tracker);
    skipped_.fill_(skipped);
  }
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const GradScaler& scaler) {
  scaler.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, GradScaler& scaler) {
  scaler.load(archive);
  return archive;
}

}  // namespace mixprec::amp
