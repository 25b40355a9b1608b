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

inline void read_into(torch::serialize::InputArchive& a, const char* key, const std::string& where, double& v) {
  v = read_double(a, key, where);
}
inline void read_into(torch::serialize::InputArchive& a, const char* key, const std::string& where, bool& v) {
  v = read_bool(a, key, where);
}
inline void read_into(torch::serialize::InputArchive& a, const char* key, const std::string& where, int64_t& v) {
  v = read_int(a, key, where);
}
inline void read_into(torch::serialize::InputArchive& a, const char* key, const std::string& where,
                      c10::ScalarType& v) {
  const int64_t code = read_int(a, key, where);
  // Only codes of real dtypes become a ScalarType; which dtypes a family allows is check()'s.
  MIXPREC_CHECK_VALUE(code >= 0 && code < static_cast<int64_t>(c10::ScalarType::NumOptions), where, ": '", key,
                      "' must be a dtype code, got ", mixprec::detail::num(code));
  v = static_cast<c10::ScalarType>(code);
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
  Derived::for_each_field(
      [&](const char* key, auto mine, auto) { internal::read_into(archive, key, where, read.*mine); });
  self() = read;
}

template <class Derived, class Args>
void FusedOptionsFor<Derived, Args>::inherit_unset(const FusedOptions& defaults, const FusedOptions& fresh_options) {
  const auto& d = static_cast<const Derived&>(defaults);
  const auto& fresh = static_cast<const Derived&>(fresh_options);
  Derived::for_each_field([&](const char* key, auto mine, auto) {
    if (internal::is_beta(key) || (!Derived::lr_has_default && std::strcmp(key, "lr") == 0)) return;
    if (self().*mine == fresh.*mine) self().*mine = d.*mine;
  });
  if constexpr (internal::has_betas<Args>::value) {
    if (self().betas() == fresh.betas()) self().betas(d.betas());
  }
}

}  // namespace mixprec::optim
