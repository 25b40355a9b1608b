// What LayerNorm and RMSNorm share between their backend registrations (one kernel shape: rows
// forward; row splits, then column ranges, backward): the CPU runners over ATen's thread pool.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>

#include "kernels/multi_tensor.h"

namespace mixprec::detail {

// The CPU runners of a row norm from its three CPU kernels (forward rows; backward row splits;
// the parameter gradients' finish over column ranges). Rows go in blocks of 16; the backward's
// splits are fixed blocks (cpu_row_splits), so parameter gradients never depend on thread count.
template <class ForwardParams, class BackwardParams, void (*kForward)(const ForwardParams&, int64_t, int64_t),
          void (*kBackward)(const BackwardParams&, int64_t, int64_t),
          void (*kFinish)(const BackwardParams&, int64_t, int64_t)>
struct CpuRowNormRunners {
  static void forward(const ForwardParams& p) {
    at::parallel_for(0, p.rows, 16, [&](int64_t b, int64_t e) { kForward(p, b, e); });
  }

  static int64_t splits(kernels::DType /*dtype*/, int64_t rows, int64_t /*cols*/) {
    return kernels::cpu_row_splits(rows);
  }

  static void backward(const BackwardParams& p) {
    if (p.partials == nullptr) {  // the input gradient alone: rows in any blocks
      BackwardParams rows = p;
      rows.splits = p.rows;
      at::parallel_for(0, p.rows, 16, [&](int64_t b, int64_t e) { kBackward(rows, b, e); });
      return;
    }
    at::parallel_for(0, p.splits, 1, [&](int64_t b, int64_t e) { kBackward(p, b, e); });
    at::parallel_for(0, p.cols, 4096, [&](int64_t b, int64_t e) { kFinish(p, b, e); });
  }
};

}  // namespace mixprec::detail
