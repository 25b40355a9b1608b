"""Issue 24's capacity figure: the deepest GPT-2-shaped model (width 1600, 25 heads, batch 4,
sequence 1024) that still trains on one GPU, for torch.amp bf16, mixprec O2 bf16 and each lean mode.

    python benchmarks/lean_capacity.py --out out/capacity.json
    python benchmarks/lean_capacity.py --modes torch-bf16,mixprec-o2-bf16-rem-q8
    python benchmarks/lean_capacity.py --device cpu --tiny      # smoke run of the search

Method. Every block adds the same weights, gradients, optimizer state and activations, so a
model's peak memory over a training step is close to affine in its depth: the line through the two
deepest measured peaks (first the --probe depths, a few steps each) predicts the deepest depth that
fits the device's free memory. That depth is trained for real, the line is redrawn through the
newest peaks, and the search goes on (bisecting where a prediction ran out of memory) until it has
seen the deepest depth that trains and the next one that does not: the reported depth is measured,
never extrapolated. A depth "trains" when --steps optimizer steps finish without running out of
device memory.

On the CPU (a smoke run of the code, not a figure) nothing runs out of memory: a depth fits when
the tensors that training keeps (params, grads, optimizer state; activations not counted) fit in
--budget-gib.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from e2e_gpt2 import release  # noqa: E402 - frees one attempt's memory before the next
from e2e_phases import PhaseClock  # noqa: E402
from e2e_variants import VARIANTS, Hyper, train  # noqa: E402
from gpt2_model import Batches, GPTConfig, build_model  # noqa: E402

MODES = ("torch-bf16", "mixprec-o2-bf16", "mixprec-o2-bf16-rem", "mixprec-o2-bf16-rem-bf16m",
         "mixprec-o2-bf16-rem-q8", "mixprec-o3-bf16-sr")
WIDTH, HEADS, BATCH, SEQ = 1600, 25, 4, 1024  # issue 24: GPT-2 XL's width, batch 4, T 1024
TINY = dict(n_embd=64, n_head=4, batch=2, seq=64, vocab=512)
#: The goal of issue 24: a model at least this much larger (in parameters) than torch.amp bf16 fits.
CAPACITY_GOAL = 1.5


@dataclasses.dataclass
class Attempt:
    depth: int
    fits: bool
    peak_bytes: Optional[int]  # CUDA: the step's peak allocation; CPU: the tensors training keeps
    params: int
    seconds: float
    error: str = ""


def kept_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the params, their grads and every optimizer state tensor (each storage once)."""
    seen: dict[int, int] = {}

    def add(t: Optional[torch.Tensor]) -> None:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for state in optimizer.state.values():
        for v in state.values():
            add(v)
    return sum(seen.values())


def is_oom(err: BaseException) -> bool:
    """torch's OutOfMemoryError, or a library's allocation failure reported as a RuntimeError."""
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def try_depth(mode: str, cfg: GPTConfig, device: torch.device, steps: int, budget: Optional[int], seed: int) -> Attempt:
    """Builds the model of cfg's depth, trains `steps` steps in `mode`, and says whether it fit."""
    t0 = time.perf_counter()
    model = trainer = batches = None
    params = 0
    try:
        release(device)
        batches = Batches(cfg, steps, device, seed)
        model = build_model(cfg, device, seed)
        params = sum(p.numel() for p in model.parameters())
        trainer = VARIANTS[mode].make(model, device, Hyper(schedule="constant"))
        clock = PhaseClock(device, steps)
        train(trainer, batches, Hyper(schedule="constant"), clock)
        if device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(device)
        else:
            # Before the last step's zero_grad the grads were alive too: count them as params' size.
            peak = kept_bytes(trainer.model, trainer.optimizer) + sum(
                p.numel() * p.element_size() for p in trainer.model.parameters() if p.grad is None)
        fits = budget is None or peak <= budget
        return Attempt(cfg.n_layer, fits, peak, params, time.perf_counter() - t0,
                       "" if fits else f"{peak / 2**30:.2f} GiB over the budget")
    except Exception as err:  # noqa: BLE001 - running out of memory is the answer sought, not a failure
        if not is_oom(err):
            raise
        return Attempt(cfg.n_layer, False, None, params, time.perf_counter() - t0, str(err).splitlines()[0][:120])
    finally:
        model = trainer = batches = None  # noqa: F841 - drop the references before release()
        release(device)


def search(fits_at: Callable[[int], Attempt], probes: tuple[int, int], budget: int, max_tries: int) -> list[Attempt]:
    """The attempts that find the deepest depth that trains (see the module docstring)."""
    tried: dict[int, Attempt] = {}  # by depth

    def attempt(d: int) -> Attempt:
        if d not in tried:
            tried[d] = fits_at(d)
            a = tried[d]
            peak = f"{a.peak_bytes / 2**30:.2f} GiB" if a.peak_bytes else "-"
            print(f"    depth {d:4d}: {'trains' if a.fits else 'does not fit'} ({a.params / 1e9:.2f} B params, "
                  f"peak {peak}, {a.seconds:.0f} s){' ' + a.error if a.error else ''}", flush=True)
        return tried[d]

    def predict() -> Optional[int]:
        """The deepest depth the two deepest measured peaks' line allows (a secant step)."""
        fits = sorted((a for a in tried.values() if a.fits and a.peak_bytes), key=lambda a: a.depth)[-2:]
        if len(fits) < 2 or fits[1].peak_bytes <= fits[0].peak_bytes:
            return None
        slope = (fits[1].peak_bytes - fits[0].peak_bytes) / (fits[1].depth - fits[0].depth)
        return fits[1].depth + int((budget - fits[1].peak_bytes) // slope)

    for d in probes:
        attempt(d)
    while len(tried) < max_tries + 2:
        good = max((d for d, a in tried.items() if a.fits), default=None)
        bad = min((d for d, a in tried.items() if not a.fits), default=None)
        if good is None or (bad is not None and bad - good <= 1):
            break  # nothing trains, or the deepest that trains and the next that does not are both seen
        guess = predict()
        if guess is not None and guess <= good:
            d = good + 1  # the line says the next block no longer fits: see it fail
        elif bad is None:
            d = guess if guess is not None else 2 * good
        else:
            d = guess if guess is not None and good < guess < bad else (good + bad) // 2
        if d in tried:  # a prediction already refuted: bisect instead
            d = (good + bad) // 2 if bad is not None else 2 * good
        attempt(d)
    return sorted(tried.values(), key=lambda a: a.depth)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list (default: {','.join(MODES)})")
    parser.add_argument("--probe", default="4,12", help="the two probe depths (default 4,12)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per depth tried (default 2)")
    parser.add_argument("--max-tries", type=int, default=8, help="depths tried per mode after the probes (default 8)")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="CUDA: also count a depth whose peak exceeds this as not fitting; CPU: required "
                             "(the budget for the kept tensors)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help=f"width {TINY['n_embd']} model for a smoke run")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in VARIANTS or VARIANTS[m].dtype != "bf16"]
    if bad or not modes:
        parser.error(f"--modes: {bad} are not bf16 variants of e2e_variants.py; choose from {', '.join(MODES)}")
    try:
        probes = tuple(int(x) for x in args.probe.split(","))
    except ValueError:
        probes = ()
    if len(probes) != 2 or not 1 <= probes[0] < probes[1]:
        parser.error(f"--probe: two increasing depths >= 1, e.g. 4,12; got {args.probe!r}")
    if args.steps < 1 or args.max_tries < 1:
        parser.error("--steps and --max-tries must be >= 1")
    device = common.resolve_device(parser, args)
    if device.type == "cpu" and args.budget_gib is None:
        parser.error("--budget-gib is required on the CPU (nothing runs out of memory there)")
    shape = TINY if args.tiny else dict(n_embd=WIDTH, n_head=HEADS, batch=BATCH, seq=SEQ)
    budget_cap = int(args.budget_gib * 2**30) if args.budget_gib else None
    # What the prediction aims at: the device's memory less what the CUDA context and others hold.
    budget = budget_cap or torch.cuda.mem_get_info(device)[0]
    env = common.environment(device)
    print(f"{common.device_label(env)} | torch {torch.__version__} | width {shape['n_embd']}, batch {shape['batch']}, "
          f"seq {shape['seq']} | budget {budget / 2**30:.1f} GiB", flush=True)

    rows = []
    for mode in modes:
        print(f"[{mode}] {VARIANTS[mode].about}", flush=True)

        def fits_at(depth: int, mode: str = mode) -> Attempt:
            return try_depth(mode, GPTConfig(n_layer=depth, **shape), device, args.steps, budget_cap, args.seed)

        attempts = search(fits_at, probes, budget, args.max_tries)
        best = max((a for a in attempts if a.fits), key=lambda a: a.depth, default=None)
        above = min((a.depth for a in attempts if not a.fits and (best is None or a.depth > best.depth)), default=None)
        rows.append({"mode": mode, "depth": best.depth if best else None, "params_B": best.params / 1e9 if best else None,
                     "peak_GiB": best.peak_bytes / 2**30 if best and best.peak_bytes else None,
                     "first_failing_depth": above, "attempts": [dataclasses.asdict(a) for a in attempts]})
    base = next((r for r in rows if r["mode"] == "torch-bf16" and r["params_B"]), None)
    for r in rows:
        if base and r["params_B"]:
            r["vs_torch"] = r["params_B"] / base["params_B"]
        r["bounded"] = r["first_failing_depth"] == (r["depth"] or 0) + 1  # the next depth was seen to fail
    print()
    print(common.format_table(rows, ["mode", "depth", "first_failing_depth", "params_B", "peak_GiB", "vs_torch",
                                     "bounded"]))
    for r in rows:
        if r["mode"] != "torch-bf16" and "vs_torch" in r:
            verdict = "PASS" if r["vs_torch"] >= CAPACITY_GOAL else "FAIL"
            print(f"  {verdict} {r['mode']}: {r['vs_torch']:.2f}x torch-bf16's parameters (goal {CAPACITY_GOAL}x)")
    if args.out:
        common.write_json(args.out, env, rows, config={"shape": shape, "probes": probes, "steps": args.steps,
                                                       "budget_bytes": budget})


if __name__ == "__main__":
    main()
