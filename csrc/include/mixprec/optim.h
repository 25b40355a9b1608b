// mixprec's fused optimizers for LibTorch: torch::optim::Optimizer subclasses whose step is one
// mixprec op per param group (the same ops as the Python front), with fp32 master weights,
// device step counts, in-kernel loss scaling and validated save/load.
#pragma once

#include <mixprec/optim/fused_adagrad.h>
#include <mixprec/optim/fused_adam.h>
#include <mixprec/optim/fused_lamb.h>
#include <mixprec/optim/fused_novograd.h>
#include <mixprec/optim/fused_optimizer.h>
#include <mixprec/optim/fused_sgd.h>
