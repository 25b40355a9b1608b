"""GPT-2 training on several GPUs (issue 9): DDP and FSDP2, mixprec O2 against torch.amp fp16,
tokens/s per GPU at one rank and at N, and the scaling efficiency between them.

    python benchmarks/e2e_distributed.py --out out/dist.json           # 1 and every GPU, NCCL
    python benchmarks/e2e_distributed.py --worlds 1,2 --sizes small    # the issue's run on 2 GPUs
    python benchmarks/e2e_distributed.py --device cpu --tiny --steps 2 # smoke run: 2 gloo ranks on the CPU

Each world size is one set of spawned ranks (one process per GPU, a file store, NCCL on GPUs and
gloo on the CPU; `--backend gloo` on GPUs puts two ranks on one GPU, which tests the code but
says nothing of speed). Every rank trains the same GPT-2 (e2e_gpt2.py's model, seed, schedule
and variants) on its own batches: the global batch grows with the ranks (weak scaling), so
tokens/s per GPU at N ranks over that at one rank is the scaling efficiency. A step's time is
the slowest rank's median. Wraps:

- ddp:   torch.amp fp16 = autocast + GradScaler + AdamW(fused) around DistributedDataParallel;
         mixprec = amp.initialize(O2) + FusedAdam, then DDP (docs/distributed.md's recipe);
- fsdp2: fully_shard per block and at the top with fp16 params and fp32 gradient reduction;
         torch.amp = that MixedPrecisionPolicy + GradScaler + AdamW(fused);
         mixprec = mixed_precision_policy("O2") + FusedAdam + mixprec.GradScaler.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from e2e_phases import PhaseClock  # noqa: E402
from e2e_variants import (AmpTrainer, AutocastTrainer, Hyper, fused_adam, mixprec_scaler,  # noqa: E402
                         torch_adamw, torch_scaler, train)
from gpt2_model import SIZES, Batches, build_model, weight_checksum  # noqa: E402

#: NVLink multicast stays off in every rank: the lent GPU machines lack it (KINDS.md); spawned
#: ranks inherit this process's environment, which is set before they start.
RANK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
WRAPS = ("ddp", "fsdp2")
VARIANTS = ("torch-fp16", "mixprec-o2-fp16", "mixprec-o2-fp16-xent")
PEER = "torch-fp16"
#: Issue 9's bars: DDP scaling efficiency on 2 GPUs, and mixprec O2 over torch.amp fp16 per GPU.
EFFICIENCY_BAR, SPEEDUP_BAR = 0.90, 1.2


# ---- one rank ----------------------------------------------------------------------------------


def make_trainer(wrap: str, variant: str, model, device: torch.device, hyper: Hyper):
    """The model wrapped for `wrap` and trained as `variant` (a Trainer of e2e_variants)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    fp16 = torch.float16
    model.fused_loss = variant.endswith("-xent")
    ddp_args = {"device_ids": [device.index]} if device.type == "cuda" else {}
    if wrap == "ddp":
        if variant == PEER:
            return AutocastTrainer(DDP(model, **ddp_args), fp16, device, torch_adamw(model, hyper),
                                   torch_scaler(device))
        trainer = AmpTrainer(model, device, fused_adam(model, hyper), "O2", fp16)
        trainer.model = DDP(trainer.model, **ddp_args)  # after amp.initialize, which casts in place
        return trainer
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from mixprec.distributed import mixed_precision_policy

    if variant == PEER:
        inner = root = MixedPrecisionPolicy(param_dtype=fp16, reduce_dtype=torch.float32)
    else:  # docs/distributed.md: the blocks keep fp16 activations, the model's output goes to fp32
        inner, root = mixed_precision_policy("O2", fp16, root=False), mixed_precision_policy("O2", fp16)
    for block in model.h:
        fully_shard(block, mp_policy=inner)
    fully_shard(model, mp_policy=root)
    if variant == PEER:
        return AutocastTrainer(model, None, device, torch_adamw(model, hyper), torch_scaler(device))
    return AutocastTrainer(model, None, device, fused_adam(model, hyper), mixprec_scaler(device))


def run_one(wrap: str, variant: str, rank: int, world: int, device: torch.device, args) -> dict:
    """Trains one (wrap, variant) on every rank; returns this rank's figures."""
    cfg = SIZES[args.size]
    hyper = Hyper()
    n_total = args.warmup + args.steps
    batches = Batches(cfg, n_total, device, args.seed + 1 + rank)  # each rank its own data
    model = build_model(cfg, device, args.seed)  # the same start on every rank
    trainer = make_trainer(wrap, variant, model, device, hyper)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    clock = PhaseClock(device, n_total)
    losses = train(trainer, batches, hyper, clock)
    step_s = statistics.median(clock.step_seconds(first=args.warmup))
    row = {"step_s": step_s, "loss": float(torch.stack(losses[-min(5, n_total):]).float().mean()),
           "skipped": n_total - trainer.applied_steps()}
    if device.type == "cuda":
        row["peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    row["checksum"] = weight_checksum(trainer.model)  # a collective under FSDP2: every rank calls it
    return row


def rank_main(rank: int, world: int, args, tmp: str) -> None:
    os.environ.update(RANK_ENV)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    kwargs = {}
    if cuda:
        torch.cuda.set_device(device)
        if args.backend == "nccl":
            kwargs["device_id"] = device
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    torch.distributed.init_process_group(args.backend, init_method=f"file://{tmp}/store", rank=rank,
                                         world_size=world, timeout=datetime.timedelta(seconds=600), **kwargs)
    rows = []
    try:
        for wrap in args.wrap_list:
            for variant in args.variant_list:
                row = {"wrap": wrap, "variant": variant, "world": world, "status": "ok"}
                try:
                    mine = run_one(wrap, variant, rank, world, device, args)
                except Exception as err:  # noqa: BLE001 - one failure (OOM, a missing collective) must not end the run
                    traceback.print_exc()
                    mine = {"error": f"{type(err).__name__}: {str(err).strip()[:200]}"}
                every = [None] * world
                torch.distributed.all_gather_object(every, mine)  # the slowest rank sets the pace
                errors = [r["error"] for r in every if "error" in r]
                if errors:
                    row["status"] = "error: " + errors[0]
                else:
                    row.update(summarize_ranks(every, SIZES[args.size].tokens_per_step))
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        if rank == 0:
            with open(os.path.join(tmp, "rows.json"), "w") as f:
                json.dump(rows, f)
        torch.distributed.destroy_process_group()
    # Leave without the interpreter's teardown: on the 2-core CPU machine about one gloo rank in
    # ten aborted there ("terminate called without an active exception", no Python frame left),
    # after its work and the rows were done, with or without mixprec's layer kernels.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def summarize_ranks(every: list[dict], tokens_per_rank_step: int) -> dict:
    step_s = max(r["step_s"] for r in every)
    checks = [r["checksum"] for r in every]
    return {"ms": step_s * 1e3, "tok_s_per_gpu": tokens_per_rank_step / step_s,
            "loss": statistics.fmean(r["loss"] for r in every), "skipped": max(r["skipped"] for r in every),
            "peak_GiB": max((r["peak_GiB"] for r in every if "peak_GiB" in r), default=None),  # CUDA only
            # relative spread of the parameter sums: 0 when every rank holds the same weights
            "ranks_agree": max(checks) - min(checks) <= 1e-9 * max(1.0, abs(checks[0]))}


# ---- the launcher ------------------------------------------------------------------------------


def run_world(world: int, args) -> list[dict]:
    """Spawns `world` ranks that run every (wrap, variant); returns rank 0's rows."""
    os.environ.update(RANK_ENV)  # inherited by the spawned ranks
    with tempfile.TemporaryDirectory(prefix="mixprec-e2e-dist-") as tmp:
        torch.multiprocessing.start_processes(rank_main, args=(world, args, tmp), nprocs=world, join=True,
                                              start_method="spawn")
        with open(os.path.join(tmp, "rows.json")) as f:
            return json.load(f)


def derive(rows: list[dict]) -> None:
    """Adds, in place, each row's scaling efficiency (tokens/s per GPU over its one-rank figure)
    and its speed over the torch.amp peer of the same wrap and world."""
    ok = {(r["wrap"], r["variant"], r["world"]): r for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        alone = ok.get((r["wrap"], r["variant"], 1))
        r["efficiency"] = r["tok_s_per_gpu"] / alone["tok_s_per_gpu"] if alone and r["world"] > 1 else None
        peer = ok.get((r["wrap"], PEER, r["world"]))
        r["vs_peer"] = r["tok_s_per_gpu"] / peer["tok_s_per_gpu"] if peer and r["variant"] != PEER else None


def bars(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["status"] != "ok" or r["world"] < 2:
            continue
        where = f"{r['wrap']} {r['variant']} on {r['world']} ranks"
        if r["wrap"] == "ddp" and r["efficiency"] is not None:
            ok = r["efficiency"] >= EFFICIENCY_BAR
            out.append(f"{'PASS' if ok else 'FAIL'} {where}: scaling efficiency {r['efficiency']:.1%} "
                       f"(bar {EFFICIENCY_BAR:.0%})")
        if r["variant"].startswith("mixprec-o2") and r["vs_peer"] is not None:
            ok = r["vs_peer"] >= SPEEDUP_BAR
            out.append(f"{'PASS' if ok else 'FAIL'} {where}: {r['vs_peer']:.3f}x torch.amp fp16 tokens/s per GPU "
                       f"(bar {SPEEDUP_BAR}x)")
        if not r["ranks_agree"]:
            out.append(f"FAIL {where}: the ranks' weights differ after training")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="cuda (one rank per GPU) or cpu (gloo); default: cuda if available")
    parser.add_argument("--worlds", default=None,
                        help="comma list of rank counts (default: 1 and every GPU; on the CPU 1,2)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                        help="default: nccl on GPUs, gloo on the CPU")
    parser.add_argument("--sizes", dest="size", choices=["small", "large"], default="small",
                        help="GPT-2 size of e2e_gpt2.py (default small)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model (CPU smoke runs)")
    parser.add_argument("--wraps", default=",".join(WRAPS), help=f"comma list of {', '.join(WRAPS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--seed", type=int, default=1234, help="weights and data seed (default 1234)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but torch sees no usable GPU; use --device cpu")
    if args.tiny:
        args.size = "tiny"
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.backend == "nccl" and args.device == "cpu":
        parser.error("--backend nccl needs --device cuda")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    default_worlds = sorted({1, gpus}) if args.device == "cuda" else [1, 2]
    try:
        args.world_list = [int(w) for w in args.worlds.split(",")] if args.worlds else default_worlds
    except ValueError:
        parser.error(f"--worlds must be a comma list of integers, got {args.worlds!r}")
    if any(w < 1 for w in args.world_list):
        parser.error("--worlds: every rank count must be >= 1")
    if args.backend == "nccl" and max(args.world_list) > gpus:
        parser.error(f"--worlds {max(args.world_list)} needs that many GPUs with NCCL (found {gpus}); "
                     "--backend gloo shares GPUs between ranks")
    args.wrap_list = [w for w in args.wraps.split(",") if w]
    args.variant_list = [v for v in args.variants.split(",") if v]
    bad = [w for w in args.wrap_list if w not in WRAPS] + [v for v in args.variant_list if v not in VARIANTS]
    if bad or not args.wrap_list or not args.variant_list:
        parser.error(f"unknown or empty --wraps/--variants: {bad}; choose from {WRAPS} and {VARIANTS}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    env = common.environment(torch.device(args.device))
    print(f"{common.device_label(env)} | torch {torch.__version__} | {args.backend}, ranks {args.world_list}, "
          f"{args.size}, {args.warmup} + {args.steps} steps", flush=True)
    rows = []
    for world in args.world_list:
        rows += run_world(world, args)
    derive(rows)
    columns = ["wrap", "variant", "world", "ms", "tok_s_per_gpu", "efficiency", "vs_peer", "peak_GiB", "loss",
               "skipped", "ranks_agree", "status"]
    print(common.format_table(rows, columns))
    verdicts = bars(rows)
    if verdicts:
        print("Issue 9 bars (meant for 2 H200s with NCCL):")
        for line in verdicts:
            print("  " + line)
    if args.out:
        common.write_json(args.out, env, rows, config={k: v for k, v in vars(args).items() if k != "out"},
                          bars=verdicts)
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed: " + "; ".join(f"{r['wrap']} {r['variant']} world "
                                                                    f"{r['world']}: {r['status']}" for r in failed))


if __name__ == "__main__":
    main()
