// CUDA registration of linear_weight_bias_grad: in fp16/bf16 one cuBLASLt GEMM computes the weight
// gradient grad.t() @ input and, in its BGRADB epilogue, the bias gradient (the column sums of
// grad, which the GEMM reads anyway). This saves the bias gradient's separate pass over grad: on
// GPT-2 large that pass is 145 kernels and 2.4 ms of a 54 ms O2 step (benchmarks/RESULTS.md).
// float32 (whose GEMM precision follows torch's TF32 settings) and any shape cuBLASLt has no
// algorithm for take the composite: torch's mm and linear_bias_grad. No host synchronization:
// CUDA-graph capturable.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <type_traits>

#include "ops/linear_grad.h"
#include "ops/tensor_lists.h"

namespace mixprec::detail {
namespace {

constexpr const char* kOp = "linear_weight_bias_grad";
// What torch gives cuBLASLt on Hopper; split-K algorithms need some of it.
constexpr int64_t kWorkspaceBytes = 32 << 20;

void check_lt(cublasStatus_t status, const char* call) {
  MIXPREC_CHECK(status == CUBLAS_STATUS_SUCCESS, "mixprec::", kOp, ": ", call, " failed with cuBLAS status ",
                num(static_cast<int64_t>(status)));
}

// Owners of cuBLASLt's descriptors, destroyed on every exit path.
template <typename T, cublasStatus_t (*Destroy)(T)> struct LtDeleter {
  void operator()(std::remove_pointer_t<T>* d) const { Destroy(d); }
};
using MatmulDesc = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>,
                                   LtDeleter<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>>;
using Layout = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>,
                               LtDeleter<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>>;
using Preference = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>,
                                   LtDeleter<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>>;

Layout make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  check_lt(cublasLtMatrixLayoutCreate(&layout, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld),
           "cublasLtMatrixLayoutCreate");
  return Layout(layout);
}

template <typename V> void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const V& value) {
  check_lt(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)), "cublasLtMatmulDescSetAttribute");
}

template <typename V>
void set_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const V& value) {
  check_lt(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)),
           "cublasLtMatmulPreferenceSetAttribute");
}

// The largest power of two (up to 256, cuBLASLt's default assumption) dividing the address: an
// algorithm chosen for a stricter alignment than the buffer has would read it wrongly.
uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

// fp16/bf16 with rows of whole 16-byte vectors at 16-byte aligned addresses. On an H200 cuBLASLt
// returned an algorithm for a [1025, 3] x [1025, 1] problem whose epilogue left the bias gradient
// unwritten; the shapes a model's Linears have are aligned, and the composite serves the rest.
bool lt_takes(const at::Tensor& grad, const at::Tensor& input) {
  const auto d = grad.scalar_type();
  const int64_t limit = INT32_MAX;  // cuBLASLt's sizes and leading dimensions
  auto aligned = [](const at::Tensor& t) {
    return t.size(1) > 0 && t.size(1) % 8 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  return (d == at::kHalf || d == at::kBFloat16) && grad.size(0) > 0 && grad.size(0) <= limit && grad.size(1) <= limit &&
         input.size(1) <= limit && aligned(grad) && aligned(input);
}

std::tuple<at::Tensor, at::Tensor> linear_weight_bias_grad_cuda(const at::Tensor& grad, const at::Tensor& input) {
  check_linear_weight_bias_grad(grad, input);
  if (!lt_takes(grad, input)) return linear_weight_bias_grad_composite(grad, input);
  const c10::cuda::CUDAGuard guard(grad.device());
  const int64_t rows = grad.size(0), out_features = grad.size(1), in_features = input.size(1);
  const cudaDataType_t type = grad.scalar_type() == at::kHalf ? CUDA_R_16F : CUDA_R_16BF;
  at::Tensor grad_weight = at::empty({out_features, in_features}, grad.options());
  at::Tensor grad_bias = at::empty({out_features}, grad.options());

  // Column-major, as cuBLAS sees row-major memory: grad_weight^T [in, out] = input^T [in, rows] @
  // grad [rows, out]. A = input's memory as [in, rows] (no transpose); B = grad's memory, stored
  // [out, rows], transposed; the BGRADB epilogue sums op(B) = grad over the GEMM's k = rows.
  cublasLtMatmulDesc_t raw_desc = nullptr;
  check_lt(cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const MatmulDesc desc(raw_desc);
  set_desc(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_N);
  set_desc(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_T);
  set_desc(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BGRADB);
  set_desc(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, grad_bias.data_ptr());
  const Layout a = make_layout(type, in_features, rows, in_features);
  const Layout b = make_layout(type, out_features, rows, out_features);
  const Layout c = make_layout(type, in_features, out_features, in_features);

  cublasLtMatmulPreference_t raw_pref = nullptr;
  check_lt(cublasLtMatmulPreferenceCreate(&raw_pref), "cublasLtMatmulPreferenceCreate");
  const Preference pref(raw_pref);
  set_pref(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(kWorkspaceBytes));
  set_pref(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment_of(input.data_ptr()));
  set_pref(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment_of(grad.data_ptr()));
  set_pref(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment_of(grad_weight.data_ptr()));
  set_pref(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment_of(grad_weight.data_ptr()));
  // Split-K partials summed in fp32 or in place, never rounded to fp16/bf16 between the splits:
  // the weight gradient keeps an fp32 accumulation's accuracy.
  set_pref(pref.get(), CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
           static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_INPLACE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));

  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  check_lt(cublasLtMatmulAlgoGetHeuristic(handle, desc.get(), a.get(), b.get(), c.get(), c.get(), pref.get(), 1,
                                          &heuristic, &found),
           "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0) return linear_weight_bias_grad_composite(grad, input);

  at::Tensor workspace = at::empty({kWorkspaceBytes}, grad.options().dtype(at::kByte));
  const float one = 1.f, zero = 0.f;
  check_lt(cublasLtMatmul(handle, desc.get(), &one, input.data_ptr(), a.get(), grad.data_ptr(), b.get(), &zero,
                          grad_weight.data_ptr(), c.get(), grad_weight.data_ptr(), c.get(), &heuristic.algo,
                          workspace.data_ptr(), static_cast<size_t>(kWorkspaceBytes),
                          at::cuda::getCurrentCUDAStream().stream()),
           "cublasLtMatmul");
  return {std::move(grad_weight), std::move(grad_bias)};
}

}  // namespace

TORCH_LIBRARY_IMPL(mixprec, CUDA, m) { m.impl("linear_weight_bias_grad", &linear_weight_bias_grad_cuda); }

}  // namespace mixprec::detail
