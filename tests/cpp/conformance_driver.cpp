// mixprec_conformance: runs the scenarios of tests/conformance/scenarios.py (written by
// tests/python/test_conformance.py with torch.save) through the C++ front's public API only
// (mixprec::optim::Fused*, mixprec::amp::GradScaler) and writes what it got with torch::pickle_save,
// so pytest can compare both fronts bit for bit. Usage: mixprec_conformance IN.pt OUT.pt
#include <mixprec/amp.h>
#include <mixprec/optim.h>

#include <ATen/ATen.h>
#include <torch/serialize.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace {

using c10::IValue;
using Dict = c10::impl::GenericDict;
using List = c10::impl::GenericList;
using mixprec::optim::FusedOptimizer;
using mixprec::optim::FusedParamState;
using torch::optim::OptimizerOptions;
using torch::optim::OptimizerParamGroup;
using Groups = std::vector<std::vector<at::Tensor>>;

IValue at_key(const Dict& d, const std::string& key) {
  const auto it = d.find(IValue(key));
  if (it == d.end()) throw std::runtime_error("conformance driver: the scenario lacks '" + key + "'");
  return it->value();
}

double number(const IValue& v) { return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt()); }

Dict new_dict() { return Dict(c10::StringType::get(), c10::AnyType::get()); }
List new_list() { return List(c10::AnyType::get()); }

// ---- each family's options, set by name from the scenario's values ------------------------------
// The scenario names options as the Python front does, which are the C++ fields' names (the
// families' X-macro lists): set_field takes each by name, so a new hyper-parameter needs no edit
// here. Only dtypes travel as names ("bfloat16") and become the dtype codes set_field takes.
IValue field_value(const IValue& v) {
  if (!v.isString()) return v;
  const std::string& name = v.toStringRef();
  static const std::map<std::string, c10::ScalarType> dtypes{
      {"float32", c10::kFloat}, {"float16", c10::kHalf}, {"bfloat16", c10::kBFloat16}};
  const auto it = dtypes.find(name);
  if (it == dtypes.end()) throw std::runtime_error("conformance driver: unknown dtype " + name);
  return IValue(static_cast<int64_t>(it->second));
}

template <class O> void apply(O& o, const Dict& values) {
  for (const auto& kv : values) o.set_field(kv.key().toStringRef(), field_value(kv.value()));
}

// A family: how to build the optimizer from the scenario and set one group option by name.
struct Family {
  std::function<std::unique_ptr<FusedOptimizer>(const Groups&, const Dict&, const std::vector<Dict>&)> make;
  std::function<void(OptimizerOptions&, const std::string&, const IValue&)> set;
};

template <class Opt, class O> Family family() {
  Family f;
  f.make = [](const Groups& params, const Dict& defaults, const std::vector<Dict>& overrides) {
    O d(number(at_key(defaults, "lr")));
    apply(d, defaults);
    std::vector<OptimizerParamGroup> groups;
    for (size_t i = 0; i < params.size(); ++i) {
      // What a C++ user writes for a group that names only what differs: fresh options with
      // those fields set (and the constructor's lr: SGD's options have no default lr).
      O o(d.lr());
      apply(o, overrides[i]);
      groups.emplace_back(params[i], std::make_unique<O>(o));
    }
    return std::unique_ptr<FusedOptimizer>(std::make_unique<Opt>(groups, d));
  };
  f.set = [](OptimizerOptions& o, const std::string& key, const IValue& v) {
    apply(dynamic_cast<O&>(o), [&] {
      Dict one = new_dict();
      one.insert(key, v);
      return one;
    }());
  };
  return f;
}

Family family_of(const std::string& name) {
  using namespace mixprec::optim;
  if (name == "adam") return family<FusedAdam, FusedAdamOptions>();
  if (name == "sgd") return family<FusedSGD, FusedSGDOptions>();
  if (name == "adagrad") return family<FusedAdagrad, FusedAdagradOptions>();
  if (name == "lamb") return family<FusedLAMB, FusedLAMBOptions>();
  if (name == "novograd") return family<FusedNovoGrad, FusedNovoGradOptions>();
  throw std::runtime_error("conformance driver: unknown family " + name);
}

// ---- running a scenario ------------------------------------------------------------------------
// The Python exception class a C++ exception becomes at the dispatcher, so both fronts compare.
std::string error_class(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::ValueError&) {
    return "ValueError";
  } catch (const c10::TypeError&) {
    return "TypeError";
  } catch (const c10::IndexError&) {
    return "IndexError";
  } catch (const c10::NotImplementedError&) {
    return "NotImplementedError";
  } catch (const c10::Error&) {
    return "RuntimeError";
  } catch (const std::exception&) {
    return "std::exception";
  }
}

// Every param's state tensors by key (sorted, as the Python runner lists them).
std::vector<std::pair<std::string, at::Tensor>> state_of(FusedOptimizer& opt, const at::Tensor& p) {
  const auto it = opt.state().find(p.unsafeGetTensorImpl());
  if (it == opt.state().end()) return {};
  auto out = dynamic_cast<const FusedParamState&>(*it->second).defined_tensors();
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

std::vector<at::Tensor> group_tensors(FusedOptimizer& opt) {
  std::vector<at::Tensor> out;
  auto* novograd = dynamic_cast<mixprec::optim::FusedNovoGrad*>(&opt);
  for (size_t i = 0; i < opt.param_groups().size(); ++i) {
    out.push_back(novograd != nullptr ? novograd->exp_avg_sq(i) : at::Tensor());
  }
  return out;
}

// Everything a step may write, cloned, in the Python runner's order (params, state, group tensors).
std::vector<at::Tensor> snapshot(FusedOptimizer& opt, const Groups& params) {
  std::vector<at::Tensor> out;
  for (const auto& ps : params)
    for (const auto& p : ps) out.push_back(p.detach().clone());
  for (const auto& ps : params)
    for (const auto& p : ps)
      for (const auto& kv : state_of(opt, p)) out.push_back(kv.second.clone());
  const std::vector<at::Tensor> moments = group_tensors(opt);
  for (size_t i = 0; i < opt.param_groups().size(); ++i) {
    // Python sorts a group's tensors by key: "exp_avg_sq" (NovoGrad) before "step".
    if (moments[i].defined()) out.push_back(moments[i].clone());
    const at::Tensor step = opt.step_count_tensor(i);
    if (step.defined()) out.push_back(step.clone());
  }
  return out;
}

bool bitwise_same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].scalar_type() != b[i].scalar_type() || a[i].sizes() != b[i].sizes()) return false;
    if (!at::equal(a[i].reshape({-1}).view(at::kByte), b[i].reshape({-1}).view(at::kByte))) return false;
  }
  return true;
}

void do_step(FusedOptimizer& opt, std::optional<mixprec::amp::GradScaler>& scaler) {
  if (!scaler) {
    opt.step();
    return;
  }
  scaler->scale(at::ones({1}));  // creates the scale on the first call, as a loss would
  scaler->step(opt);
  scaler->update();
}

IValue run(const Dict& sc) {
  Dict result = new_dict();
  result.insert("name", at_key(sc, "name"));
  result.insert("error", IValue());
  result.insert("unchanged", true);
  const Family fam = family_of(at_key(sc, "family").toStringRef());
  const Dict defaults = at_key(sc, "defaults").toGenericDict();
  Groups params;
  std::vector<Dict> overrides;
  // Each IValue a list is read from is held in a local: a range-for over a temporary's list dangles.
  const IValue group_specs = at_key(sc, "groups");
  for (const IValue& g : group_specs.toListRef()) {
    const Dict gd = g.toGenericDict();
    std::vector<at::Tensor> ps;
    const IValue initial = at_key(gd, "params");
    for (const IValue& t : initial.toListRef()) ps.push_back(t.toTensor().clone().requires_grad_(true));
    params.push_back(std::move(ps));
    overrides.push_back(at_key(gd, "options").toGenericDict());
  }
  std::unique_ptr<FusedOptimizer> opt;
  try {
    opt = fam.make(params, defaults, overrides);
  } catch (...) {
    result.insert_or_assign("error", error_class(std::current_exception()));
    return result;
  }
  std::optional<mixprec::amp::GradScaler> scaler;
  if (!at_key(sc, "scaler").isNone()) {
    const Dict s = at_key(sc, "scaler").toGenericDict();
    scaler.emplace(mixprec::amp::GradScalerOptions()
                       .init_scale(number(at_key(s, "init_scale")))
                       .growth_factor(number(at_key(s, "growth_factor")))
                       .backoff_factor(number(at_key(s, "backoff_factor")))
                       .growth_interval(at_key(s, "growth_interval").toInt()));
  }
  const int64_t checkpoint_after = at_key(sc, "checkpoint_after").toInt();
  const IValue bad = at_key(sc, "bad");
  int64_t step = 0;
  const IValue grads = at_key(sc, "grads");
  const IValue switches = at_key(sc, "switches");
  for (const IValue& step_grads : grads.toListRef()) {
    if (step == checkpoint_after) {
      torch::serialize::OutputArchive out;
      opt->save(out);
      std::ostringstream bytes;
      out.save_to(bytes);
      for (auto& ps : params)
        for (auto& p : ps) p = p.detach().clone().requires_grad_(true);
      opt = fam.make(params, defaults, overrides);
      std::istringstream in_bytes(bytes.str());
      torch::serialize::InputArchive in;
      in.load_from(in_bytes);
      opt->load(in);
    }
    // master_weights set between steps, for the whole optimizer (group -1) or one group.
    for (const IValue& w : switches.toListRef()) {
      const Dict sw = w.toGenericDict();
      if (at_key(sw, "step").toInt() != step) continue;
      const int64_t group = at_key(sw, "group").toInt();
      const bool on = at_key(sw, "on").toBool();
      if (group < 0) {
        opt->set_master_weights(on);
      } else {
        fam.set(opt->param_groups()[group].options(), "master_weights", IValue(on));
      }
    }
    const auto& per_group = step_grads.toListRef();
    for (size_t g = 0; g < params.size(); ++g) {
      const auto& gs = per_group[g].toListRef();
      for (size_t j = 0; j < params[g].size(); ++j)
        params[g][j].mutable_grad() = gs[j].isNone() ? at::Tensor() : gs[j].toTensor().clone();
    }
    if (!bad.isNone() && step == at_key(bad.toGenericDict(), "step").toInt()) {
      const Dict b = bad.toGenericDict();
      auto& group = opt->param_groups()[at_key(b, "group").toInt()];
      const bool option = at_key(b, "kind").toStringRef() == "option";
      std::unique_ptr<OptimizerOptions> kept = group.options().clone();
      const std::vector<at::Tensor> before = snapshot(*opt, params);
      const at::Tensor& param = params[at_key(b, "group").toInt()][option ? 0 : at_key(b, "param").toInt()];
      at::Tensor& grad = param.mutable_grad();
      const at::Tensor kept_grad = grad;
      const auto scaler_fields = [&] {
        return scaler ? std::make_tuple(scaler->get_scale(), scaler->growth_tracker(), scaler->skipped_steps())
                      : std::make_tuple(0.0, int64_t{0}, int64_t{0});
      };
      const auto scaler_before = scaler_fields();
      if (option) {
        fam.set(group.options(), at_key(b, "key").toStringRef(), at_key(b, "value"));
      } else if (at_key(b, "kind").toStringRef() == "grad_alias") {
        grad = param.detach();  // the param's own memory
      } else {
        grad = grad.t().contiguous().t();  // the same values, transposed layout
      }
      try {
        do_step(*opt, scaler);
      } catch (...) {
        result.insert_or_assign("error", error_class(std::current_exception()));
      }
      group.set_options(std::move(kept));
      grad = kept_grad;
      result.insert_or_assign("unchanged",
                              bitwise_same(before, snapshot(*opt, params)) && scaler_fields() == scaler_before);
    }
    do_step(*opt, scaler);
    ++step;
  }
  List out_params = new_list(), out_grads = new_list(), out_state = new_list(), steps = new_list(),
       moments = new_list();
  for (const auto& ps : params) {
    for (const auto& p : ps) {
      out_params.push_back(p.detach());
      out_grads.push_back(p.grad().defined() ? IValue(p.grad()) : IValue());
      Dict s = new_dict();
      for (const auto& kv : state_of(*opt, p)) s.insert(kv.first, kv.second);
      out_state.push_back(s);
    }
  }
  const std::vector<at::Tensor> gts = group_tensors(*opt);
  for (size_t i = 0; i < opt->param_groups().size(); ++i) {
    const at::Tensor t = opt->step_count_tensor(i);
    steps.push_back(t.defined() ? IValue(t) : IValue());
    moments.push_back(gts[i].defined() ? IValue(gts[i]) : IValue());
  }
  result.insert("params", out_params);
  result.insert("grads", out_grads);
  result.insert("state", out_state);
  result.insert("steps", steps);
  result.insert("group_tensors", moments);
  result.insert("scale", scaler ? IValue(scaler->get_scale()) : IValue());
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " SCENARIOS_IN.pt RESULTS_OUT.pt\n";
    return 2;
  }
  try {
    std::ifstream in(argv[1], std::ios::binary);
    if (!in) throw std::runtime_error(std::string("cannot read ") + argv[1]);
    const std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    List results = new_list();
    const IValue scenarios = torch::pickle_load(data);
    for (const IValue& sc : scenarios.toListRef()) results.push_back(run(sc.toGenericDict()));
    const std::vector<char> bytes = torch::pickle_save(results);
    std::ofstream out(argv[2], std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) throw std::runtime_error(std::string("cannot write ") + argv[2]);
  } catch (const std::exception& e) {
    std::cerr << "mixprec_conformance: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
