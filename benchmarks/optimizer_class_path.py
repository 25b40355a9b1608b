"""The class path of optimizer_step.py (issue 22): ``opt.step()`` and ``scaler.step(opt);
scaler.update()`` of the five fused optimizers, timed three ways, beside torch's GradScaler + fused
AdamW; and ``--meta``, the host's share alone, with the parameters on the meta device.

Three timings per row, because a step's host work hides behind queued device work but not behind
a synchronized one: "1 step" is one call after a synchronize, from an event before it to one after
it (the device idles while the host prepares the first launch); "20 queued" is 20 calls between
two events, per call; "host" is the wall time of the Python call alone, after a synchronize, with
the device work left running. On the CPU all three are wall time of synchronous work; on the meta
device there is no device work, so "host" is all there is (and mixprec's ops run their generic
Meta kernel, which checks list lengths only: the C++ per-tensor checks of the real backends are not
in that figure).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch

import mixprec
from mixprec.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

LR = 1e-4
QUEUED = 20

# Bytes each step must move per parameter (each operand read once, each result written once), by
# family, as a function of the gradient's bytes g and the model copy's m (0 when the param is its own
# fp32 master, 2 for an fp16/bf16 model beside an fp32 master; the master is read and written: 8).
# NovoGrad and LAMB read the grads once more for their norms before the update can use them; LAMB's
# second pass reads m, v and the master and writes the master (kernels/lamb.h).
BYTES = {
    "FusedAdam": lambda g, m: g + 8 + 16 + m,
    "FusedSGD": lambda g, m: g + 8 + 8 + m,        # momentum buffer read and written
    "FusedAdagrad": lambda g, m: g + 8 + 8 + m,    # the sum of squares read and written
    "FusedNovoGrad": lambda g, m: 2 * g + 8 + 8 + m,
    "FusedLAMB": lambda g, m: 2 * g + 8 + 16 + 8 + 8 + m,
}
FAMILIES = {
    "FusedAdam": lambda ps, mw: FusedAdam(ps, lr=LR, weight_decay=0.01, master_weights=mw),
    "FusedSGD": lambda ps, mw: FusedSGD(ps, lr=LR, momentum=0.9, weight_decay=0.01, master_weights=mw),
    "FusedLAMB": lambda ps, mw: FusedLAMB(ps, lr=LR, master_weights=mw),
    "FusedAdagrad": lambda ps, mw: FusedAdagrad(ps, lr=LR, master_weights=mw),
    "FusedNovoGrad": lambda ps, mw: FusedNovoGrad(ps, lr=LR, master_weights=mw),
}
# fp32: params are their own masters; O2: fp16/bf16 model params with fp32 masters in the optimizer.
PRECISIONS = {"fp32": torch.float32, "O2 fp16": torch.float16, "O2 bf16": torch.bfloat16}


def shrink(shapes: list, by: int) -> list:
    """Every dimension divided by ``by`` (at least 1): the same tensor count and ranks, a tiny
    payload, for CPU measurements of per-tensor host cost."""
    return [tuple(max(1, d // by) for d in s) for s in shapes] if by > 1 else shapes


def _params(shapes, dtype, device, gen):
    if device.type == "meta":
        ps = [torch.nn.Parameter(torch.empty(s, device=device, dtype=dtype)) for s in shapes]
        for p in ps:
            p.grad = torch.empty_like(p)
        return ps
    ps = [torch.nn.Parameter((torch.randn(s, device=device, generator=gen) * 0.1).to(dtype)) for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, device=device, generator=gen) * 1e-3).to(dtype)
    return ps


def _scaler(kind: str, device: torch.device):
    # A scale of 1: the fused steps write the unscaled grads back, so repeated steps keep the data.
    cls = mixprec.GradScaler if kind == "mixprec" else torch.amp.GradScaler
    scaler = cls(device.type, init_scale=1.0)
    scaler.scale(torch.ones((), device=device))  # creates the scale, as scaling the loss would
    return scaler


def time_three(fn: Callable[[], None], device: torch.device, runs: int, warmup: int) -> dict[str, float]:
    """Median seconds of one call after a sync, of a call among QUEUED queued ones, and of the host
    part of one call after a sync (see the module docstring)."""
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    one, queued, host = [], [], []
    for _ in range(runs):
        sync()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            sync()
            one.append(a.elapsed_time(b) / 1e3)
            a.record()
            for _ in range(QUEUED):
                fn()
            b.record()
            sync()
            queued.append(a.elapsed_time(b) / 1e3 / QUEUED)
        else:
            t0 = time.perf_counter()
            fn()
            one.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(QUEUED):
                fn()
            queued.append((time.perf_counter() - t0) / QUEUED)
        sync()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    sync()
    return {k: statistics.median(v) for k, v in (("one", one), ("queued", queued), ("host", host))}


def _fully_checked(opt, scaler=None) -> None:
    """Makes every step of `opt` take the fully checked path (no held steps, optimizers/_held.py,
    none made either), and `scaler` make its own inf check before it: the path of the first step
    and of every step before held steps existed (the op's kept packing, csrc/ops/tensor_lists.cpp,
    still serves it)."""
    real_step = opt.step

    def step(*args, **kwargs):
        opt.__dict__.pop("_held", None)
        opt.__dict__["_held_backoff"] = (0, 1 << 30)  # build() declines: it waits that many steps
        return real_step(*args, **kwargs)
    opt.step = step
    if scaler is not None:
        scaler._check_in_step = lambda *args: False


def class_path_cases(shapes, device, gen, families: Optional[list] = None, checked: bool = False):
    """(family, precision, path, bytes/param, step function, keep-alive) for every row; built lazily
    (one set of params at a time), so a GPU holds one contender's memory at once. `checked`: each
    row also fully checked (" [checked]"), every step as the first, for before/after in one run."""
    for family, make in FAMILIES.items():
        if families and family not in families:
            continue
        for prec, dtype in PRECISIONS.items():
            g, m = (4, 0) if dtype == torch.float32 else (2, 2)
            paths = ("opt.step()", "mixprec scaler.step+update")
            for path in paths + tuple(p + " [checked]" for p in paths if checked):
                params = _params(shapes, dtype, device, gen)
                opt = make(params, dtype != torch.float32)
                scaler = None
                if path.startswith("opt.step()"):
                    fn = opt.step
                    nbytes = BYTES[family](g, m)
                else:
                    scaler = _scaler("mixprec", device)

                    def fn(scaler=scaler, opt=opt):
                        scaler.step(opt)
                        scaler.update()
                    nbytes = BYTES[family](g, m) + 2 * g  # the check's read, the unscaled grads' write
                if path.endswith("[checked]"):
                    _fully_checked(opt, scaler)
                    if scaler is None:
                        fn = opt.step
                yield family, prec, path, nbytes, fn
                del params, opt, fn
    # The peers: torch's fused AdamW alone and under torch's GradScaler (fp32; torch has no O2 step).
    if families and "FusedAdam" not in families:
        return
    for path in ("torch AdamW(fused).step()", "torch scaler.step+update, AdamW(fused)"):
        params = _params(shapes, torch.float32, device, gen)
        try:
            opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=True)
            if path.startswith("torch scaler"):
                scaler = _scaler("torch", device)

                def fn(scaler=scaler, opt=opt):
                    scaler.step(opt)
                    scaler.update()
                nbytes = BYTES["FusedAdam"](4, 0) + 8
            else:
                fn, nbytes = opt.step, BYTES["FusedAdam"](4, 0)
            fn()
        except (RuntimeError, NotImplementedError) as err:  # e.g. no fused AdamW on this device
            print(f"  skipped {path}: {str(err).splitlines()[0][:100]}")
            continue
        yield "torch AdamW", "fp32", path, nbytes, fn
        del params, opt, fn


def run_class_path(shapes, device, gen, runs: int, warmup: int, copy, unit: str, div: float, n: int,
                   families: Optional[list] = None, checked: bool = False) -> list[dict]:
    rows = []
    for family, prec, path, nbytes, fn in class_path_cases(shapes, device, gen, families, checked):
        t = time_three(fn, device, runs, warmup)
        row = {"group": f"{family} {prec}", "variant": path, "1 step ms": t["one"] * 1e3,
               "queued ms": t["queued"] * 1e3, "host ms": t["host"] * 1e3, "bytes/param": nbytes}
        if device.type != "meta" and copy is not None:
            for key, label in (("one", "% copy 1 step"), ("queued", "% copy queued")):
                row[label] = 100.0 * nbytes * n / t[key] / copy.bytes_per_s
        rows.append(row)
        print(f"  {row['group']:24s} {path:40s} 1 step {row['1 step ms']:.3f}  queued {row['queued ms']:.3f}  "
              f"host {row['host ms']:.3f} ms", flush=True)
        del fn
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


CLASS_PATH_COLUMNS = ["group", "variant", "1 step ms", "queued ms", "host ms", "bytes/param", "% copy 1 step",
                      "% copy queued"]


def host_minimum(fn: Callable[[], None], calls: int, warmup: int = 20) -> float:
    """The least wall time of `fn` over `calls` calls (seconds): on a shared CPU, where medians
    wander by 2x, the figure that repeats."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    """Host time per call of every class-path row, held and fully checked ("[checked]"), as the
    minimum over many calls: ``--device meta`` (Python and the dispatcher) or ``--device cpu``
    (every tensor 16 elements: the C++ checks and packing included, the kernels next to nothing)."""
    import argparse

    import common

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("meta", "cpu"), default="meta")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--families", nargs="*", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    shapes = common.SHAPE_SETS["gpt2-medium"]()
    if device.type == "cpu":
        shapes = [(16,) if len(s) == 1 else (4, 4) for s in shapes]
    gen = torch.Generator().manual_seed(0) if device.type == "cpu" else None
    print(f"{device.type} | torch {torch.__version__} | {len(shapes)} tensors | minimum of {args.calls} calls")
    for family, prec, path, _, fn in class_path_cases(shapes, device, gen, args.families, checked=True):
        if family.startswith("torch"):
            continue
        print(f"  {family} {prec:8s} {path:38s} {host_minimum(fn, args.calls) * 1e6:8.0f} us", flush=True)


if __name__ == "__main__":
    main()
