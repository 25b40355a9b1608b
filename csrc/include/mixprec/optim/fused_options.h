// The options classes of the fused optimizers, each made from one field list: the family's op
// hyper-parameters (MIXPREC_<FAMILY>_ARGS of mixprec/optim_args.h) plus its option-only fields.
// Accessors, checkpoints, group inheritance and the op's Args struct all come from those lists.
#pragma once

#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#include <mixprec/optim/fused_optimizer.h>
#include <mixprec/optim_args.h>

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
  // Field by field; betas as one value (both taken from the defaults, or neither), as
  // torch::optim's tuple field is; lr only where Derived::lr_has_default.
  void inherit_unset(const FusedOptions& defaults, const FusedOptions& fresh) override;

  // Whether a group's lr left at the constructor's value is inherited (not for SGD, whose lr has
  // no default: torch::optim::SGDOptions' rule).
  static constexpr bool lr_has_default = true;

 private:
  Derived& self() { return static_cast<Derived&>(*this); }
  const Derived& self() const { return static_cast<const Derived&>(*this); }
};

}  // namespace mixprec::optim

// One field: TORCH_ARG's accessors (o.eps(1e-6) sets and chains, o.eps() reads) with its default.
#define MIXPREC_OPTIONS_ACCESSORS(type, field, default_value) TORCH_ARG(type, field) = default_value;
// for_each_field's visit of one field: its checkpoint key, its member, and the op's member or null.
#define MIXPREC_OPTIONS_VISIT_ARG(type, field, default_value) f(#field, &Self::field##_, &args_type::field);
#define MIXPREC_OPTIONS_VISIT_OWN(type, field, default_value) f(#field, &Self::field##_, nullptr);

// In the body of a family's options class `Self` (derived from FusedOptionsFor<Self, Args>): the
// fields of the op's list ARGS and of the option-only list OWN (X-macros of X(type, name,
// default)), and for_each_field, through which FusedOptionsFor reaches all of them.
#define MIXPREC_FUSED_OPTIONS_FIELDS(Self_, ARGS, OWN)           \
  ARGS(MIXPREC_OPTIONS_ACCESSORS)                                \
  OWN(MIXPREC_OPTIONS_ACCESSORS)                                 \
                                                                 \
 public:                                                         \
  static constexpr const char* options_name() { return #Self_; } \
  template <class F> static void for_each_field(F&& f) {         \
    using Self = Self_;                                          \
    ARGS(MIXPREC_OPTIONS_VISIT_ARG)                              \
    OWN(MIXPREC_OPTIONS_VISIT_OWN)                               \
  }
