# Every source file of libmixprec, by tier, listed by hand rather than globbed: a file is part of
# the build because it is named here (tests/python/test_package.py fails when a csrc/ source is
# missing from this list or named here but gone). Included by CMakeLists.txt.

# The kernel tier, torch-free: CPU kernels.
set(MIXPREC_CPU_KERNEL_SOURCES
  csrc/kernels/cpu/adagrad.cpp
  csrc/kernels/cpu/adam.cpp
  csrc/kernels/cpu/bias_grad.cpp
  csrc/kernels/cpu/cross_entropy.cpp
  csrc/kernels/cpu/fp8.cpp
  csrc/kernels/cpu/lamb.cpp
  csrc/kernels/cpu/layer_norm.cpp
  csrc/kernels/cpu/loss_scale.cpp
  csrc/kernels/cpu/norm.cpp
  csrc/kernels/cpu/novograd.cpp
  csrc/kernels/cpu/optim_common.cpp
  csrc/kernels/cpu/rms_norm.cpp
  csrc/kernels/cpu/sgd.cpp
)

# The kernel tier, torch-free: CUDA kernels (nvcc).
set(MIXPREC_CUDA_KERNEL_SOURCES
  csrc/kernels/cuda/adagrad.cu
  csrc/kernels/cuda/adam.cu
  csrc/kernels/cuda/bias_grad.cu
  csrc/kernels/cuda/cross_entropy.cu
  csrc/kernels/cuda/fp8.cu
  csrc/kernels/cuda/lamb.cu
  csrc/kernels/cuda/layer_norm.cu
  csrc/kernels/cuda/loss_scale.cu
  csrc/kernels/cuda/norm.cu
  csrc/kernels/cuda/novograd.cu
  csrc/kernels/cuda/optim_common.cu
  csrc/kernels/cuda/rms_norm.cu
  csrc/kernels/cuda/sgd.cu
)

# The ops tier (validation, packing, registration for CPU and Meta) and the C++ front.
set(MIXPREC_OP_SOURCES
  csrc/ops/adagrad.cpp
  csrc/ops/adam.cpp
  csrc/ops/bias_grad.cpp
  csrc/ops/cross_entropy.cpp
  csrc/ops/format.cpp
  csrc/ops/held_step.cpp
  csrc/ops/fp8.cpp
  csrc/ops/fp8_linear.cpp
  csrc/ops/front_rules.cpp
  csrc/ops/lamb.cpp
  csrc/ops/layer_norm.cpp
  csrc/ops/layer_norm_autograd.cpp
  csrc/ops/library.cpp
  csrc/ops/linear.cpp
  csrc/ops/linear_grad.cpp
  csrc/ops/loss_scale.cpp
  csrc/ops/norm.cpp
  csrc/ops/novograd.cpp
  csrc/ops/optim_common.cpp
  csrc/ops/rms_norm.cpp
  csrc/ops/rms_norm_autograd.cpp
  csrc/ops/sgd.cpp
  csrc/ops/tensor_lists.cpp
  csrc/ops/cpu/bias_grad.cpp
  csrc/ops/cpu/cross_entropy.cpp
  csrc/ops/cpu/fp8.cpp
  csrc/ops/cpu/layer_norm.cpp
  csrc/ops/cpu/loss_scale.cpp
  csrc/ops/cpu/norm.cpp
  csrc/ops/cpu/optim.cpp
  csrc/ops/cpu/rms_norm.cpp
  csrc/ops/meta/bias_grad.cpp
  csrc/ops/meta/cross_entropy.cpp
  csrc/ops/meta/fp8.cpp
  csrc/ops/meta/layer_norm.cpp
  csrc/ops/meta/loss_scale.cpp
  csrc/ops/meta/norm.cpp
  csrc/ops/meta/rms_norm.cpp
  csrc/api/autocast.cpp
  csrc/api/fp8_linear.cpp
  csrc/api/fp8_state.cpp
  csrc/api/fused_adagrad.cpp
  csrc/api/fused_adam.cpp
  csrc/api/fused_lamb.cpp
  csrc/api/fused_novograd.cpp
  csrc/api/fused_optimizer.cpp
  csrc/api/fused_optimizer_state.cpp
  csrc/api/fused_optimizer_step.cpp
  csrc/api/fused_sgd.cpp
  csrc/api/grad_scaler.cpp
  csrc/api/opt_level.cpp
)

# The ops tier's CUDA registrations (compiled only with a CUDA torch).
set(MIXPREC_CUDA_OP_SOURCES
  csrc/ops/cuda/bias_grad.cpp
  csrc/ops/cuda/cross_entropy.cpp
  csrc/ops/cuda/fp8.cpp
  csrc/ops/cuda/layer_norm.cpp
  csrc/ops/cuda/linear_grad.cpp
  csrc/ops/cuda/loss_scale.cpp
  csrc/ops/cuda/norm.cpp
  csrc/ops/cuda/optim.cpp
  csrc/ops/cuda/rms_norm.cpp
)
