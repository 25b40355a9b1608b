// The options classes of the fused optimizers, each made from one field list: the family's op
// hyper-parameters (MIXPREC_<FAMILY>_ARGS of mixprec/optim_args.h) plus its option-only fields.
// Accessors, checkpoints, group inheritance and the op's Args struct all come from those lists.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <mixprec/optim/fused_optimizer.h>
#include <mixprec/optim_args.h>

// The weight options of every family, last but state_dtype in its option-only list (FusedOptionsFor
// reads both): fp32 masters of fp16/bf16 params; with master_remainder, of a bf16 param only the
// master's low 16 bits (csrc/ops/front_rules.h holds the rule, docs/optimizers.md the numerics).
#define MIXPREC_FUSED_WEIGHT_OPTIONS(X) X(bool, master_weights, false) X(bool, master_remainder, false)

namespace mixprec::optim {
namespace internal {

template <class Args, class = void> struct has_betas : std::false_type {};
template <class Args>
struct has_betas<Args, std::void_t<decltype(std::declval<Args&>().beta1), decltype(std::declval<Args&>().beta2)>>
    : std::true_type {};

// torch::optim's `betas` tuple for the families whose op takes beta1 and beta2: the one place the
// tuple is mapped onto the two fields (which also have accessors and checkpoint keys of their own).
template <class Derived, bool kHasBetas> class BetasAccessor {};

template <class Derived> class BetasAccessor<Derived, true> {
 public:
  typedef std::tuple<double, double> betas_t;
  Derived& betas(const betas_t& b) {
    auto& self = static_cast<Derived&>(*this);
    self.beta1(std::get<0>(b));
    self.beta2(std::get<1>(b));
    return self;
  }
  betas_t betas() const {
    const auto& self = static_cast<const Derived&>(*this);
    return std::make_tuple(self.beta1(), self.beta2());
  }
};

}  // namespace internal

// Everything an options class does beyond its fields and check(), written once. `Derived` lists
// its fields with MIXPREC_FUSED_OPTIONS_FIELDS and has lr and master_weights among them. Defined
// in the library (csrc/api/fused_options_impl.h), instantiated once per family.
template <class Derived, class Args>
class MIXPREC_API FusedOptionsFor : public FusedOptions,
                                    public internal::BetasAccessor<Derived, internal::has_betas<Args>::value> {
 public:
  using args_type = Args;

  // The op's hyper-parameters, field by field from these options (mixprec::adam_'s AdamArgs, ...).
  Args args() const;

  std::unique_ptr<torch::optim::OptimizerOptions> clone() const override;
  // Every field under its own name (beta1 and beta2 for betas); state_dtype as its dtype code.
  void serialize(torch::serialize::OutputArchive& archive) const override;
  // Reads every field; a missing or mistyped one throws naming it and leaves these options as
  // they were. Ranges are check()'s.
  void serialize(torch::serialize::InputArchive& archive) override;
  double get_lr() const override { return self().lr(); }
  void set_lr(const double lr) override { self().lr(lr); }
  bool uses_master_weights() const override { return self().master_weights(); }
  void set_master_weights(bool on) override { self().master_weights(on); }
  bool uses_master_remainder() const override { return self().master_remainder(); }
  // Field by field, the Python front's rule: a field this group named (through its setter) stays;
  // one it did not name and left at the constructor's value comes from the defaults. betas as one
  // value (both from the defaults, or neither), as torch::optim's tuple field. lr, which every
  // constructor takes, comes from the defaults when equal to the constructor's default, and only
  // where Derived::lr_has_default.
  void inherit_unset(const FusedOptions& defaults, const FusedOptions& fresh) override;
  bool same_but_lr(const FusedOptions& other) const override;

  // Sets the field `key` (its checkpoint key, or "betas") from a number, a bool, a dtype code or,
  // for betas, a tuple of two numbers, as its setter does: for code that takes options by name
  // (configs, tests/cpp/conformance_driver.cpp). An unknown key or a value of the wrong kind
  // throws naming both and what was expected, and changes nothing.
  Derived& set_field(const std::string& key, const c10::IValue& value);

  // Whether a group's lr left at the constructor's value is inherited (not for SGD, whose lr has
  // no default: torch::optim::SGDOptions' rule).
  static constexpr bool lr_has_default = true;

 protected:
  // Bit i: field i of for_each_field's order was named through its setter (see inherit_unset).
  uint64_t named_ = 0;
  void note_named(int field) { named_ |= uint64_t{1} << field; }
  // For an options class whose constructor sets other defaults (FusedAdamWOptions): none named.
  void forget_named() { named_ = 0; }

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
  const Derived& self() const { return static_cast<const Derived&>(*this); }
};

}  // namespace mixprec::optim

// One field: TORCH_ARG's accessors (o.eps(1e-6) sets and chains, o.eps() reads) with its default;
// the setter also records that the field was named (a write through the non-const getter does not).
#define MIXPREC_OPTIONS_ACCESSORS(type, field, default_value)   \
 public:                                                        \
  auto field(const type& new_value) -> decltype(*this) {        \
    this->field##_ = new_value;                                 \
    this->note_named(kField_##field);                           \
    return *this;                                               \
  }                                                             \
  const type& field() const noexcept { return this->field##_; } \
  type& field() noexcept { return this->field##_; }             \
                                                                \
 private:                                                       \
  type field##_ = default_value;
#define MIXPREC_OPTIONS_INDEX(type, field, default_value) kField_##field,
// for_each_field's visit of one field: its checkpoint key, its member, and the op's member or null.
#define MIXPREC_OPTIONS_VISIT_ARG(type, field, default_value) f(#field, &Self::field##_, &args_type::field);
#define MIXPREC_OPTIONS_VISIT_OWN(type, field, default_value) f(#field, &Self::field##_, nullptr);

// In the body of a family's options class `Self` (derived from FusedOptionsFor<Self, Args>): the
// fields of the op's list ARGS and of the option-only list OWN (X-macros of X(type, name,
// default)), and for_each_field, through which FusedOptionsFor reaches all of them.
#define MIXPREC_FUSED_OPTIONS_FIELDS(Self_, ARGS, OWN)                              \
  ARGS(MIXPREC_OPTIONS_ACCESSORS)                                                   \
  OWN(MIXPREC_OPTIONS_ACCESSORS)                                                    \
  enum : int { ARGS(MIXPREC_OPTIONS_INDEX) OWN(MIXPREC_OPTIONS_INDEX) kNumFields }; \
  static_assert(kNumFields <= 64, "named_ holds one bit per field");                \
                                                                                    \
 public:                                                                            \
  static constexpr const char* options_name() { return #Self_; }                    \
  template <class F> static void for_each_field(F&& f) {                            \
    using Self = Self_;                                                             \
    ARGS(MIXPREC_OPTIONS_VISIT_ARG)                                                 \
    OWN(MIXPREC_OPTIONS_VISIT_OWN)                                                  \
  }
