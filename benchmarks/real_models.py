"""Real models through mixprec beside torch.amp (issue 22): Hugging Face GPT-2 and a Llama-style
decoder, timm ResNet-50 (channels_last) and ViT-B/16, random-initialized, trained in one process.

    python benchmarks/real_models.py --markdown out/real_models.md --json out/real_models.json   # H200
    python benchmarks/real_models.py --models gpt2,vit --levels O2-fp16 --steps 30
    python benchmarks/real_models.py --models llama --levels O2 --profile                      # where time goes
    python benchmarks/real_models.py --tiny --device cpu --threads 1 --steps 4                 # smoke run

Per model and variant: mixprec amp O1/O2 (FusedAdam in AdamW mode; amp's dynamic loss scaling for
fp16) and its torch.amp peer of the same dtype (autocast, AdamW(fused=True), GradScaler for fp16),
each from the same initial weights on the same synthetic batches (learnable: a token successor
table, class patterns in noise). Reported: tokens or images per second over the steps after the
warm-up (synchronized before and after), peak memory (max_memory_allocated, reset before the model
is built), the training loss of the last step and a held-out loss after all steps, and ratios to
the peer. transformers and timm are optional (`pip install 'mixprec[bench]'`); a missing one is
named and its models are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import sys
import time
import traceback
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from e2e_phases import profile_steps  # noqa: E402
from real_models_zoo import INSTALL_HINT, MODELS, Batches, build, import_libraries, loss_of  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LEVELS = ("O1", "O2")
#: Issue 22's bars (H200): O2's speed ratio to torch.amp per (model, dtype); O1 at least 0.98x; the
#: loss after the run within 1% of the peer's; O2's peak memory at most the peer's.
O2_SPEED_BARS = {("gpt2", "fp16"): 1.15, ("llama", "bf16"): 1.15, ("resnet50", "fp16"): 1.05,
                 ("resnet50", "bf16"): 1.05, ("vit", "fp16"): 1.05, ("vit", "bf16"): 1.05}
O1_SPEED_BAR, LOSS_BAR_PCT = 0.98, 1.0


class Trainer:
    """One variant: a model, its optimizer, and how a step runs (torch.amp or mixprec.amp)."""

    def __init__(self, spec, model, variant: str, dtype: torch.dtype, device: torch.device, args):
        self.spec, self.device, self.dtype = spec, device, dtype
        self.scaler = None
        self.amp = None
        hyper = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
        if variant == "torch":
            self.optimizer = torch.optim.AdamW(model.parameters(), fused=True, **hyper)
            if dtype == torch.float16:
                self.scaler = torch.amp.GradScaler(device.type)
            self.autocast = dtype
        else:
            from mixprec import amp
            from mixprec.optimizers import FusedAdam

            self.amp, self.autocast = amp, None  # O1's autocast is amp's own, inside the forward
            optimizer = FusedAdam(model.parameters(), adam_w_mode=True, **hyper)
            model, optimizer = amp.initialize(model, optimizer, opt_level=variant, dtype=dtype, verbosity=0)
            self.optimizer = optimizer
        self.model = model

    def _ctx(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def step(self, x: torch.Tensor, y: torch.Tensor, clock=None) -> torch.Tensor:
        """One training step; ``clock`` (e2e_phases.PhaseClock, under --profile) marks its phases."""
        mark = clock.mark if clock is not None else (lambda phase: None)
        self.optimizer.zero_grad(set_to_none=True)
        with self._ctx():
            loss = loss_of(self.spec, self.model, x, y)
        mark("forward")
        if self.amp is not None:
            with self.amp.scale_loss(loss, self.optimizer) as scaled:
                scaled.backward()
                mark("backward")
            mark("loss_scale")  # scale_loss's exit: the non-finite check and the scale update
            self.optimizer.step()
        else:
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            mark("backward")
            mark("loss_scale")  # torch's scaler checks inside step()
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        mark("optimizer")
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.eval()
        try:
            with self._ctx():
                return float(loss_of(self.spec, self.model, x, y).float())
        finally:
            self.model.train()

    def applied_steps(self) -> int:
        """Updates actually applied (an overflowing fp16 step is skipped). Syncs."""
        group = self.optimizer.param_groups[0]
        step = group.get("step")  # mixprec: per group
        if step is None:
            step = self.optimizer.state[group["params"][0]]["step"]  # torch: per param
        return int(step.item() if isinstance(step, torch.Tensor) else step)


def release(device: torch.device) -> None:
    """Frees what the last run left, so that each run's peak is its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(spec, variant: str, dtype_name: str, batches: Batches, held_out: tuple, device: torch.device, args) -> dict:
    name = f"torch-{dtype_name}" if variant == "torch" else f"mixprec-{variant}-{dtype_name}"
    row: dict = {"model": spec.name, "variant": name, "level": variant, "dtype": dtype_name, "status": "ok",
                 "peer": None if variant == "torch" else f"torch-{dtype_name}", "batch": batches.batch_size}
    trainer = model = None
    try:
        release(device)
        model = build(spec, args.tiny, args.seq_len, args.seed, device)
        row["params_M"] = sum(p.numel() for p in model.parameters()) / 1e6
        trainer = Trainer(spec, model, variant, DTYPES[dtype_name], device, args)
        losses = []
        for i in range(args.warmup):
            losses.append(trainer.step(*batches[i]))
        sync(device)
        t0 = time.perf_counter()
        for i in range(args.warmup, args.warmup + args.steps):
            losses.append(trainer.step(*batches[i]))
        sync(device)
        seconds = time.perf_counter() - t0
        row["ms"] = seconds / args.steps * 1e3
        row["per_s"] = batches.per_batch * args.steps / seconds
        if device.type == "cuda":
            row["peak_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
        curve = torch.stack([v.float() for v in losses]).cpu()
        row["first_loss"], row["train_loss"] = float(curve[0]), float(curve[-1])
        row["loss"] = trainer.eval_loss(*held_out)
        row["skipped_steps"] = len(losses) - trainer.applied_steps()
        if not (torch.isfinite(curve).all() and math.isfinite(row["loss"])):
            row["status"] = "non-finite loss"
        elif args.profile:  # after the figures above: the profiled steps train on, off the record
            row["profile"] = profile_steps(lambda i, clock: trainer.step(*batches[i], clock), device, 0,
                                           args.profile_steps)
    except Exception as err:  # noqa: BLE001 - one run's failure (OOM, an op missing) must not end the others
        text = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        row["status"] = f"error: {type(err).__name__}: {text}"
        traceback.print_exc()
    finally:
        trainer = model = None  # noqa: F841 - dropped before release()
    release(device)
    return row


def print_profile(row: dict) -> None:
    """Where a variant's step goes: per phase wall / host / kernel time, kernels by kind, the top
    kernels (kernel times on CUDA only)."""
    p = row["profile"]
    print(f"\nProfile {row['model']} {row['variant']} ({p['steps']} steps, synchronized after each phase; "
          f"unsynced step {row['ms']:.2f} ms)")
    print(common.format_table([dict(phase=k, **v) for k, v in p["phases"].items()],
                              ["phase", "wall_ms", "host_ms", "busy_ms", "idle_ms"],
                              ["phase", "wall ms", "host ms", "kernels ms", "idle ms"]))
    if "busy_ms" in p:
        print(f"kernels {p['busy_ms']:.2f} ms per step; by kind (ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in p["kinds_ms"].items()))
        for name, ms in p["top_kernels_ms"]:
            print(f"  {ms:8.3f} ms  {name}")


def add_ratios(rows: list[dict]) -> None:
    by_name = {(r["model"], r["variant"]): r for r in rows}
    for r in rows:
        peer = by_name.get((r["model"], r["peer"])) if r["peer"] else None
        if peer is None or r["status"] != "ok" or peer["status"] != "ok":
            continue
        r["speed_vs_peer"] = r["per_s"] / peer["per_s"]
        if "peak_GiB" in r:
            r["mem_vs_peer"] = r["peak_GiB"] / peer["peak_GiB"]
        r["loss_vs_peer_pct"] = 100.0 * (r["loss"] - peer["loss"]) / abs(peer["loss"])


def bars(rows: list[dict]) -> list[str]:
    """Issue 22's bars, one verdict line each, for the rows that have a peer."""
    out = []
    for r in rows:
        if "speed_vs_peer" not in r:
            continue
        tag = f"{r['model']} {r['variant']}"
        need = O2_SPEED_BARS.get((r["model"], r["dtype"])) if r["level"] == "O2" else O1_SPEED_BAR
        if need is not None:
            out.append(f"{'PASS' if r['speed_vs_peer'] >= need else 'FAIL'} {tag}: {r['speed_vs_peer']:.3f}x "
                       f"torch.amp (bar {need}x)")
        ok = abs(r["loss_vs_peer_pct"]) <= LOSS_BAR_PCT
        out.append(f"{'PASS' if ok else 'FAIL'} {tag}: loss {r['loss_vs_peer_pct']:+.2f}% vs torch.amp "
                   f"(bar {LOSS_BAR_PCT}%)")
        if r["level"] == "O2" and "mem_vs_peer" in r:
            out.append(f"{'PASS' if r['mem_vs_peer'] <= 1.0 else 'FAIL'} {tag}: peak memory {r['mem_vs_peer']:.3f}x "
                       "torch.amp's (bar 1.0x)")
    return out


COLUMNS = ["model", "variant", "batch", "status", "per_s", "speed_vs_peer", "ms", "peak_GiB", "mem_vs_peer", "train_loss",
           "loss", "loss_vs_peer_pct", "skipped_steps"]
HEADERS = ["model", "variant", "batch", "status", "items/s", "x torch.amp", "ms/step", "peak GiB", "mem x torch.amp",
           "last train loss", "held-out loss", "loss vs torch.amp %", "skipped"]


def table(rows: list[dict]) -> str:
    return common.format_table(rows, COLUMNS, HEADERS)


def markdown(rows: list[dict], env: dict, args) -> str:
    units = ", ".join(f"{name}: {MODELS[name].unit()}" for name in dict.fromkeys(r["model"] for r in rows))
    lines = [f"{env['date']} | {common.device_label(env)} | torch {env['torch']} | mixprec {env['mixprec']} | "
             f"transformers {env.get('transformers', '-')} | timm {env.get('timm', '-')}",
             f"`{env['command']}`: {args.warmup} warm-up + {args.steps} timed steps"
             f"{', sequence ' + str(args.seq_len) if any(MODELS[m].kind == 'lm' for m in args.model_list) else ''}; "
             f"items/s are {units}.", "", table(rows)]
    verdicts = bars(rows)
    if verdicts:
        lines += ["", "Issue 22 bars:", ""] + [f"- {v}" for v in verdicts]
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(
                                         ["models:"] + [f"  {m.name:9s} {m.about} (default dtypes: "
                                                        f"{', '.join(m.dtypes)})" for m in MODELS.values()]))
    parser.add_argument("--models", default=",".join(MODELS), help="comma list (default: all)")
    parser.add_argument("--levels", default="O1,O2",
                        help="comma list of mixprec levels: O1, O2 (each in the model's default dtypes) or "
                             "O1-fp16, O2-bf16, ... (default O1,O2); each dtype's torch.amp peer runs too")
    parser.add_argument("--steps", type=int, default=30, help="timed steps after the warm-up (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first; they train too (default 5)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="per step (default: 8 sequences for the LMs, 64 images; --tiny: 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="LM sequence length (default 1024; --tiny: 32)")
    parser.add_argument("--lr", type=float, default=None, help="AdamW lr (default 3e-4; --tiny: 2e-3)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (2 layers, width 64; 32x32 images): "
                        "seconds on a CPU")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="default: cuda if available, else cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=1234, help="weights and data seed (default 1234)")
    parser.add_argument("--profile", action="store_true", help="after each run, its phases (forward, backward, "
                        "loss_scale, optimizer) synchronized, and on CUDA its kernels under torch.profiler")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps per profiling pass (default 3)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON here")
    parser.add_argument("--markdown", default=None, metavar="PATH",
                        help="write the table, its setting and the bars as Markdown here (for benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.model_list if m not in MODELS]
    if bad or not args.model_list:
        parser.error(f"--models: unknown model(s) {bad}; choose from {', '.join(MODELS)}")
    args.level_list = []
    for raw in (s.strip() for s in args.levels.split(",") if s.strip()):
        level, _, dtype = raw.upper().partition("-")
        if level not in LEVELS or (dtype and dtype.lower() not in DTYPES):
            parser.error(f"--levels: unknown level {raw!r}; use O1, O2, O1-fp16, O1-bf16, O2-fp16 or O2-bf16")
        args.level_list.append((level, dtype.lower() or None))
    if not args.level_list:
        parser.error("--levels: no level given")
    if args.steps < 1 or args.warmup < 0 or args.profile_steps < 1:
        parser.error("--steps and --profile-steps must be >= 1, --warmup >= 0")
    args.seq_len = args.seq_len if args.seq_len is not None else (32 if args.tiny else 1024)
    args.lr = args.lr if args.lr is not None else (2e-3 if args.tiny else 3e-4)
    if (args.batch_size is not None and args.batch_size < 1) or args.seq_len < 2:
        parser.error("--batch-size must be >= 1 and --seq-len >= 2")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a positive number, got {args.lr}")
    args.parser = parser
    return args


def variants_of(spec, args) -> list[tuple[str, str]]:
    """(variant, dtype) pairs for one model: each dtype's torch.amp peer first, then mixprec's levels."""
    chosen = []
    for level, dtype in args.level_list:
        for d in ([dtype] if dtype else spec.dtypes):
            chosen.append((level, d))
    chosen = list(dict.fromkeys(chosen))
    peers = [("torch", d) for d in dict.fromkeys(d for _, d in chosen)]
    return peers + chosen


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = common.resolve_device(args.parser, args)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as image models train; the warm-up steps pick the kernels
    missing = import_libraries()
    for lib, why in missing.items():
        models = [m for m in args.model_list if MODELS[m].library == lib]
        if models:
            print(f"{lib} is not available ({why}): skipping {', '.join(models)}. Install it with: {INSTALL_HINT}",
                  file=sys.stderr, flush=True)
    runnable = [m for m in args.model_list if MODELS[m].library not in missing]
    env = common.environment(device)
    for lib in ("transformers", "timm"):
        if lib not in missing:
            env[lib] = sys.modules[lib].__version__
    print(f"{common.device_label(env)} | torch {torch.__version__} | mixprec {env['mixprec']} | "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    rows: list[dict] = []
    for name in runnable:
        spec = MODELS[name]
        batch = args.batch_size or (4 if args.tiny else 8 if spec.kind == "lm" else 64)
        batches = Batches(spec, args.tiny, batch, args.seq_len, args.warmup + args.steps + 1, args.seed, device)
        held_out = batches[len(batches) - 1]  # never trained on: the runs use the ones before it
        for variant, dtype in variants_of(spec, args):
            row = run(spec, variant, dtype, batches, held_out, device, args)
            rows.append(row)
            brief = (f"{row['per_s']:.1f} {spec.unit()}, loss {row['loss']:.4f}"
                     + (f", peak {row['peak_GiB']:.2f} GiB" if "peak_GiB" in row else "")) if "loss" in row else ""
            print(f"[{name} {row['variant']}] {row['status']} {brief}", flush=True)
        del batches
    add_ratios(rows)
    for row in rows:
        if "profile" in row:
            print_profile(row)
    print()
    print(table(rows) if rows else "no model ran")
    verdicts = bars(rows)
    if verdicts:
        where = "" if device.type == "cuda" else " (on the CPU: not meaningful, shown for the format)"
        print(f"\nIssue 22 bars{where}:\n" + "\n".join("  " + v for v in verdicts))
    config = {"models": runnable, "skipped": missing, "steps": args.steps, "warmup": args.warmup,
              "seq_len": args.seq_len, "lr": args.lr, "seed": args.seed, "tiny": args.tiny}
    if args.json:
        common.write_json(args.json, env, rows, config=config, bars=verdicts)
    if args.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(markdown(rows, env, args))
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        print(f"\n{len(failed)} run(s) did not complete: "
              + "; ".join(f"{r['model']} {r['variant']}: {r['status']}" for r in failed))
    return 1 if failed or not runnable else 0


if __name__ == "__main__":
    sys.exit(main())
