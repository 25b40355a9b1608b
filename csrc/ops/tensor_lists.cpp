// Validation and packing of tensor-list arguments into kernel-tier groups (see tensor_lists.h).
#include "ops/tensor_lists.h"

#include <map>

namespace mixprec::detail {

std::string arg_name(const char* op, const char* arg, int64_t index) {
  std::string s = std::string("mixprec::") + op + ": " + arg;
  if (index >= 0) s += "[" + std::to_string(index) + "]";
  return s;
}

kernels::DType kernel_dtype(const at::Tensor& t, const std::string& what) {
  switch (t.scalar_type()) {
    case at::kFloat: return kernels::DType::kFloat32;
    case at::kHalf: return kernels::DType::kFloat16;
    case at::kBFloat16: return kernels::DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, what, " has dtype ", t.scalar_type(), "; expected float32, float16 or bfloat16");
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
  TORCH_CHECK(t.defined(), what, " is undefined");
  TORCH_CHECK(t.device() == device, what, " is on ", t.device().str(), " but the op runs on ", device.str());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, what, " has dtype ", t.scalar_type(), "; expected ", dtype);
  TORCH_CHECK_VALUE(t.numel() == 1, what, " must hold exactly one element, got ", num(t.numel()));
}

at::Device op_device(const char* op, const NamedList& list, const c10::optional<at::Tensor>& anchor) {
  if (anchor.has_value() && anchor->defined()) return anchor->device();
  TORCH_CHECK(!list.tensors.empty() && list.tensors[0].defined(), arg_name(op, list.name),
              " is empty or undefined, so the op's device is unknown");
  return list.tensors[0].device();
}

PackedLists pack_lists(const char* op, const std::vector<NamedList>& lists, const at::Device& device) {
  TORCH_INTERNAL_ASSERT(!lists.empty() && lists.size() <= static_cast<size_t>(kernels::kMaxLists));
  const int64_t n = static_cast<int64_t>(lists[0].tensors.size());
  for (const NamedList& l : lists)
    TORCH_CHECK_VALUE(static_cast<int64_t>(l.tensors.size()) == n, arg_name(op, l.name), " has ", num(l.tensors.size()),
                      " tensors but ", arg_name(op, lists[0].name), " has ", num(n));

  // Validate everything before packing anything.
  std::vector<std::vector<kernels::DType>> dtypes(lists.size(), std::vector<kernels::DType>(n));
  for (size_t k = 0; k < lists.size(); ++k) {
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor& t = lists[k].tensors[i];
      const std::string what = arg_name(op, lists[k].name, i);
      TORCH_CHECK(t.defined(), what, " is undefined");
      TORCH_CHECK(t.device() == device, what, " is on ", t.device().str(), " but the op runs on ", device.str());
      dtypes[k][i] = kernel_dtype(t, what);
      TORCH_CHECK(t.is_contiguous(), what, " is not contiguous; mixprec's multi-tensor ops need contiguous tensors");
      if (k > 0)
        TORCH_CHECK_VALUE(t.sizes().equals(lists[0].tensors[i].sizes()), what, " has shape ", shape(t.sizes()), " but ",
                          arg_name(op, lists[0].name, i), " has shape ", shape(lists[0].tensors[i].sizes()));
    }
  }

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

}  // namespace mixprec::detail
