"""Benchmark of the fused optimizer step (issue 3) on the GPT-2-medium parameter set: mixprec's ops
beside torch's fused, foreach and GradScaler paths in the same run, with bytes counted per
parameter, achieved TB/s and share of a device copy measured in the same run.

    python benchmarks/optimizer_step.py                  # CUDA if available, else CPU (smaller set)
    python benchmarks/optimizer_step.py --device cpu --quick
    python benchmarks/optimizer_step.py --class-path     # the optimizer classes and GradScaler only
    python benchmarks/optimizer_step.py --class-path --meta  # their host time alone (any machine)
    python benchmarks/optimizer_step.py --class-path --checked-too  # and each row without held steps

Bytes per parameter count each operand read once and each result written once (DESIGN.md):
AdamW fp32 = grad 4 + param r/w 8 + moments r/w 16 = 28; the loss-scaled step adds the
non-finite check's read of the grads (4) and the step's write of the unscaled grads (4: torch's
fused-optimizer contract, kernels/optim_common.h) = 36; the O2 step = fp16 grad 2 + fp32 master
r/w 8 + moments 16 + fp16 model copy written 2 = 28 (32 loss-scaled: check 2, grad write 2).
Every mixprec variant is checked against torch once before it is timed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import optimizer_class_path as class_path  # noqa: E402

import mixprec  # noqa: E402

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.01
# Bytes per param of the loss-scaled steps: the plain step, the non-finite check's read of the
# grads, and the kernel's write of the unscaled grads (grad_scale given).
FP32_BYTES, O2_BYTES = 28, 28
SCALED_FP32_BYTES = FP32_BYTES + 4 + 4
SCALED_O2_BYTES = O2_BYTES + 2 + 2


def make_tensors(shapes, dtype, device, gen, scale=1.0):
    return [(torch.randn(s, device=device, generator=gen) * scale).to(dtype) for s in shapes]


class Case:
    """One timed variant: a zero-argument step function and the bytes it must move."""

    def __init__(self, name: str, fn: Callable[[], None], bytes_per_param: int, group: str, peer: bool = False):
        self.name, self.fn, self.bytes_per_param, self.group, self.peer = name, fn, bytes_per_param, group, peer


def check_close(name: str, got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    num = sum(float((g.double() - w.double()).norm() ** 2) for g, w in zip(got, want)) ** 0.5
    den = sum(float(w.double().norm() ** 2) for w in want) ** 0.5
    err = num / max(den, 1e-30)
    if not err < tol:
        raise SystemExit(f"{name}: relative error {err:.3e} vs torch exceeds {tol:.0e}; not timing a wrong kernel")
    print(f"  checked {name}: rel err vs torch {err:.2e}")


def adam_cases(shapes, device, gen) -> list[Case]:
    """fp32 AdamW: mixprec alone and loss-scaled, torch fused alone and under GradScaler, foreach."""
    cases: list[Case] = []
    # --- correctness first: one step of each path on identical inputs
    p0 = make_tensors(shapes[:6], torch.float32, device, gen)
    g0 = make_tensors(shapes[:6], torch.float32, device, gen, 1e-2)
    ref = [p.clone().requires_grad_() for p in p0]
    for r, g in zip(ref, g0):
        r.grad = g.clone()
    torch.optim.AdamW(ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True).step()
    mine = [p.clone() for p in p0]
    m = [torch.zeros_like(p) for p in p0]
    v = [torch.zeros_like(p) for p in p0]
    mixprec.adam_(mine, g0, m, v, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD, step=1)
    check_close("mixprec adam_ fp32", mine, [r.detach() for r in ref], 1e-5)

    # --- the timed state: one set per contender, so none sees another's cache
    params = make_tensors(shapes, torch.float32, device, gen)
    grads = make_tensors(shapes, torch.float32, device, gen, 1e-2)
    exp_avg = [torch.zeros_like(p) for p in params]
    exp_avg_sq = [torch.zeros_like(p) for p in params]
    step_tensor = torch.zeros(1, device=device)
    # The scaled step writes grads / scale back into the grads (as torch's does), so repeated steps
    # over the same grads would shrink them to zero; a scale of 1 keeps the data and the work fixed.
    scale = torch.full((1,), 1.0, device=device)
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    found_inf = torch.zeros(1, device=device)

    def mixprec_adam():
        mixprec.adam_(params, grads, exp_avg, exp_avg_sq, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                      weight_decay=WD, step_tensor=step_tensor)

    def mixprec_scaled_step():
        # What mixprec.GradScaler.step + update do: a read-only check, the fused step unscaling and
        # skipping on the device, the on-device scale update. No host synchronization.
        found_inf.zero_()
        mixprec.non_finite_check_and_unscale_(grads, found_inf)
        mixprec.adam_(params, grads, exp_avg, exp_avg_sq, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                      weight_decay=WD, step_tensor=step_tensor, grad_scale=scale, found_inf=found_inf)
        mixprec.update_scale_(scale, growth, found_inf, 2.0, 0.5, 2000)

    cases.append(Case("mixprec adam_ fp32", mixprec_adam, FP32_BYTES, "adamw fp32"))
    cases.append(Case("mixprec check + adam_ + update_scale_ fp32", mixprec_scaled_step, SCALED_FP32_BYTES,
                      "adamw fp32 loss-scaled"))

    tparams = [p.clone().requires_grad_() for p in params]
    for t, g in zip(tparams, grads):
        t.grad = g.clone()
    fused = torch.optim.AdamW(tparams, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    cases.append(Case("torch AdamW fused=True", fused.step, FP32_BYTES, "adamw fp32", peer=True))

    sparams = [p.clone().requires_grad_() for p in params]
    for t, g in zip(sparams, grads):
        t.grad = g.clone()
    scaled_opt = torch.optim.AdamW(sparams, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    # torch's fused step divides the grads by the scale in place, so repeated steps over the same
    # grads would shrink them towards zero; a scale of 1 keeps the data (and so the work) fixed.
    scaler = torch.amp.GradScaler(device.type, init_scale=1.0)
    scaler.scale(torch.ones((), device=device))  # creates the scale, as scaling the loss would

    def torch_scaled_step():
        scaler.step(scaled_opt)
        scaler.update()

    # torch's scaler also rewrites the grads in its check (val * 1.0): 4 more bytes than it must
    # move, counted at the 36 it must move like mixprec's, so the shares compare the same work.
    cases.append(Case("torch GradScaler.step+update, AdamW fused", torch_scaled_step, SCALED_FP32_BYTES,
                      "adamw fp32 loss-scaled", peer=True))

    fparams = [p.clone().requires_grad_() for p in params]
    for t, g in zip(fparams, grads):
        t.grad = g.clone()
    foreach = torch.optim.AdamW(fparams, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True)
    cases.append(Case("torch AdamW foreach=True", foreach.step, FP32_BYTES, "adamw fp32", peer=True))
    return cases


def o2_cases(shapes, device, gen) -> list[Case]:
    """Apex O2's step: fp16 model params and grads, fp32 master weights and moments."""
    master = make_tensors(shapes, torch.float32, device, gen)
    model = [m.half() for m in master]
    grads = make_tensors(shapes, torch.float16, device, gen, 1e-2)
    exp_avg = [torch.zeros_like(p) for p in master]
    exp_avg_sq = [torch.zeros_like(p) for p in master]
    step_tensor = torch.zeros(1, device=device)
    scale = torch.full((1,), 1.0, device=device)  # 1: the written-back grads stay what they were
    growth = torch.zeros(1, dtype=torch.int32, device=device)
    found_inf = torch.zeros(1, device=device)

    # Correctness: the masters after one step equal torch's fused AdamW on fp32 masters fed the
    # upcast grads, and the model copy is their rounding.
    ref = [m.clone().requires_grad_() for m in master[:6]]
    for r, g in zip(ref, grads[:6]):
        r.grad = g.float()
    torch.optim.AdamW(ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True).step()
    chk_master, chk_model = [m.clone() for m in master[:6]], [p.clone() for p in model[:6]]
    chk_m, chk_v = [torch.zeros_like(m) for m in chk_master], [torch.zeros_like(m) for m in chk_master]
    mixprec.adam_(chk_model, grads[:6], chk_m, chk_v, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                  weight_decay=WD, master_params=chk_master, step=1)
    check_close("mixprec adam_ O2 (master)", chk_master, [r.detach() for r in ref], 1e-5)
    if not all(torch.equal(p, m.half()) for p, m in zip(chk_model, chk_master)):
        raise SystemExit("mixprec adam_ O2: the fp16 model copy is not the rounding of the master")

    def mixprec_o2():
        mixprec.adam_(model, grads, exp_avg, exp_avg_sq, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                      weight_decay=WD, master_params=master, step_tensor=step_tensor)

    def mixprec_o2_scaled():
        found_inf.zero_()
        mixprec.non_finite_check_and_unscale_(grads, found_inf)
        mixprec.adam_(model, grads, exp_avg, exp_avg_sq, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                      weight_decay=WD, master_params=master, step_tensor=step_tensor, grad_scale=scale,
                      found_inf=found_inf)
        mixprec.update_scale_(scale, growth, found_inf, 2.0, 0.5, 2000)

    # The same step with what torch offers: fp16 grads copied into fp32 master grads, a fused
    # AdamW on the masters, the masters copied back into the fp16 model.
    t_master = [m.clone().requires_grad_() for m in master]
    t_model = [m.detach().half() for m in t_master]
    for t in t_master:
        t.grad = torch.empty_like(t)
    t_opt = torch.optim.AdamW(t_master, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    t_mgrads = [t.grad for t in t_master]

    def torch_o2():
        torch._foreach_copy_(t_mgrads, grads)
        t_opt.step()
        torch._foreach_copy_(t_model, [t.detach() for t in t_master])

    return [
        Case("mixprec adam_ O2 (fp16 model, fp32 master)", mixprec_o2, O2_BYTES, "adamw O2"),
        Case("mixprec check + adam_ + update_scale_ O2", mixprec_o2_scaled, SCALED_O2_BYTES, "adamw O2"),
        Case("torch: grad copy + AdamW fused on masters + model copy", torch_o2, O2_BYTES, "adamw O2", peer=True),
    ]


def sgd_cases(shapes, device, gen) -> list[Case]:
    """SGD with momentum, fp32: grad 4 + param r/w 8 + momentum r/w 8 = 20 bytes."""
    params = make_tensors(shapes, torch.float32, device, gen)
    grads = make_tensors(shapes, torch.float32, device, gen, 1e-2)
    bufs = [torch.zeros_like(p) for p in params]
    step_tensor = torch.zeros(1, device=device)
    tparams = [p.clone().requires_grad_() for p in params]
    for t, g in zip(tparams, grads):
        t.grad = g.clone()
    t_opt = torch.optim.SGD(tparams, lr=LR, momentum=0.9, weight_decay=WD, fused=True)
    # correctness: two steps (the first sets the buffers) on a slice
    p_chk, b_chk = [p.clone() for p in params[:6]], [torch.zeros_like(p) for p in params[:6]]
    ref = [p.clone().requires_grad_() for p in params[:6]]
    for r, g in zip(ref, grads[:6]):
        r.grad = g.clone()
    ref_opt = torch.optim.SGD(ref, lr=LR, momentum=0.9, weight_decay=WD)
    for s in (1, 2):
        ref_opt.step()
        mixprec.sgd_(p_chk, grads[:6], b_chk, lr=LR, momentum=0.9, weight_decay=WD, step=s)
    check_close("mixprec sgd_ fp32", p_chk, [r.detach() for r in ref], 1e-5)

    def mixprec_sgd():
        mixprec.sgd_(params, grads, bufs, lr=LR, momentum=0.9, weight_decay=WD, step_tensor=step_tensor)

    return [Case("mixprec sgd_ momentum fp32", mixprec_sgd, 20, "sgd fp32"),
            Case("torch SGD fused=True", t_opt.step, 20, "sgd fp32", peer=True)]


def lamb_cases(shapes, device, gen) -> list[Case]:
    """LAMB fp32 with Apex's default clipping (max_grad_norm=1): 44 bytes per param, the minimum of
    the two-pass algorithm (kernels/lamb.h): global gradient norm reads g (4), the moments pass
    reads g, w, m, v and writes m, v (24), the apply pass reads m, v, w and writes w (16)."""
    params = make_tensors(shapes, torch.float32, device, gen)
    grads = make_tensors(shapes, torch.float32, device, gen, 1e-2)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    step_tensor = torch.zeros(1, device=device)

    def mixprec_lamb():
        mixprec.lamb_(params, grads, m, v, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=1e-6, weight_decay=WD,
                      step_tensor=step_tensor)

    return [Case("mixprec lamb_ fp32 (clipped)", mixprec_lamb, 44, "lamb fp32")]


def optional(builder, *args) -> list[Case]:
    """Builds a group and calls each of its steps once; a family whose op has no kernel for this
    device is reported and skipped instead of stopping the run."""
    try:
        cases = builder(*args)
        for c in cases:
            c.fn()
        return cases
    except NotImplementedError as err:
        print(f"  skipped {builder.__name__}: {str(err).split('. ')[0]}")
        return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser)
    parser.add_argument("--only", nargs="*", default=None, help="groups to run (adamw, o2, sgd, lamb)")
    parser.add_argument("--class-path", action="store_true",
                        help="only the class-path rows: opt.step() and scaler.step+update of the five fused "
                             "optimizers (fp32, O2 fp16, O2 bf16), each one step after a sync, 20 queued and host "
                             "time, beside torch's GradScaler + fused AdamW (see optimizer_class_path.py)")
    parser.add_argument("--families", nargs="*", default=None, help="with --class-path: these classes only "
                        f"({', '.join(class_path.FAMILIES)})")
    parser.add_argument("--meta", action="store_true", help="with --class-path: params on the meta device "
                        "(host time alone, the full shape set, on any machine; default shapes gpt2-medium)")
    parser.add_argument("--checked-too", action="store_true", help="with --class-path: each row also with every "
                        "step fully checked (no held steps, the scaler's own check): before and after in one run")
    parser.add_argument("--shrink", type=int, default=1, help="with --class-path: divide every dimension by this "
                        "(the same tensor count with a tiny payload: per-tensor host cost on a CPU)")
    args = parser.parse_args()
    device = torch.device("meta") if args.meta else common.resolve_device(parser, args)
    runs, warmup = common.resolve_runs(args)
    default_shapes = "gpt2-medium" if device.type in ("cuda", "meta") else ("tiny" if args.quick else "gpt2-mini")
    shapes_name = args.shapes or default_shapes
    shapes = common.SHAPE_SETS[shapes_name]()
    if args.class_path:
        return main_class_path(args, device, shapes_name, shapes, runs, warmup)
    n = common.numel_of(shapes)
    env = common.environment(device)
    print(f"{common.device_label(env)} | torch {torch.__version__} | {shapes_name}: {len(shapes)} tensors, "
          f"{n / 1e6:.1f} M params")
    copy = common.measure_copy_bandwidth(device, runs=runs, warmup=warmup)
    unit, div = common.bandwidth_units(device)
    print(f"device copy: {copy.bytes_per_s / div:.2f} {unit}")

    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    builders = {"adamw": adam_cases, "o2": o2_cases, "sgd": sgd_cases, "lamb": lamb_cases}
    rows = []
    for group, builder in builders.items():
        if args.only and group not in args.only:
            continue
        cases = optional(builder, shapes, device, gen)
        if not cases:
            continue
        timings = common.time_many({c.name: c.fn for c in cases}, device, runs=runs, warmup=warmup)
        peers = [c for c in cases if c.peer]
        for c in cases:
            t = timings[c.name]
            nbytes = c.bytes_per_param * n
            bw, share = common.achieved(nbytes, t.median, copy)
            row = {"group": c.group, "variant": c.name, "ms": t.median * 1e3, "min_ms": t.min * 1e3,
                   "bytes/param": c.bytes_per_param, unit: bw / div, "% copy": share}
            same = [p for p in peers if p.group == c.group and p is not c]
            if not c.peer and same:
                row["vs peer"] = f"{timings[same[0].name].median / t.median:.2f}x vs {same[0].name}"
            rows.append(row)
        del cases
        if device.type == "cuda":
            torch.cuda.empty_cache()
    cols = ["group", "variant", "ms", "bytes/param", unit, "% copy", "vs peer"]
    print(common.format_table(rows, cols))
    if args.out:
        common.write_json(args.out, env, rows, shapes=shapes_name, copy_bytes_per_s=copy.bytes_per_s)


def main_class_path(args, device, shapes_name, shapes, runs, warmup) -> None:
    shapes = class_path.shrink(shapes, args.shrink)
    n = common.numel_of(shapes)
    env = common.environment(device if device.type != "meta" else torch.device("cpu"))
    env["device"] = device.type
    print(f"{common.device_label(env) if device.type != 'meta' else 'meta device (host time only)'} | torch "
          f"{torch.__version__} | {shapes_name}{f' / {args.shrink}' if args.shrink > 1 else ''}: {len(shapes)} "
          f"tensors, {n / 1e6:.2f} M params")
    copy, unit, div = None, *common.bandwidth_units(device if device.type != "meta" else torch.device("cpu"))
    if device.type != "meta":
        copy = common.measure_copy_bandwidth(device, runs=runs, warmup=warmup)
        print(f"device copy: {copy.bytes_per_s / div:.2f} {unit}")
    gen = torch.Generator(device=device) if device.type != "meta" else None
    if gen is not None:
        gen.manual_seed(0)
    rows = class_path.run_class_path(shapes, device, gen, runs, warmup, copy, unit, div, n, args.families,
                                     args.checked_too)
    print(common.format_table(rows, [c for c in class_path.CLASS_PATH_COLUMNS if device.type != "meta" or "%" not in c]))
    if args.out:
        common.write_json(args.out, env, rows, shapes=shapes_name, shrink=args.shrink,
                          copy_bytes_per_s=copy.bytes_per_s if copy else None)


if __name__ == "__main__":
    main()
