"""End-to-end FP8 training benchmark: a Llama-style decoder (~1 B params; --model gpt2-large; --tiny
for a CPU smoke run) trained N steps under torch.amp bf16, amp O2 bf16, amp O2 + fp8=True and
torchao's float8 training where importable, in one process; plus the fused amax + cast kernel
against a device copy and torch's own cast.

    python benchmarks/e2e_fp8.py                     # H200: llama-1b, batch 4 x 2048 tokens
    python benchmarks/e2e_fp8.py --tiny --device cpu # smoke run (the CPU emulates the FP8 GEMMs)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import common
import mixprec
from mixprec import amp


@dataclasses.dataclass
class Config:
    dim: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int
    llama: bool = True  # RMSNorm, RoPE, SwiGLU, no biases; else GPT-2 (LayerNorm, learned positions, GELU)


CONFIGS = {
    # Llama-style, 16 x (2048, 5632): 0.95 B params with an untied 32000-token head.
    "llama-1b": Config(dim=2048, layers=16, heads=32, ffn=5632, vocab=32000, seq=2048, batch=4),
    # GPT-2 large (36 layers, width 1280), batch 4 x 1024 as in DESIGN.md's end-to-end figures.
    "gpt2-large": Config(dim=1280, layers=36, heads=20, ffn=5120, vocab=50304, seq=1024, batch=4, llama=False),
    "tiny": Config(dim=128, layers=2, heads=4, ffn=352, vocab=512, seq=64, batch=4),
}


def norm_of(c: Config) -> nn.Module:
    # eps given: with eps=None, mixprec.rms_norm (amp's layer kernels) takes bf16's epsilon (2^-7)
    # where torch's F.rms_norm takes fp32's, and the variants would train different models.
    return nn.RMSNorm(c.dim, eps=1e-5) if c.llama else nn.LayerNorm(c.dim)


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        self.norm1, self.norm2 = norm_of(c), norm_of(c)
        self.qkv = nn.Linear(c.dim, 3 * c.dim, bias=not c.llama)
        self.proj = nn.Linear(c.dim, c.dim, bias=not c.llama)
        self.up = nn.Linear(c.dim, (2 if c.llama else 1) * c.ffn, bias=not c.llama)  # SwiGLU: gate and up in one
        self.down = nn.Linear(c.ffn, c.dim, bias=not c.llama)

    def rope(self, t: torch.Tensor) -> torch.Tensor:
        # Angles from positions in fp32 inside the forward: a cast model must not round them to bf16.
        half = t.shape[-1] // 2
        inv = 10000.0 ** (-torch.arange(half, device=t.device, dtype=torch.float32) / half)
        ang = torch.arange(t.shape[-2], device=t.device, dtype=torch.float32)[:, None] * inv
        cos, sin = ang.cos().to(t.dtype), ang.sin().to(t.dtype)
        a, b = t[..., :half], t[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.c.heads, d // self.c.heads).permute(2, 0, 3, 1, 4)
        if self.c.llama:
            q, k = self.rope(q), self.rope(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        h = self.up(self.norm2(x))
        h = F.silu(h[..., :self.c.ffn]) * h[..., self.c.ffn:] if self.c.llama else F.gelu(h)
        return x + self.down(h)


class Decoder(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.pos = None if c.llama else nn.Embedding(c.seq, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = norm_of(c)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build(c: Config, device: torch.device, seed: int) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(c)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * c.layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
            nn.init.normal_(p, std=std)
    return model.to(device)


def batches(c: Config, device: torch.device, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable synthetic language: each token follows from the previous by a fixed random map,
    with 10% noise, so every variant's loss falls from log(vocab) toward the noise's entropy."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randperm(c.vocab, generator=g)
    out = []
    for _ in range(steps):
        t = torch.empty(c.batch, c.seq + 1, dtype=torch.long)
        t[:, 0] = torch.randint(0, c.vocab, (c.batch,), generator=g)
        noise = torch.rand(c.batch, c.seq, generator=g) < 0.1
        rand = torch.randint(0, c.vocab, (c.batch, c.seq), generator=g)
        for i in range(c.seq):
            t[:, i + 1] = torch.where(noise[:, i], rand[:, i], succ[t[:, i]])
        out.append((t[:, :-1].to(device), t[:, 1:].to(device)))
    return out


def make_variant(name: str, model: nn.Module, device: torch.device, lr: float):
    """(model, optimizer, step function) for one variant; step(tokens, targets) -> loss tensor."""
    cuda = device.type == "cuda"
    if name in ("torch.amp bf16", "torchao float8"):
        # torchao's float8 training as torchtitan runs it: fp32 weights, torch.autocast to bf16 around
        # the Linears it converts; so both variants take the same step.
        if name == "torchao float8":
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(model, module_filter_fn=lambda m, n: isinstance(m, nn.Linear)
                                       and m.in_features % 16 == 0 and m.out_features % 16 == 0)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=cuda, foreach=None if cuda else True)

        def step(x, y):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return model, opt, step
    opt = mixprec.optimizers.FusedAdam(model.parameters(), lr=lr, adam_w_mode=True)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, fp8=name.endswith("fp8"),
                                verbosity=0)

    def step(x, y):
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return model, opt, step


def run_variant(name: str, c: Config, device: torch.device, data, warmup: int, seed: int, lr: float) -> dict:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build(c, device, seed)
    params = sum(p.numel() for p in model.parameters())
    model, opt, step = make_variant(name, model, device, lr)
    losses, times = [], []
    for i, (x, y) in enumerate(data):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = step(x, y)
        losses.append(loss.detach())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    losses = [v.item() for v in losses]
    step_s = sorted(times)[len(times) // 2] if times else float("nan")
    row = {"variant": name, "params_M": params / 1e6, "step_ms": 1e3 * step_s,
           "tokens_per_s": c.batch * c.seq / step_s, "first_loss": losses[0],
           "final_loss": sum(losses[-3:]) / len(losses[-3:]), "status": "ok",
           "peak_GiB": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    if name.endswith("fp8"):
        row["fp8_layers"] = len(mixprec.diagnostics.fp8_report(model))
    del model, opt, step
    return row


def cast_microbenchmark(device: torch.device, n: int, runs: int, warmup: int) -> list[dict]:
    """mixprec.fp8_quantize (with and without the transpose and the amax) against torch's cast of
    the saturated product and a device copy, on an n x n bf16 tensor."""
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    scale, amax = torch.ones(1, device=device) * 4, torch.zeros(1, device=device)
    e4 = torch.float8_e4m3fn
    copy = common.measure_copy_bandwidth(device, nbytes=None if n >= 4096 else 32 << 20, runs=runs, warmup=warmup)
    unit, div = common.bandwidth_units(device)
    fns = {
        "mixprec cast+amax": (lambda: mixprec.fp8_quantize(x, scale, e4, amax=amax), 3 * n * n),
        "mixprec cast+amax+transpose": (lambda: mixprec.fp8_quantize(x, scale, e4, transpose=True, amax=amax),
                                        4 * n * n),
        "mixprec amax only": (lambda: mixprec.fp8_amax_(x, amax), 2 * n * n),
        "torch cast (clamp, to)": (lambda: (x.float() * scale).clamp(-448, 448).to(e4), 3 * n * n),
        "torch amax (abs, amax)": (lambda: x.abs().amax(), 2 * n * n),
    }
    timings = common.time_many({k: f for k, (f, _) in fns.items()}, device, runs=runs, warmup=warmup)
    rows = []
    for k, (_, nbytes) in fns.items():
        bw, share = common.achieved(nbytes, timings[k].median, copy)
        rows.append({"kernel": k, "us": 1e6 * timings[k].median, unit: bw / div, "of_copy": f"{share:.0f}%"})
    return rows


def torchao_status() -> str:
    try:
        from torchao.float8 import convert_to_float8_training  # noqa: F401
        return "importable"
    except Exception as e:  # noqa: BLE001  (any import failure means: not measured, say why)
        return f"not importable ({type(e).__name__}: {e})"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=["llama-1b", "gpt2-large"], default="llama-1b", help="decoder to train")
    p.add_argument("--tiny", action="store_true", help="a 2-layer width-128 decoder: a smoke run that fits a CPU")
    p.add_argument("--steps", type=int, default=None, help="training steps per variant (default 30; --tiny 6)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 5; --tiny 2)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the model's)")
    p.add_argument("--variants", default="torch.amp bf16,O2 bf16,O2 bf16 fp8,torchao float8",
                   help="comma-separated subset of the default list")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    p.add_argument("--cast-size", type=int, default=None, help="n of the n x n cast benchmark (8192; --tiny 512)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="default: cuda if available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    known = ["torch.amp bf16", "O2 bf16", "O2 bf16 fp8", "torchao float8"]
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variant_list if v not in known]
    if bad:
        p.error(f"--variants: unknown {bad}; choose from {known}")
    for flag in ("steps", "warmup", "batch", "cast_size"):
        v = getattr(args, flag)
        if v is not None and v < (0 if flag == "warmup" else 1):
            p.error(f"--{flag.replace('_', '-')} must be >= {0 if flag == 'warmup' else 1}, got {v}")
    args.parser = p
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = common.resolve_device(args.parser, argparse.Namespace(device=args.device, threads=None))
    c = dataclasses.replace(CONFIGS["tiny" if args.tiny else args.model])
    if args.batch:
        c.batch = args.batch
    steps = args.steps or (6 if args.tiny else 30)
    warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 5)
    if warmup >= steps:
        args.parser.error(f"--warmup ({warmup}) must be < --steps ({steps})")
    env = common.environment(device)
    print(f"# e2e_fp8: {'tiny' if args.tiny else args.model} {c}, {steps} steps ({warmup} warm-up), on "
          f"{common.device_label(env)}")
    ao = torchao_status()
    print(f"# torchao.float8: {ao}")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        print("# warning: FP8 GEMMs need sm_89+ (Ada, Hopper); _scaled_mm will fail here")
    data = batches(c, device, steps, args.seed)
    rows = []
    for name in args.variant_list:
        if name == "torchao float8" and (ao != "importable" or device.type != "cuda"):
            rows.append({"variant": name, "status": "skipped: " + (ao if ao != "importable" else "needs CUDA")})
            continue
        try:
            rows.append(run_variant(name, c, device, data, warmup, args.seed, args.lr))
        except Exception as e:  # noqa: BLE001  (one failing variant must not hide the others' figures)
            rows.append({"variant": name, "status": f"failed: {type(e).__name__}: {e}"})
    ok = [r for r in rows if r["status"] == "ok"]
    print(common.format_table(ok, ["variant", "params_M", "step_ms", "tokens_per_s", "peak_GiB", "first_loss",
                                   "final_loss"]))
    for r in rows:
        if r["status"] != "ok":
            print(f"# {r['variant']}: {r['status']}")
    base = next((r for r in ok if r["variant"] == "O2 bf16"), None)
    for r in ok:
        if base is not None and r is not base:
            print(f"# {r['variant']}: {base['step_ms'] / r['step_ms']:.2f}x O2 bf16's tokens/s, final loss "
                  f"{r['final_loss'] - base['final_loss']:+.4f} against it")
    cast_rows = cast_microbenchmark(device, args.cast_size or (512 if args.tiny else 8192), 15 if not args.tiny else 3,
                                    3 if not args.tiny else 1)
    print(common.format_table(cast_rows, list(cast_rows[0])))
    if args.out:
        common.write_json(args.out, env, rows, cast=cast_rows, torchao=ao, config=dataclasses.asdict(c), steps=steps)
    if not all(math.isfinite(r["final_loss"]) for r in ok):
        raise SystemExit("a variant's loss is not finite")


if __name__ == "__main__":
    main()
