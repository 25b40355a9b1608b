// The definitions of FusedOptionsFor (include/mixprec/optim/fused_options.h), written once over
// each family's field list; a family's .cpp includes this and instantiates it for its options.
#pragma once

#include <mixprec/optim/fused_options.h>

#include <cstring>
#include <string>
#include <type_traits>

#include "api/api_util.h"

namespace mixprec::optim {
namespace internal {

using namespace mixprec::detail::api;

inline c10::IValue to_ivalue(double v) { return c10::IValue(v); }
inline c10::IValue to_ivalue(bool v) { return c10::IValue(v); }
inline c10::IValue to_ivalue(int64_t v) { return c10::IValue(v); }
// Checkpoints hold a dtype as its c10::ScalarType code.
inline c10::IValue to_ivalue(c10::ScalarType v) { return c10::IValue(static_cast<int64_t>(v)); }

// A field's value from an IValue (read from a checkpoint, or given to set_field): errors name
// `where` and the key.
inline void from_ivalue(const c10::IValue& iv, const char* key, const std::string& where, double& v) {
  v = ivalue_double(iv, key, where);
}
inline void from_ivalue(const c10::IValue& iv, const char* key, const std::string& where, bool& v) {
  v = ivalue_bool(iv, key, where);
}
inline void from_ivalue(const c10::IValue& iv, const char* key, const std::string& where, int64_t& v) {
  v = ivalue_int(iv, key, where);
}
inline void from_ivalue(const c10::IValue& iv, const char* key, const std::string& where, c10::ScalarType& v) {
  const int64_t code = ivalue_int(iv, key, where);
  // Only codes of real dtypes become a ScalarType; which dtypes a family allows is check()'s.
  MIXPREC_CHECK_VALUE(code >= 0 && code < static_cast<int64_t>(c10::ScalarType::NumOptions), where, ": '", key,
                      "' must be a dtype code, got ", mixprec::detail::num(code));
  v = static_cast<c10::ScalarType>(code);
}

// Fields newer than some checkpoints (the lean-weight options of mixprec/optim_args.h): a
// checkpoint without one keeps the value the options have; any other missing field is an error.
inline bool is_later_field(const char* key) {
  return std::strcmp(key, "stochastic_rounding") == 0 || std::strcmp(key, "seed") == 0 ||
         std::strcmp(key, "master_remainder") == 0;
}

// A family's own fields newer than its earlier checkpoints (FusedSGDOptions' state_dtype), read
// like is_later_field's; specialized in the family's .cpp before its explicit instantiation.
template <class Derived> struct LaterOwnFields {
  static bool has(const char*) { return false; }
};

template <class T> void read_into(torch::serialize::InputArchive& a, const char* key, const std::string& where, T& v) {
  from_ivalue(read_ivalue(a, key, where), key, where, v);
}

// beta1 and beta2 are inherited as the pair `betas` (see BetasAccessor).
inline bool is_beta(const char* key) { return std::strcmp(key, "beta1") == 0 || std::strcmp(key, "beta2") == 0; }

}  // namespace internal

template <class Derived, class Args> Args FusedOptionsFor<Derived, Args>::args() const {
  Args a;
  Derived::for_each_field([&](const char*, auto mine, auto theirs) {
    if constexpr (!std::is_null_pointer_v<decltype(theirs)>) a.*theirs = self().*mine;
  });
  return a;
}

template <class Derived, class Args>
std::unique_ptr<torch::optim::OptimizerOptions> FusedOptionsFor<Derived, Args>::clone() const {
  return std::make_unique<Derived>(self());
}

template <class Derived, class Args>
void FusedOptionsFor<Derived, Args>::serialize(torch::serialize::OutputArchive& archive) const {
  Derived::for_each_field(
      [&](const char* key, auto mine, auto) { archive.write(key, internal::to_ivalue(self().*mine)); });
}

template <class Derived, class Args>
void FusedOptionsFor<Derived, Args>::serialize(torch::serialize::InputArchive& archive) {
  Derived read = self();
  const std::string where = Derived::options_name();
  Derived::for_each_field([&](const char* key, auto mine, auto) {
    c10::IValue unused;
    if ((internal::is_later_field(key) || internal::LaterOwnFields<Derived>::has(key)) &&
        !archive.try_read(key, unused))
      return;
    internal::read_into(archive, key, where, read.*mine);
  });
  self() = read;
}

template <class Derived, class Args>
void FusedOptionsFor<Derived, Args>::inherit_unset(const FusedOptions& defaults, const FusedOptions& fresh_options) {
  const auto& d = static_cast<const Derived&>(defaults);
  const auto& fresh = static_cast<const Derived&>(fresh_options);
  const uint64_t named = named_;  // as the group gave it: inheriting below names nothing
  int index = 0;
  bool betas_named = false;
  Derived::for_each_field([&](const char* key, auto mine, auto) {
    const bool was_named = (named >> index++) & 1;
    if (internal::is_beta(key)) {
      betas_named = betas_named || was_named;
    } else if (std::strcmp(key, "lr") == 0) {  // every constructor sets it: named or not
      if (Derived::lr_has_default && self().*mine == fresh.*mine) self().*mine = d.*mine;
    } else if (!was_named && self().*mine == fresh.*mine) {
      self().*mine = d.*mine;
    }
  });
  if constexpr (internal::has_betas<Args>::value) {
    if (!betas_named && self().betas() == fresh.betas()) self().betas(d.betas());
  }
  named_ = named;
}

template <class Derived, class Args>
Derived& FusedOptionsFor<Derived, Args>::set_field(const std::string& key, const c10::IValue& value) {
  const std::string where = std::string(Derived::options_name()) + ".set_field";
  if constexpr (internal::has_betas<Args>::value) {
    if (key == "betas") {
      MIXPREC_CHECK_VALUE(value.isTuple() && value.toTupleRef().elements().size() == 2, where,
                          ": 'betas' must be a tuple of two numbers, got ", value.tagKind());
      const auto& b = value.toTupleRef().elements();
      return self().betas({mixprec::detail::api::ivalue_double(b[0], "betas[0]", where),
                           mixprec::detail::api::ivalue_double(b[1], "betas[1]", where)});
    }
  }
  bool found = false;
  int index = 0;
  Derived::for_each_field([&](const char* k, auto mine, auto) {
    const int i = index++;
    if (found || key != k) return;
    std::decay_t<decltype(self().*mine)> v{};
    internal::from_ivalue(value, k, where, v);  // throws before anything is written
    self().*mine = v;
    note_named(i);
    found = true;
  });
  MIXPREC_CHECK_VALUE(found, where, ": ", Derived::options_name(), " has no option '", key, "'");
  return self();
}

template <class Derived, class Args>
bool FusedOptionsFor<Derived, Args>::same_but_lr(const FusedOptions& other_options) const {
  const auto& other = static_cast<const Derived&>(other_options);
  bool same = true;
  Derived::for_each_field([&](const char* key, auto mine, auto) {
    same = same && (std::strcmp(key, "lr") == 0 || self().*mine == other.*mine);
  });
  return same;
}

}  // namespace mixprec::optim
