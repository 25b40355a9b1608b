"""Where torch's own layer kernels stand against the copy bandwidth on GPT-2's shapes: the bias
gradient of each Linear (a column sum of the output gradient) and LayerNorm forward and backward,
with other formulations of the bias gradient beside torch's (mixprec.linear_bias_grad among
them), the weight and bias gradients together (mixprec.linear_weight_bias_grad's one GEMM
against torch's mm plus a sum), and mixprec.layer_norm and mixprec.rms_norm beside torch's. On CUDA every sample is device time: a spin kernel lets the host
queue the sample's launches first. Issue 7's profile of O2 on GPT-2
large (benchmarks/RESULTS.md) put those kernels at 2.4 ms (bias gradients, 145 calls) and 2.9 ms
(LayerNorm) a step; this says how far each is from what it must move, before anything is built.

    python benchmarks/layer_kernels.py                    # CUDA if available, else CPU
    python benchmarks/layer_kernels.py --device cpu --quick
    python benchmarks/layer_kernels.py --sizes large --kernels   # + each LayerNorm kernel's device time

Every candidate is checked against a float64 sum before it is timed; "rel err" is its error
against that sum, beside the error of torch's own sum(0).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from gpt2_model import SIZES  # noqa: E402

#: A candidate bias gradient may be at most this many times torch's error (and 1e-2 relative).
ERROR_FACTOR = 4.0
TWO_STAGE_SPLIT = 64


def bias_widths(size: str) -> list[tuple[str, int, int]]:
    """(layer, output width, calls per step) of the model's biased Linears."""
    cfg = SIZES[size]
    c = cfg.n_embd
    n = cfg.n_layer
    return [("attn.c_attn", 3 * c, n), ("attn.c_proj", c, n), ("mlp.c_fc", 4 * c, n), ("mlp.c_proj", c, n)]


def candidates(rows: int) -> dict:
    """Ways to compute grad.sum(0) for a [rows, N] gradient, keyed by name."""
    def gemv(g):
        ones = torch.ones(1, rows, dtype=g.dtype, device=g.device)
        return torch.mm(ones, g).view(-1)

    def two_stage(g):
        return g.view(TWO_STAGE_SPLIT, rows // TWO_STAGE_SPLIT, g.shape[1]).sum(1).sum(0)

    import mixprec

    out = {"torch sum(0)": lambda g: g.sum(0), "mixprec.linear_bias_grad": mixprec.linear_bias_grad,
           "ones @ grad (cuBLAS)": gemv}
    if rows % TWO_STAGE_SPLIT == 0:
        out[f"view({TWO_STAGE_SPLIT}, -1, N).sum(1).sum(0)"] = two_stage
    return out


def check_errors(errs: dict[str, float], peer: str, what: str) -> None:
    """Refuses (before any timing) a candidate whose float64 error exceeds ERROR_FACTOR times the
    peer's own, or 1e-2."""
    bound = min(max(ERROR_FACTOR * errs[peer], 1e-6), 1e-2)
    for name, e in errs.items():
        if not e <= bound:
            raise SystemExit(f"layer_kernels: {name} on {what}: error {e:.3g} against float64 exceeds {bound:.3g} "
                             f"({peer}: {errs[peer]:.3g})")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(got.double() - ref) / torch.linalg.vector_norm(ref))


def param_grad_candidates() -> dict:
    """Ways to compute a Linear's (weight, bias) gradients from (grad [rows, out], input [rows, in])."""
    import mixprec

    return {"torch mm + sum(0)": lambda g, x: (g.t().mm(x), g.sum(0)),
            "torch mm + linear_bias_grad": lambda g, x: (g.t().mm(x), mixprec.linear_bias_grad(g)),
            "mixprec.linear_weight_bias_grad": mixprec.linear_weight_bias_grad}


def bench_param_grads(size: str, rows: int, dtype: torch.dtype, device, runs, warmup) -> list[dict]:
    """The weight GEMM and the bias sum of each biased Linear, apart and in one cuBLASLt GEMM."""
    cfg = SIZES[size]
    out = []
    for layer, width, calls in bias_widths(size):
        fan_in = 4 * cfg.n_embd if layer == "mlp.c_proj" else cfg.n_embd
        pairs = [(torch.randn(rows, width, dtype=dtype, device=device),
                  torch.randn(rows, fan_in, dtype=dtype, device=device)) for _ in range(2)]
        g64, x64 = (t.double() for t in pairs[0])
        ref_w, ref_b = g64.t() @ x64, g64.sum(0)
        fns = param_grad_candidates()
        errs = {}
        for name, fn in fns.items():
            w, b = fn(*pairs[0])
            errs[name] = max(rel_err(w, ref_w), rel_err(b, ref_b))
        check_errors(errs, "torch mm + sum(0)", f"{layer} {dtype}")
        timings = common.time_many(fns, device, runs=runs, warmup=warmup, host_ahead=device.type == "cuda",
                                   arg_sets={name: pairs for name in fns})
        for name, t in timings.items():
            out.append({"size": size, "dtype": str(dtype).replace("torch.", ""), "kernel": f"weight+bias grad {layer}",
                        "shape": f"{rows}x{width}x{fan_in}", "candidate": name, "us": t.median * 1e6,
                        "pct_copy": None, "rel_err": errs[name], "calls": calls,
                        "ms_per_step": t.median * calls * 1e3})
    return out


def bench_bias_grads(size: str, rows: int, dtype: torch.dtype, device, copy, runs, warmup) -> list[dict]:
    out = []
    for layer, width, calls in bias_widths(size):
        grads = [torch.randn(rows, width, dtype=dtype, device=device) for _ in range(2)]  # rotated: no L2 reuse
        ref = grads[0].double().sum(0)
        fns = candidates(rows)
        errs = {name: rel_err(fn(grads[0]), ref) for name, fn in fns.items()}
        check_errors(errs, "torch sum(0)", f"[{rows}, {width}] {dtype}")
        timings = common.time_many(fns, device, runs=runs, warmup=warmup, host_ahead=device.type == "cuda",
                                   arg_sets={name: [(g,) for g in grads] for name in fns})
        nbytes = rows * width * grads[0].element_size()
        for name, t in timings.items():
            bw, pct = common.achieved(nbytes, t.median, copy)
            out.append({"size": size, "dtype": str(dtype).replace("torch.", ""), "kernel": f"bias grad {layer}",
                        "shape": f"{rows}x{width}", "candidate": name, "us": t.median * 1e6, "pct_copy": pct,
                        "rel_err": errs[name], "calls": calls, "ms_per_step": t.median * calls * 1e3})
    return out


#: The row norms measured, each as (torch's function, mixprec's, whether it has a bias): GPT-2
#: uses LayerNorm, Llama-style decoders RMSNorm (no mean, no bias).
ROW_NORMS = {"layer_norm": (F.layer_norm, "layer_norm", True), "rms_norm": (F.rms_norm, "rms_norm", False)}


def bench_row_norm(norm: str, size: str, rows: int, dtype: torch.dtype, device, copy, runs, warmup) -> list[dict]:
    """torch's and mixprec's ``norm`` (a key of ROW_NORMS), forward and forward+backward, on
    GPT-2's widths: device time, share of the copy bandwidth and the input gradient's error."""
    import mixprec

    torch_fn, mixprec_name, has_bias = ROW_NORMS[norm]
    cfg = SIZES[size]
    width, calls = cfg.n_embd, 2 * cfg.n_layer + 1
    xs = [torch.randn(rows, width, dtype=dtype, device=device) for _ in range(2)]
    dys = [torch.randn_like(x) for x in xs]
    weight = torch.ones(width, dtype=dtype, device=device, requires_grad=True)
    params = [weight]
    if has_bias:
        params.append(torch.zeros(width, dtype=dtype, device=device, requires_grad=True))

    def call(impl, x, ps):
        return impl(x, (width,), *ps)

    def forward(impl):
        return lambda x, dy: call(impl, x, params)

    def forward_backward(impl):
        def run(x, dy):
            x = x.detach().requires_grad_(True)
            torch.autograd.grad(call(impl, x, params), (x, *params), dy)
        return run

    e = xs[0].element_size()
    moved = {"forward": 2 * rows * width * e, "forward+backward": 5 * rows * width * e}  # bwd: x, dy in; dx out
    impls = {"torch": torch_fn, f"mixprec.{mixprec_name}": getattr(mixprec, mixprec_name)}
    fns = {(kind, name): (forward if kind == "forward" else forward_backward)(impl)
           for kind in moved for name, impl in impls.items()}
    # Checked against float64 first: the input gradient's error, beside torch's.
    x64 = xs[0].double().requires_grad_(True)
    p64 = [p.detach().double().requires_grad_(True) for p in params]
    ref = torch.autograd.grad(call(torch_fn, x64, p64), x64, dys[0].double())[0]
    errs = {}
    for name, impl in impls.items():
        x = xs[0].detach().requires_grad_(True)
        errs[name] = rel_err(torch.autograd.grad(call(impl, x, params), x, dys[0])[0], ref)
    check_errors(errs, "torch", f"{norm} [{rows}, {width}] {dtype} (the input gradient)")
    timings = common.time_many({f"{k}|{n}": fn for (k, n), fn in fns.items()}, device, runs=runs, warmup=warmup,
                               host_ahead=device.type == "cuda",
                               arg_sets={f"{k}|{n}": list(zip(xs, dys)) for (k, n) in fns})
    out = []
    for key, t in timings.items():
        kind, name = key.split("|")
        _, pct = common.achieved(moved[kind], t.median, copy)
        out.append({"size": size, "dtype": str(dtype).replace("torch.", ""), "kernel": f"{norm} {kind}",
                    "shape": f"{rows}x{width}", "candidate": name, "us": t.median * 1e6, "pct_copy": pct,
                    "rel_err": errs[name] if kind != "forward" else None, "calls": calls,
                    "ms_per_step": t.median * calls * 1e3})
    return out


def layer_norm_kernel_times(size: str, rows: int, dtype: torch.dtype, device, repeats: int = 50) -> str:
    """Each kernel of mixprec.layer_norm's forward plus backward, in average device us per call,
    from torch's profiler: which part of a fwd+bwd figure above the forward, the backward's row
    pass and its column sum take."""
    import mixprec

    width = SIZES[size].n_embd
    x = torch.randn(rows, width, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    weight = torch.ones(width, dtype=dtype, device=device, requires_grad=True)
    bias = torch.zeros(width, dtype=dtype, device=device, requires_grad=True)

    def step():
        torch.autograd.grad(mixprec.layer_norm(x, (width,), weight, bias), (x, weight, bias), dy)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    activity = torch.profiler.ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    lines = [f"{size} {str(dtype).replace('torch.', '')} [{rows}, {width}]: mixprec.layer_norm kernels, us per call"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total):
        lines.append(f"  {e.self_device_time_total / repeats:8.2f}  {e.key[:110]}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--sizes", default=None, help="comma list of small, large (default: both on CUDA; "
                                                      "the CPU runs a quarter of small's rows)")
    parser.add_argument("--kernels", action="store_true",
                        help="CUDA: also profile each kernel of mixprec.layer_norm's forward plus backward")
    args = parser.parse_args(argv)
    device = common.resolve_device(parser, args)
    runs, warmup = common.resolve_runs(args)
    sizes = [s.strip() for s in (args.sizes or "small,large").split(",") if s.strip()]
    bad = [s for s in sizes if s not in ("small", "large")]
    if bad:
        parser.error(f"--sizes: unknown size(s) {bad}; choose from small, large")
    env = common.environment(device)
    copy = common.measure_copy_bandwidth(device)
    unit, scale = common.bandwidth_units(device)
    print(f"{common.device_label(env)} | torch {torch.__version__} | copy {copy.bytes_per_s / scale:.2f} {unit}")

    rows_of = {s: SIZES[s].batch * SIZES[s].seq for s in sizes}
    if device.type == "cpu":  # the CPU only checks that the script works: fewer rows
        rows_of = {s: (256 if args.quick else 1024) for s in sizes}
    results = []
    for size in sizes:
        for dtype in (torch.float16, torch.bfloat16):
            results += bench_bias_grads(size, rows_of[size], dtype, device, copy, runs, warmup)
            results += bench_param_grads(size, rows_of[size], dtype, device, runs, warmup)
            for norm in ROW_NORMS:
                results += bench_row_norm(norm, size, rows_of[size], dtype, device, copy, runs, warmup)
    rows = [dict(r, rel_err=f"{r['rel_err']:.2e}" if r["rel_err"] is not None else "-",
                 pct_copy=r["pct_copy"] if r["pct_copy"] is not None else "-") for r in results]
    print(common.format_table(rows, ["size", "dtype", "kernel", "shape", "candidate", "us", "pct_copy", "rel_err",
                                     "calls", "ms_per_step"],
                              ["size", "dtype", "kernel", "shape", "candidate", "us", "% copy", "rel err",
                               "calls/step", "ms/step"]))
    if args.kernels and device.type == "cuda":
        for size in sizes:
            print(layer_norm_kernel_times(size, rows_of[size], torch.float16, device))
    if args.out:
        common.write_json(args.out, env, results, copy_bytes_per_s=copy.bytes_per_s)


if __name__ == "__main__":
    main()
