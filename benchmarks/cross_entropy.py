"""Benchmark of the fused cross-entropy: mixprec.cross_entropy on fp16/bf16 logits beside torch's
F.cross_entropy(logits.float(), target) (what torch.autocast runs), forward + backward and forward
alone, in the same run as a device copy. Each case is checked against float64 before it is timed.

    python benchmarks/cross_entropy.py                    # CUDA if available, else CPU
    python benchmarks/cross_entropy.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SCALE = 8.0  # logits ~ N(0, 8^2): a spread like a language model's early training
CHECK_ROWS = 256  # rows compared against float64 (the whole batch in float64 would need 26 GB)

# (rows, vocab): GPT-2 small's 16x1024 tokens and a quarter of that, at the padded vocabulary.
CUDA_SIZES = [(16384, 50304), (4096, 50304)]
CPU_SIZES = [(512, 50304)]
CPU_QUICK_SIZES = [(64, 50304), (256, 4096)]


def counted_bytes(rows: int, vocab: int, dtype: torch.dtype, backward: bool) -> int:
    """What the pass must move, for either contender: the logits read once forward; backward reads
    them again and writes the gradient (the [N] vectors are noise beside [N, V] and left out)."""
    logits = rows * vocab * (torch.finfo(dtype).bits // 8)
    return 3 * logits if backward else logits


def verify(logits: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """Relative errors against float64 on the first CHECK_ROWS rows; raises if mixprec is off the
    DESIGN.md bounds (loss < 1e-5; gradient within 2x torch's error in the logits' dtype)."""
    import mixprec

    x = logits[:CHECK_ROWS]
    t = target[:CHECK_ROWS]
    ref_x = x.detach().double().requires_grad_(True)
    ref = F.cross_entropy(ref_x, t)
    ref.backward()
    m_x = x.detach().clone().requires_grad_(True)
    m = mixprec.cross_entropy(m_x, t)
    m.backward()
    t_x = x.detach().float().requires_grad_(True)
    p = F.cross_entropy(t_x, t)
    p.backward()

    def rel(a, b):
        a, b = a.detach().double(), b.detach().double()
        return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))

    errs = {"loss": rel(m, ref), "torch_loss": rel(p, ref), "grad": rel(m_x.grad, ref_x.grad),
            "torch_grad": rel(t_x.grad.to(x.dtype), ref_x.grad)}
    bound = max(2 * errs["torch_grad"], 1e-5)
    if not (errs["loss"] < 1e-5 and errs["grad"] <= bound):  # NaN fails both
        raise RuntimeError(f"mixprec off the bounds: {errs} (gradient bound {bound:.3g})")
    return errs


def contenders(logits: torch.Tensor, target: torch.Tensor, backward: bool) -> dict:
    import mixprec

    x = logits.detach().requires_grad_(backward)

    def run_m():
        loss = mixprec.cross_entropy(x, target)
        if backward:
            x.grad = None  # the new gradient is taken, not added: no extra pass over [N, V]
            loss.backward()

    def run_t():
        loss = F.cross_entropy(x.float(), target)
        if backward:
            x.grad = None
            loss.backward()

    if not backward:
        return {"mixprec": torch.no_grad()(run_m), "torch": torch.no_grad()(run_t)}
    return {"mixprec": run_m, "torch": run_t}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: fresh each run)")
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=["float16", "bfloat16"])
    args = parser.parse_args(argv)
    device = common.resolve_device(parser, args)
    runs, warmup = common.resolve_runs(args)
    try:
        import mixprec  # noqa: F401
    except ImportError as e:
        parser.error(f"cannot import mixprec ({e}); build it first: ./scripts/setup.sh")
    if device.type == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key(
            "mixprec::cross_entropy_forward", "CUDA"):
        parser.error("mixprec was built without CUDA kernels (no nvcc or a CPU torch at build time)")
    sizes = CUDA_SIZES if device.type == "cuda" else (CPU_QUICK_SIZES if args.quick else CPU_SIZES)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device=device).manual_seed(seed)

    env = common.environment(device)
    env.update(seed=seed, runs=runs, warmup=warmup, sizes=sizes)
    unit, per = common.bandwidth_units(device)
    copy = common.measure_copy_bandwidth(device, runs=runs, warmup=warmup)
    print(f"# cross_entropy on {common.device_label(env)}, torch {env['torch']}, mixprec {env['mixprec']}")
    print(f"# median of {runs} runs (min-max shown), {warmup} warm-up; seed {seed}")
    print(f"# device copy: {copy.bytes_per_s / per:.3f} {unit}")
    if common.busy_warning(env):
        print(common.busy_warning(env))

    rows, failures = [], []
    for rows_n, vocab in sizes:
        for dname in args.dtypes:
            dtype = getattr(torch, dname)
            logits = (torch.randn(rows_n, vocab, generator=gen, device=device) * SCALE).to(dtype)
            target = torch.randint(0, vocab, (rows_n,), generator=gen, device=device)
            case = f"[{rows_n}, {vocab}] {dname}"
            try:
                errs = verify(logits, target)
            except Exception as e:  # a wrong result is never timed
                failures.append(f"{case}: {e}")
                print(f"!! {case}: verification FAILED, not timed: {e}", file=sys.stderr)
                continue
            for backward in (True, False):
                nbytes = counted_bytes(rows_n, vocab, dtype, backward)
                timings = common.time_many(contenders(logits, target, backward), device, runs=runs, warmup=warmup,
                                           clock=time.perf_counter)
                for impl, t in timings.items():
                    bw, pct = common.achieved(nbytes, t.median, copy)
                    row = {"case": case, "pass": "fwd+bwd" if backward else "fwd",
                           "impl": "mixprec" if impl == "mixprec" else "torch F.cross_entropy(x.float())",
                           "ms": t.median * 1e3, "ms_min": t.min * 1e3, "ms_max": t.max * 1e3, "bytes": nbytes,
                           "bw": bw / per, "pct_copy": pct,
                           "rel_err_loss": errs["loss" if impl == "mixprec" else "torch_loss"],
                           "rel_err_grad": errs["grad" if impl == "mixprec" else "torch_grad"]}
                    if impl == "mixprec":
                        row["speedup"] = timings["torch"].median / t.median
                    rows.append(row)
            del logits, target
            if device.type == "cuda":
                torch.cuda.empty_cache()

    show = [{**r, "ms": f"{r['ms']:.3f}", "range": f"{r['ms_min']:.3f}-{r['ms_max']:.3f}",
             "MB": f"{r['bytes'] / 1e6:.0f}", "bw": f"{r['bw']:.3f}", "pct": f"{r['pct_copy']:.1f}%",
             "x": f"{r['speedup']:.2f}x" if "speedup" in r else None,
             "err": f"{r['rel_err_grad']:.1e}"} for r in rows]
    print(common.format_table(show, ["case", "pass", "impl", "ms", "range", "MB", "bw", "pct", "x", "err"],
                              ["case", "pass", "impl", "median ms", "min-max ms", "MB counted", unit, "% copy",
                               "speedup", "grad rel err"]))
    print("# MB counted: the logits read once per pass plus the gradient written once (fwd+bwd: 3x the\n"
          "# logits), the same figure for both; torch moves ~5x more through its fp32 copy. speedup: torch's\n"
          "# median / mixprec's. grad rel err: against float64 on the first rows, in the logits' dtype.")
    for f in failures:
        print(f"VERIFICATION FAILED: {f}")
    if args.out:
        common.write_json(args.out, env, rows, copy_bytes_per_s=copy.bytes_per_s, failures=failures)
        print(f"# wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
