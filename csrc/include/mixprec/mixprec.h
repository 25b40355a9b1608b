// Everything mixprec offers LibTorch users, in one include: the ops (mixprec/ops.h), the fused
// optimizers (mixprec/optim.h) and mixed precision (mixprec/amp.h: GradScaler, AutocastGuard,
// opt levels). Link mixprec::mixprec (find_package(mixprec)).
#pragma once

#include <mixprec/amp.h>
#include <mixprec/ops.h>
#include <mixprec/optim.h>
