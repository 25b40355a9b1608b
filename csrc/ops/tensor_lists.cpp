// Validation and packing of tensor-list arguments into kernel-tier groups (see tensor_lists.h).
#include "ops/tensor_lists.h"

#include <algorithm>
#include <cstdint>
#include <map>

namespace mixprec::detail {

std::string arg_name(const char* op, const char* arg, int64_t index) {
  std::string s = std::string("mixprec::") + op + ": " + arg;
  if (index >= 0) s += "[" + std::to_string(index) + "]";
  return s;
}

kernels::DType kernel_dtype(const at::Tensor& t, const std::string& what) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return kernels::DType::kFloat32;
    case at::kHalf:
      return kernels::DType::kFloat16;
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    default:
      MIXPREC_CHECK_TYPE(false, what, " has dtype ", t.scalar_type(), "; expected float32, float16 or bfloat16");
  }
  return kernels::DType::kFloat32;  // unreachable: the check above throws
}

bool has_kernel_dtype(const at::Tensor& t) {
  const auto d = t.scalar_type();
  return d == at::kFloat || d == at::kHalf || d == at::kBFloat16;
}

void check_scalar_tensor(const char* op, const char* arg, const at::Tensor& t, const at::Device& device,
                         at::ScalarType dtype) {
  const std::string what = arg_name(op, arg);
  MIXPREC_CHECK(t.defined(), what, " is undefined");
  MIXPREC_CHECK(t.device() == device, what, " is on ", t.device().str(), " but the op runs on ", device.str());
  MIXPREC_CHECK_TYPE(t.scalar_type() == dtype, what, " has dtype ", t.scalar_type(), "; expected ", dtype);
  MIXPREC_CHECK_VALUE(t.numel() == 1, what, " must hold exactly one element, got ", num(t.numel()));
}

at::Device op_device(const char* op, const NamedList& list, const c10::optional<at::Tensor>& anchor) {
  if (anchor.has_value() && anchor->defined()) return anchor->device();
  MIXPREC_CHECK(!list.tensors.empty() && list.tensors[0].defined(), arg_name(op, list.name),
                " is empty or undefined, so the op's device is unknown");
  return list.tensors[0].device();
}

namespace {

// Whether a and b (same sizes) lay out their elements in the same storage order: equal strides
// in every dimension of size > 1 (a size-1 dimension's stride is never used).
bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  for (int64_t d = 0; d < a.dim(); ++d)
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  return true;
}

}  // namespace

void check_no_overlap(const char* op, const std::vector<NamedList>& lists) {
  struct Extent {
    uintptr_t begin, end;
    size_t list;
    int64_t index;
    bool written;
  };
  std::vector<Extent> extents;
  for (size_t k = 0; k < lists.size(); ++k) {
    const NamedList& l = lists[k];
    if (k > 0 && l.tensors.data() == lists[0].tensors.data()) continue;  // a stand-in
    for (size_t i = 0; i < l.tensors.size(); ++i) {
      const at::Tensor& t = l.tensors[i];
      if (!t.defined() || t.numel() == 0) continue;
      // Dense and non-overlapping (checked first): the elements fill [data_ptr, + nbytes).
      const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
      if (l.may_be_params && i < lists[0].tensors.size() && lists[0].tensors[i].defined() &&
          lists[0].tensors[i].data_ptr() == t.data_ptr() && lists[0].tensors[i].nbytes() == t.nbytes())
        continue;  // params[i] itself, already counted
      extents.push_back({begin, begin + t.nbytes(), k, static_cast<int64_t>(i), l.written});
    }
  }
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
  // Sweeping by start: an extent overlaps an earlier one iff that one ends past its start, so the
  // earlier extent ending last (of all, and of the written) is the one to compare with.
  const Extent* last_any = nullptr;
  const Extent* last_written = nullptr;
  for (const Extent& e : extents) {
    const Extent* other = e.written ? last_any : last_written;
    if (other != nullptr && other->end > e.begin) {
      const Extent& w = other->written ? *other : e;  // name a written one first
      const Extent& r = &w == other ? e : *other;
      MIXPREC_CHECK_VALUE(false, arg_name(op, lists[w.list].name, w.index), " shares memory with ",
                          std::string(lists[r.list].name), "[", num(r.index), "]",
                          "; every tensor the op writes needs memory of its own (no tensor listed twice, no "
                          "overlapping views, no state tensor reused for another, no grad that is its param)");
    }
    if (last_any == nullptr || e.end > last_any->end) last_any = &e;
    if (e.written && (last_written == nullptr || e.end > last_written->end)) last_written = &e;
  }
}

void check_scalars_apart(const char* op, const std::vector<NamedScalar>& scalars, const std::vector<NamedList>& lists) {
  const auto extent = [](const at::Tensor& t) {
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    return std::make_pair(begin, begin + t.nbytes());
  };
  const auto overlap = [](std::pair<uintptr_t, uintptr_t> a, std::pair<uintptr_t, uintptr_t> b) {
    return a.first < b.second && b.first < a.second;
  };
  for (size_t s = 0; s < scalars.size(); ++s) {
    const NamedScalar& a = scalars[s];
    if (a.tensor == nullptr || !a.tensor->defined() || a.tensor->numel() == 0) continue;
    const auto ea = extent(*a.tensor);
    for (size_t r = s + 1; r < scalars.size(); ++r) {
      const NamedScalar& b = scalars[r];
      if (b.tensor == nullptr || !b.tensor->defined() || b.tensor->numel() == 0 || !(a.written || b.written)) continue;
      MIXPREC_CHECK_VALUE(!overlap(ea, extent(*b.tensor)), arg_name(op, a.written ? a.name : b.name),
                          " shares memory with ", std::string(a.written ? b.name : a.name),
                          "; each device scalar the op writes needs memory of its own");
    }
    // One pointer comparison per tensor: cheap beside the lists' own checks.
    for (const NamedList& l : lists) {
      if (!(a.written || l.written)) continue;
      for (size_t i = 0; i < l.tensors.size(); ++i) {
        const at::Tensor& t = l.tensors[i];
        if (!t.defined() || t.numel() == 0) continue;
        MIXPREC_CHECK_VALUE(!overlap(ea, extent(t)), arg_name(op, a.name), " shares memory with ", std::string(l.name),
                            "[", num(i), "]",
                            "; a device scalar needs memory apart from the tensors the op reads and writes");
      }
    }
  }
}

void check_on_meta(const char* op, const char* arg, const at::Tensor& t, int64_t index) {
  MIXPREC_CHECK(!t.defined() || t.device().is_meta(), arg_name(op, arg, index), " is on ", t.device().str(),
                " but other tensors of the call are on the meta device; expected every tensor on one device");
}

void check_on_meta(const char* op, const char* arg, at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) check_on_meta(op, arg, tensors[i], static_cast<int64_t>(i));
}

namespace {

// What pack_lists' checks and packing read of its arguments: every check is a function of each
// tensor's data pointer, dtype, device, sizes and strides (density, contiguity, shapes, layouts,
// overlaps and byte extents all follow from them) and of the lists' lengths and roles, so a call
// whose facts equal those of a call that passed passes too, and packs to the same groups. An
// optimizer step passes the same tensors every time, so the last calls' outcomes are kept (per
// thread) and reused when every fact matches: ~15 ns per tensor instead of the checks, the
// overlap sort and the grouping (~30 us of host time per step for 6 x 292 tensors).
struct PackedCall {
  const char* op = nullptr;
  uint64_t last_used = 0;
  PackRules rules;
  at::Device device{at::kCPU};
  std::vector<int64_t> list_facts;  // per list: length, written, may_be_params, stand-in
  std::vector<const void*> ptrs;    // per tensor, list by list
  std::vector<at::ScalarType> dtypes;
  std::vector<at::Device> devices;
  std::vector<int64_t> shapes;  // per tensor: dim, sizes, strides
  PackedLists packed;
};

PackedLists check_and_pack(const char* op, const std::vector<NamedList>& lists, const at::Device& device,
                           PackRules rules);

constexpr size_t kKeptCalls = 8;  // a few param groups and the scaler's check
// Calls this small are checked about as fast as compared, and often come with new tensors each
// time (a scale's reciprocal): kept, they would only push out the large calls that repeat.
constexpr int64_t kSmallestKept = 8;
thread_local std::vector<PackedCall> kept_calls;
thread_local uint64_t calls_seen = 0;  // the call count; each kept call notes the last it served

bool is_stand_in(const std::vector<NamedList>& lists, size_t k) {
  return k > 0 && lists[k].tensors.data() == lists[0].tensors.data();
}

std::vector<int64_t> list_facts(const std::vector<NamedList>& lists) {
  std::vector<int64_t> facts;
  facts.reserve(4 * lists.size());
  for (size_t k = 0; k < lists.size(); ++k) {
    const NamedList& l = lists[k];
    facts.insert(facts.end(),
                 {static_cast<int64_t>(l.tensors.size()), l.written, l.may_be_params, is_stand_in(lists, k)});
  }
  return facts;
}

bool same_call(const PackedCall& c, const char* op, const std::vector<NamedList>& lists, const at::Device& device,
               PackRules rules, const std::vector<int64_t>& facts) {
  if (c.op != op || c.device != device || c.rules.dense_layouts != rules.dense_layouts ||
      c.rules.refuse_overlap != rules.refuse_overlap || c.list_facts != facts)
    return false;
  size_t j = 0, s = 0;
  for (const NamedList& l : lists) {
    for (const at::Tensor& t : l.tensors) {
      // The device first: data_ptr() is safe on the (real) devices of a call that passed.
      if (!t.defined() || t.device() != c.devices[j] || t.scalar_type() != c.dtypes[j] || t.data_ptr() != c.ptrs[j])
        return false;
      const auto sizes = t.sizes();
      const auto strides = t.strides();
      const auto dim = static_cast<int64_t>(sizes.size());
      if (c.shapes[s] != dim || !std::equal(sizes.begin(), sizes.end(), c.shapes.begin() + s + 1) ||
          !std::equal(strides.begin(), strides.end(), c.shapes.begin() + s + 1 + dim))
        return false;
      s += 1 + 2 * static_cast<size_t>(dim);
      ++j;
    }
  }
  return true;
}

void keep_call(const char* op, const std::vector<NamedList>& lists, const at::Device& device, PackRules rules,
               std::vector<int64_t> facts, const PackedLists& packed) {
  PackedCall c;
  c.op = op;
  c.rules = rules;
  c.device = device;
  c.list_facts = std::move(facts);
  for (const NamedList& l : lists) {
    for (const at::Tensor& t : l.tensors) {
      c.ptrs.push_back(t.data_ptr());
      c.dtypes.push_back(t.scalar_type());
      c.devices.push_back(t.device());
      c.shapes.push_back(t.dim());
      c.shapes.insert(c.shapes.end(), t.sizes().begin(), t.sizes().end());
      c.shapes.insert(c.shapes.end(), t.strides().begin(), t.strides().end());
    }
  }
  c.packed = packed;
  c.last_used = calls_seen;
  if (kept_calls.size() < kKeptCalls) {
    kept_calls.push_back(std::move(c));
  } else {  // the least recently used goes
    *std::min_element(kept_calls.begin(), kept_calls.end(), [](const PackedCall& a, const PackedCall& b) {
      return a.last_used < b.last_used;
    }) = std::move(c);
  }
}

}  // namespace

PackedLists pack_lists(const char* op, const std::vector<NamedList>& lists, const at::Device& device, PackRules rules) {
  MIXPREC_INTERNAL_ASSERT(!lists.empty() && lists.size() <= static_cast<size_t>(kernels::kMaxLists));
  size_t total = 0;
  for (const NamedList& l : lists) total += l.tensors.size();
  if (static_cast<int64_t>(total) < kSmallestKept) return check_and_pack(op, lists, device, rules);
  ++calls_seen;
  std::vector<int64_t> facts = list_facts(lists);
  for (PackedCall& c : kept_calls) {
    if (same_call(c, op, lists, device, rules, facts)) {
      c.last_used = calls_seen;
      return c.packed;
    }
  }
  PackedLists packed = check_and_pack(op, lists, device, rules);
  keep_call(op, lists, device, rules, std::move(facts), packed);
  return packed;
}

namespace {

PackedLists check_and_pack(const char* op, const std::vector<NamedList>& lists, const at::Device& device,
                           PackRules rules) {
  const int64_t n = static_cast<int64_t>(lists[0].tensors.size());
  for (const NamedList& l : lists)
    MIXPREC_CHECK_VALUE(static_cast<int64_t>(l.tensors.size()) == n, arg_name(op, l.name), " has ",
                        num(l.tensors.size()), " tensors but ", lists[0].name, " has ", num(n));

  // Validate everything before packing anything.
  std::vector<std::vector<kernels::DType>> dtypes(lists.size(), std::vector<kernels::DType>(n));
  for (size_t k = 0; k < lists.size(); ++k) {
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor& t = lists[k].tensors[i];
      // Names are built only when a check fails (the checks evaluate their messages lazily): this
      // loop runs for every tensor of every list on every step, and building 6 x 292 names cost
      // ~240 us of host time per optimizer step on GPT-2-medium's parameter set.
      const auto what = [&] { return arg_name(op, lists[k].name, i); };
      MIXPREC_CHECK(t.defined(), what(), " is undefined");
      MIXPREC_CHECK(t.device() == device, what(), " is on ", t.device().str(), " but the op runs on ", device.str());
      MIXPREC_CHECK_TYPE(has_kernel_dtype(t), what(), " has dtype ", t.scalar_type(),
                         "; expected float32, float16 or bfloat16");
      dtypes[k][i] = kernel_dtype(t, std::string());  // cannot fail: checked just above
      if (!rules.dense_layouts) {
        MIXPREC_CHECK(t.is_contiguous(), what(),
                      " is not contiguous; mixprec's multi-tensor ops need contiguous tensors");
      }
      MIXPREC_CHECK(t.is_non_overlapping_and_dense(), what(), " has strides ", shape(t.strides()), " for shape ",
                    shape(t.sizes()),
                    ", which skip or repeat memory; mixprec's multi-tensor ops need dense tensors "
                    "(contiguous, channels_last or any permutation of dimensions): pass .contiguous()");
      if (k == 0) continue;
      const at::Tensor& ref = lists[0].tensors[i];
      const auto ref_name = [&] { return arg_name(op, lists[0].name, i); };
      MIXPREC_CHECK_VALUE(t.sizes().equals(ref.sizes()), what(), " has shape ", shape(t.sizes()), " but ", ref_name(),
                          " has shape ", shape(ref.sizes()));
      MIXPREC_CHECK_VALUE(same_layout(t, ref), what(), " has strides ", shape(t.strides()), " but ", ref_name(),
                          " has strides ", shape(ref.strides()), "; every tensor of one entry needs the layout of ",
                          std::string(lists[0].name),
                          "[i] (e.g. p.grad = torch.empty_like(p).copy_(p.grad), or make the state "
                          "with torch.zeros_like(p))");
    }
  }
  if (rules.refuse_overlap) check_no_overlap(op, lists);

  PackedLists packed;
  packed.num_tensors = n;
  packed.all.num_lists = 0;
  std::map<std::vector<kernels::DType>, size_t> group_of;
  void* ptrs[kernels::kMaxLists];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t numel = lists[0].tensors[i].numel();
    if (numel == 0) continue;
    std::vector<kernels::DType> key(lists.size());
    for (size_t k = 0; k < lists.size(); ++k) {
      key[k] = dtypes[k][i];
      ptrs[k] = lists[k].tensors[i].data_ptr();
    }
    auto [it, inserted] = group_of.emplace(key, packed.groups.size());
    if (inserted) {
      kernels::TensorGroup g;
      g.num_lists = static_cast<int>(lists.size());
      for (size_t k = 0; k < lists.size(); ++k) g.dtypes[k] = key[k];
      packed.groups.push_back(std::move(g));
    }
    packed.groups[it->second].add(static_cast<int32_t>(i), numel, ptrs, packed.total_chunks);
    packed.all.add(static_cast<int32_t>(i), numel, ptrs, packed.total_chunks);
    packed.total_chunks += kernels::num_chunks(numel);
  }
  return packed;
}

}  // namespace

}  // namespace mixprec::detail
