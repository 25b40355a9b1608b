"""End-to-end GPT-2 training benchmark (issue 7): fp32, torch.amp fp16/bf16 and mixprec's amp
levels, GradScaler and FusedAdam, in one run, from the same initial weights on the same data.

    python benchmarks/e2e_gpt2.py --out out/e2e.json               # small and large, every variant
    python benchmarks/e2e_gpt2.py --sizes large --profile          # where each step's time goes
    python benchmarks/e2e_gpt2.py --long-run 300                   # loss after 300 steps vs fp32
    python benchmarks/e2e_gpt2.py --sizes large --repeats 3        # losses averaged, steady runs timed
    python benchmarks/e2e_gpt2.py --device cpu --tiny --steps 2    # smoke run

Per variant: median step time after warm-up (CUDA events, host never synchronized in the loop),
tokens/s, peak memory of the training loop, the held-out loss after all steps, and ratios to the
torch.amp peer of the same dtype. The learning rate follows GPT-2's schedule (warm-up, then
cosine decay) over the run's steps; --schedule constant keeps it flat. A variant that fails (OOM, ...) is recorded and the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
import traceback
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from e2e_phases import PHASES, PhaseClock, medians, profile_steps  # noqa: E402
from e2e_variants import VARIANTS, Hyper, train  # noqa: E402
from gpt2_model import SIZES, Batches, build_model, weight_checksum  # noqa: E402

LONG_RUN_VARIANTS = "fp32,torch-fp16,mixprec-o2-fp16,mixprec-o2-bf16,mixprec-o2-fp16-xent"
#: Issue 7's bars on the H200: (size, variant, tokens/s ratio to its peer at least).
SPEED_BARS = tuple((size, name + suffix, need) for size, name, need in (
    ("large", "mixprec-o2-fp16", 1.25), ("small", "mixprec-o2-fp16", 1.15), ("large", "mixprec-o2-bf16", 1.20))
    for suffix in ("", "-xent"))  # O2 as is, and with mixprec's fused loss
#: Issue 24's lean-O2 bars (H200, GPT-2 large): (variant, peak memory ratio to torch-bf16 at most);
#: each must also step no slower than mixprec-o2-bf16 (fp32 masters and moments).
LEAN_MEMORY_BARS = (("mixprec-o2-bf16-rem-bf16m", 0.75), ("mixprec-o2-bf16-rem-q8", 0.65))
LOSS_BAR_PCT, LONG_LOSS_BAR_PCT = 1.0, 0.5
#: A run is steady when its median step is within this factor of its fastest one. A GPU-bound loop
#: is (its steps differ by well under 1%); a run whose host stalls for seconds is not (H200, large:
#: medians 10-70% above their min), and its speed ratios say nothing about either library.
STEADY_RATIO = 1.05


def release(device: torch.device) -> None:
    """Frees what the last variant left, so each variant's peak is its own. A device left broken by
    a failed variant (a sticky CUDA error) is reported here and fails the variants that follow,
    not the run."""
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        except RuntimeError as err:
            print(f"release: {type(err).__name__}: {err}", file=sys.stderr)


def run_variant(name: str, size: str, batches: Batches, device: torch.device, args, hyper: Hyper,
                n_total: int, warmup: int) -> dict:
    v, cfg = VARIANTS[name], SIZES[size]
    row: dict = {"size": size, "variant": name, "dtype": v.dtype, "peer": v.peer, "about": v.about, "status": "ok"}
    cuda = device.type == "cuda"
    model = trainer = None
    try:
        release(device)
        t0 = time.perf_counter()
        model = build_model(cfg, device, args.seed)
        row["params_M"] = sum(p.numel() for p in model.parameters()) / 1e6
        row["init_checksum"] = weight_checksum(model)  # equal across variants: same start
        trainer = v.make(model, device, hyper)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()  # the loop's peak: weights, state, activations
            row["setup_GiB"] = torch.cuda.memory_allocated() / 2**30
        row["setup_s"] = time.perf_counter() - t0

        clock = PhaseClock(device, n_total)
        losses = train(trainer, batches, hyper, clock)
        row["wall_ms"] = (time.perf_counter() - clock.host_marks[warmup][0]) / (n_total - warmup) * 1e3
        times = clock.step_seconds(first=warmup)
        row["ms"] = statistics.median(times) * 1e3
        row["min_ms"] = min(times) * 1e3
        row["step_ms"] = [round(t * 1e3, 3) for t in times]  # every timed step: shows a bimodal loop
        row["tok_s"] = cfg.tokens_per_step / statistics.median(times)
        row["phases_ms"] = dict(zip(PHASES, (t * 1e3 for t in medians(clock.phase_seconds(first=warmup)))))
        row["host_ms"] = sum(medians(clock.enqueue[warmup:])) * 1e3  # Python + launches per step, unsynced
        if cuda:
            row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
            row["peak_reserved_GiB"] = torch.cuda.max_memory_reserved() / 2**30

        curve = torch.stack([loss.float() for loss in losses]).cpu()
        every = max(1, n_total // 50)
        row["train_losses"] = [(i + 1, round(float(curve[i]), 5)) for i in range(n_total)
                               if (i + 1) % every == 0 or i + 1 == n_total]
        row["train_loss"] = float(curve[-min(5, n_total):].mean())  # the last steps' mean
        row["steps"] = n_total
        row["loss"] = float(trainer.eval_loss(*batches.held_out()))  # held out, after n_total updates
        row["skipped_steps"] = n_total - trainer.applied_steps()
        row["loss_scale"] = trainer.loss_scale()
        if not (torch.isfinite(curve).all() and math.isfinite(row["loss"])):
            row["status"] = "non-finite loss"
        if args.profile and row["status"] == "ok":
            trace = os.path.join(args.trace_dir, f"{size}-{name}.json") if args.trace_dir else None
            if trace:
                os.makedirs(args.trace_dir, exist_ok=True)
            row["profile"] = profile_steps(lambda i, clk: trainer.step(*batches.train(i), clk), device,
                                           n_total, args.profile_steps, trace)
            row["profile"]["unsynced_step_ms"] = row["ms"]
    except Exception as err:  # noqa: BLE001 - one variant's failure (OOM, missing kernel) must not end the run
        row["status"] = f"error: {type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
        traceback.print_exc()
    finally:
        model = trainer = None  # noqa: F841 - drop the references before release()
    release(device)
    return row


def is_steady(run: dict) -> bool:
    """A GPU-bound loop's median step stays within STEADY_RATIO of its fastest; a run past that
    was slowed by something else (on the H200 machines: stretches where the host issues slowly)."""
    return run["ms"] <= STEADY_RATIO * run["min_ms"]


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (size, variant) from its repeated runs: the timing of the median steady run (of
    any run when none was steady), the mean held-out loss with every run's loss beside it, the
    largest peak. Repeats make the loss bar judgeable where one run's loss is not reproducible
    (H200, large, fp16: three identical torch.amp runs ended 1.5% apart)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["size"], r["variant"]), []).append(r)
    out = []
    for group in groups.values():
        ok = [r for r in group if r["status"] == "ok"]
        if not ok:
            out.append(dict(group[0], repeats=len(group)))
            continue
        steady = [r for r in ok if is_steady(r)]
        timed = sorted(steady or ok, key=lambda r: r["ms"])
        row = dict(timed[(len(timed) - 1) // 2])  # the median run (the faster middle one of an even count)
        row.pop("repeat", None)
        row["repeats"], row["steady_repeats"], row["steady"] = len(ok), len(steady), bool(steady)
        row["min_ms"] = min(r["min_ms"] for r in ok)
        row["loss_runs"] = [r["loss"] for r in ok]
        row["loss"] = statistics.fmean(row["loss_runs"])
        row["skipped_runs"] = [r["skipped_steps"] for r in ok]
        if all("peak_GiB" in r for r in ok):
            row["peak_GiB"] = max(r["peak_GiB"] for r in ok)
        if len(ok) < len(group):
            row["failed_repeats"] = [r["status"] for r in group if r["status"] != "ok"]
        out.append(row)
    return out


def compare(rows: list[dict]) -> None:
    """Adds ratios to each row's peer (same size, torch.amp of the same dtype) and to fp32."""
    ok = {(r["size"], r["variant"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        peer = ok.get((r["size"], r["peer"])) if r["peer"] else None
        if peer is not None:
            r["vs_peer"] = peer["ms"] / r["ms"]  # = tokens/s ratio
            if r.get("peak_GiB") and peer.get("peak_GiB"):
                r["mem_vs_peer"] = r["peak_GiB"] / peer["peak_GiB"]
            r["loss_vs_peer_pct"] = 100.0 * (r["loss"] - peer["loss"]) / peer["loss"]
        ref = ok.get((r["size"], "fp32"))
        if ref is not None and r is not ref:
            r["loss_vs_fp32_pct"] = 100.0 * (r["loss"] - ref["loss"]) / ref["loss"]


def bars(rows: list[dict], long_run: bool) -> list[str]:
    """Issue 7's bars, judged on this run's figures (they are meant for the H200)."""
    ok = {(r["size"], r["variant"]): r for r in rows if r["status"] == "ok"}
    out = []

    def verdict(good: bool) -> str:
        return "PASS" if good else "FAIL"

    if long_run:
        for (size, name), r in sorted(ok.items()):
            if name.startswith("mixprec-o2") and "loss_vs_fp32_pct" in r:
                d = r["loss_vs_fp32_pct"]
                mean = f" (means of {r['repeats']} runs each)" if r.get("repeats", 1) > 1 else ""
                out.append(f"{verdict(abs(d) <= LONG_LOSS_BAR_PCT)} {size} {name}: loss after {r['steps']} steps "
                           f"{d:+.3f}% vs fp32{mean} (bar {LONG_LOSS_BAR_PCT}%)")
        return out
    for size, name, need in SPEED_BARS:
        r = ok.get((size, name))
        if r is not None and "vs_peer" in r:
            steady = r.get("steady", True) and ok[(size, r["peer"])].get("steady", True)
            out.append(f"{verdict(r['vs_peer'] >= need) if steady else 'UNSTEADY'} {size} {name}: "
                       f"{r['vs_peer']:.3f}x {r['peer']} tokens/s (bar {need}x)"
                       + ("" if steady else f"; not judged: a run's median was over {STEADY_RATIO}x its min"))
    for name, need in LEAN_MEMORY_BARS:
        r, o2 = ok.get(("large", name)), ok.get(("large", "mixprec-o2-bf16"))
        if r is not None and "mem_vs_peer" in r:
            out.append(f"{verdict(r['mem_vs_peer'] <= need)} large {name}: peak {r['peak_GiB']:.2f} GiB, "
                       f"{r['mem_vs_peer']:.3f}x {r['peer']} (issue 24 bar {need}x)")
        if r is not None and o2 is not None:
            steady = r.get("steady", True) and o2.get("steady", True)
            speed = o2["ms"] / r["ms"]
            out.append(f"{verdict(speed >= 1.0) if steady else 'UNSTEADY'} large {name}: {speed:.3f}x "
                       f"mixprec-o2-bf16's tokens/s (issue 24 bar: no slower, 1.0x)")
    for (size, name), r in sorted(ok.items()):
        if not name.startswith("mixprec-o2"):
            continue
        if "mem_vs_peer" in r:
            out.append(f"{verdict(r['mem_vs_peer'] <= 1.0)} {size} {name}: peak {r['peak_GiB']:.2f} GiB, "
                       f"{r['mem_vs_peer']:.3f}x {r['peer']} (bar 1.0x)")
        if "loss_vs_peer_pct" in r:
            d = r["loss_vs_peer_pct"]
            mean = f" (means of {r['repeats']} runs each)" if r.get("repeats", 1) > 1 else ""
            out.append(f"{verdict(abs(d) <= LOSS_BAR_PCT)} {size} {name}: loss after {r['steps']} steps {d:+.3f}% "
                       f"vs {r['peer']}{mean} (bar {LOSS_BAR_PCT}%)")
    return out


def print_tables(rows: list[dict], profile: bool) -> None:
    main_cols = ["size", "variant", "ms", "min_ms", "wall_ms", "ktok_s", "vs_peer", "peak_GiB", "mem_vs_peer",
                 "loss", "loss_vs_peer_pct", "loss_vs_fp32_pct", "skipped_steps", "steady", "status"]
    shown = [dict(r, ktok_s=r["tok_s"] / 1e3 if "tok_s" in r else None,
                  vs_peer=f"{r['vs_peer']:.3f}x" if "vs_peer" in r else None,
                  mem_vs_peer=f"{r['mem_vs_peer']:.3f}x" if "mem_vs_peer" in r else None,
                  loss=f"{r['loss']:.4f}" if "loss" in r else None,
                  loss_vs_peer_pct=f"{r['loss_vs_peer_pct']:+.3f}%" if "loss_vs_peer_pct" in r else None,
                  loss_vs_fp32_pct=f"{r['loss_vs_fp32_pct']:+.3f}%" if "loss_vs_fp32_pct" in r else None,
                  steady=f"{r['steady_repeats']}/{r['repeats']}" if "steady_repeats" in r else None)
             for r in rows]
    print(common.format_table(shown, main_cols, ["size", "variant", "ms/step", "min ms", "wall ms", "k tok/s",
                                                 "vs peer", "peak GiB", "mem vs peer", "loss", "loss vs peer",
                                                 "loss vs fp32", "skipped", "steady", "status"]))
    print("\nPhases (median ms per step: device time between marks, the host never waiting for the device; "
          "host = the host's time to issue a step, blocked time included when the launch queue is full):")
    phase_rows = [dict(size=r["size"], variant=r["variant"], host=r["host_ms"], **r["phases_ms"])
                  for r in rows if "phases_ms" in r]
    print(common.format_table(phase_rows, ["size", "variant", *PHASES, "host"]))
    if not profile:
        return
    for r in rows:
        p = r.get("profile")
        if not p:
            continue
        print(f"\nProfile {r['size']} {r['variant']} ({p['steps']} steps synchronized after each phase; "
              f"unsynced step {r['ms']:.2f} ms)")
        prow = [dict(phase=k, **v) for k, v in p["phases"].items()]
        print(common.format_table(prow, ["phase", "wall_ms", "host_ms", "busy_ms", "idle_ms"],
                                  ["phase", "wall ms", "host ms", "kernels ms", "idle ms"]))
        if "busy_ms" in p:
            gap = r["ms"] - p["busy_ms"]
            print(f"kernels {p['busy_ms']:.2f} ms per step; unsynced step {r['ms']:.2f} ms -> device idle "
                  f"{gap:.2f} ms ({100 * gap / r['ms']:.1f}%: launch and framework overhead)")
            print("by kind (ms/step): " + ", ".join(f"{k} {v:.2f}" for k, v in p["kinds_ms"].items()))
            for name, ms in p["top_kernels_ms"]:
                print(f"  {ms:8.3f} ms  {name}")
        u = p.get("unsynced")
        if u:
            print(f"unsynced under the profiler: step {u['step_ms']:.2f} ms, kernels {u['busy_ms']:.2f} ms, device idle "
                  f"{u['idle_ms']:.2f} ms in {u['gaps_over_20us']:.0f} gaps over 20 us per step; largest gaps (us, "
                  "kernel before -> after):")
            for us, before, after in u["top_gaps"]:
                print(f"  {us:8.1f}  {before} -> {after}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(
                                         ["variants:"] + [f"  {v.name:20s} {v.about}" for v in VARIANTS.values()]))
    parser.add_argument("--sizes", default=None,
                        help="comma list of " + ", ".join(SIZES) + " (default small,large; small with --long-run)")
    parser.add_argument("--variants", default=None,
                        help=f"comma list (default: all; with --long-run: {LONG_RUN_VARIANTS})")
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first; they train too (default 5)")
    parser.add_argument("--long-run", type=int, default=None, metavar="N",
                        help="train N steps in all (timing over the steps after --warmup) and compare losses to fp32")
    parser.add_argument("--repeats", type=int, default=1,
                        help="train every variant N times, interleaved (all variants, then all again), and judge "
                             "the loss bars on the mean losses and the speed on the median steady run (default 1)")
    parser.add_argument("--retry-unsteady", type=int, default=0, metavar="N",
                        help="run an unsteady run (median step over 1.05x its fastest) again, up to N times; "
                             "every attempt is kept and its loss counted (default 0)")
    parser.add_argument("--profile", action="store_true",
                        help="after each variant, a synchronized phase breakdown and a torch.profiler kernel summary")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps per profiling pass (default 3)")
    parser.add_argument("--trace-dir", default=None, help="with --profile: write a Chrome trace per variant here")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="cuda", help="default cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny model only (2 layers, width 64, seq 64, "
                        "vocab 512): CPU smoke runs")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=1234, help="weights and data seed (default 1234)")
    parser.add_argument("--lr", type=float, default=Hyper.lr, help=f"AdamW peak learning rate (default {Hyper.lr})")
    parser.add_argument("--schedule", choices=["cosine", "constant"], default=Hyper.schedule,
                        help=f"lr schedule: cosine = linear warm-up over the first {Hyper.lr_warmup_ratio:.0%}% of the "
                             f"steps, then cosine decay to {Hyper.min_lr_ratio:g} x lr (GPT-2's); constant = lr "
                             "throughout (default cosine)")
    parser.add_argument("--out", default=None, help="write the results as JSON here (rewritten after each variant)")
    args = parser.parse_args(argv)

    if args.tiny and args.sizes not in (None, "tiny"):
        parser.error("--tiny runs the tiny model only; leave out --sizes")
    sizes = "tiny" if args.tiny else (args.sizes or ("small" if args.long_run else "small,large"))
    args.size_list = [s.strip() for s in sizes.split(",") if s.strip()]
    bad = [s for s in args.size_list if s not in SIZES]
    if bad or not args.size_list:
        parser.error(f"--sizes: unknown size(s) {bad}; choose from {', '.join(SIZES)}")
    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    every = ",".join(name for name, v in VARIANTS.items() if on_cuda or not v.cuda_only)
    variants = args.variants or (LONG_RUN_VARIANTS if args.long_run else every)
    args.variant_list = [v.strip() for v in variants.split(",") if v.strip()]
    bad = [v for v in args.variant_list if v not in VARIANTS]
    if bad or not args.variant_list:
        parser.error(f"--variants: unknown variant(s) {bad}; choose from {', '.join(VARIANTS)}")
    if len(set(args.variant_list)) != len(args.variant_list):
        parser.error("--variants: a variant is listed twice")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.retry_unsteady < 0:
        parser.error("--retry-unsteady must be >= 0")
    if args.steps < 1 or args.warmup < 0 or args.profile_steps < 1:
        parser.error("--steps and --profile-steps must be >= 1, --warmup >= 0")
    if args.long_run is not None and args.long_run <= args.warmup:
        parser.error(f"--long-run {args.long_run} must exceed --warmup {args.warmup}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a positive number, got {args.lr}")
    args.parser = parser
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    device = common.resolve_device(args.parser, args)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the fp32 variant; low-precision ones have no fp32 GEMM
    n_total = args.long_run if args.long_run else args.warmup + args.steps
    hyper = Hyper(lr=args.lr, schedule=args.schedule)
    env = common.environment(device)
    env["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    config = {"sizes": {s: vars(SIZES[s]) for s in args.size_list}, "variants": args.variant_list,
              "steps_total": n_total, "warmup": args.warmup, "hyper": vars(hyper), "seed": args.seed,
              "long_run": args.long_run, "repeats": args.repeats, "retry_unsteady": args.retry_unsteady}
    print(f"{common.device_label(env)} | torch {torch.__version__} | mixprec {env['mixprec']} | "
          f"{n_total} steps ({args.warmup} warm-up)", flush=True)
    runs: list[dict] = []
    rows: list[dict] = []
    for size in args.size_list:
        cfg = SIZES[size]
        extra = 3 * args.profile_steps if args.profile else 0
        batches = Batches(cfg, n_total + extra, device, args.seed)
        # Repeats interleaved, so that a slow stretch of the machine falls on every variant alike.
        for repeat in range(args.repeats):
            for name in args.variant_list:
                for attempt in range(1 + args.retry_unsteady):
                    row = run_variant(name, size, batches, device, args, hyper, n_total, args.warmup)
                    row["repeat"], row["attempt"] = repeat, attempt
                    runs.append(row)
                    brief = (f"{row['ms']:.2f} ms/step (min {row['min_ms']:.2f}), {row['tok_s'] / 1e3:.1f} k tok/s, "
                             f"loss {row['loss']:.4f}" + (f", peak {row['peak_GiB']:.2f} GiB" if "peak_GiB" in row
                                                          else "") if "loss" in row else "")
                    tag = f" #{repeat + 1}" if args.repeats > 1 else ""
                    tag += f" (retry {attempt})" if attempt else ""
                    print(f"[{size} {name}{tag}] {row['status']} {brief}", flush=True)
                    if row["status"] != "ok" or is_steady(row):
                        break
                rows = summarize(runs)
                compare(rows)
                if args.out:  # rewritten each time, so a run cut short still leaves its results
                    common.write_json(args.out, env, rows, config=config, bars=bars(rows, bool(args.long_run)),
                                      runs=runs if len(runs) > len(rows) else None)
        del batches
        release(device)
    print()
    print_tables(rows, args.profile)
    verdicts = bars(rows, bool(args.long_run))
    if verdicts:
        print("\nIssue 7 bars (meant for the H200):" if device.type == "cuda" else "\nIssue 7 bars (on the CPU: "
              "not meaningful, shown for the format):")
        print("\n".join("  " + v for v in verdicts))
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        print(f"\n{len(failed)} variant(s) did not complete: " + "; ".join(f"{r['size']} {r['variant']}: {r['status']}"
                                                                          for r in failed))


if __name__ == "__main__":
    main()
