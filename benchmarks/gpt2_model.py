"""The GPT-2-style decoder and the synthetic language of the end-to-end benchmark (e2e_gpt2.py):
token and learned position embeddings, pre-LayerNorm blocks, causal SDPA, a 4x GELU MLP, the LM
head tied to the token embedding, and token streams generated in code from a fixed seed."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_embd: int
    n_head: int
    batch: int
    seq: int = 1024
    vocab: int = 50304  # GPT-2's 50257 padded to a multiple of 64, as the peer figures used

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq


#: The sizes of issue 7 (heads of 64 as GPT-2), and "tiny" for CPU smoke runs.
SIZES = {
    "small": GPTConfig(n_layer=12, n_embd=768, n_head=12, batch=16),
    "large": GPTConfig(n_layer=36, n_embd=1280, n_head=20, batch=4),
    "tiny": GPTConfig(n_layer=2, n_embd=64, n_head=4, batch=4, seq=64, vocab=512),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        # Flash attention in fp16/bf16; the memory-efficient kernel in fp32.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """forward(idx, targets) returns the mean cross-entropy (a scalar), so an amp wrapper that casts
    the model's outputs casts one number, not the (batch, seq, vocab) logits."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2: one parameter (one master under O2)
        #: mixprec.cross_entropy instead of F.cross_entropy(logits.float()): the same fp32 softmax
        #: math read straight from fp16/bf16 logits, without their fp32 copy (set by the variant).
        self.fused_loss = False

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x)).view(-1, self.cfg.vocab)
        if self.fused_loss:
            import mixprec

            return mixprec.cross_entropy(logits, targets.view(-1))
        # The softmax in fp32 for every variant: what autocast does for cross_entropy, made explicit
        # so O2 (a half model, no autocast) computes the same loss the same way.
        return F.cross_entropy(logits.float(), targets.view(-1))


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """GPT-2's initialization from `seed`: N(0, 0.02) for Linear and Embedding weights, residual
    projections scaled by 1/sqrt(2 n_layer), zero biases, unit LayerNorms. Drawn on the params'
    device, so every variant built on the same device from the same seed starts identical."""
    torch.manual_seed(seed)
    std_proj = 0.02 / math.sqrt(2 * model.cfg.n_layer)
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            if id(module.weight) in seen:  # the tied LM head
                continue
            seen.add(id(module.weight))
            module.weight.normal_(0.0, std_proj if name.endswith("c_proj") else 0.02)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()


def build_model(cfg: GPTConfig, device: torch.device, seed: int) -> GPT:
    with torch.device(device):  # allocate on the device directly: no 3 GB host copy for "large"
        model = GPT(cfg)
    init_weights(model, seed)
    return model


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay for matrices and embeddings, none for biases and LayerNorms (GPT-2 practice)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def weight_checksum(model: nn.Module) -> float:
    """The float64 sum of every parameter: equal across variants iff they start from equal weights,
    and across ranks iff they hold equal weights (an FSDP2 DTensor is summed whole: gathering it
    is a collective every rank takes part in)."""
    with torch.no_grad():
        return float(sum(torch.sum(p.full_tensor() if hasattr(p, "full_tensor") else p, dtype=torch.float64)
                         for p in model.parameters()))


class SyntheticLanguage:
    """Token streams from a fixed random Markov chain: each token has `branching` successors,
    drawn once from a Zipf law over the vocabulary, and the next token is one of them uniformly.

    A model first learns the skewed unigram law (the loss falls from ln(vocab) within tens of
    steps) and then the transitions (towards ln(branching)), so the loss after N steps measures
    training rather than noise, and every variant sees the same batches in the same order.
    """

    def __init__(self, vocab: int, seed: int, branching: int = 4, zipf_s: float = 1.1):
        self.gen = torch.Generator().manual_seed(seed)
        ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
        weights = ranks.pow(-zipf_s)[torch.randperm(vocab, generator=self.gen)]  # frequent ids scattered
        self.unigram = weights / weights.sum()
        self.successors = torch.multinomial(self.unigram, vocab * branching, replacement=True,
                                            generator=self.gen).view(vocab, branching)
        self.branching = branching

    def sample(self, n_seq: int, length: int) -> torch.Tensor:
        """(n_seq, length) int64 tokens on the CPU, deterministic given the seed and call order."""
        out = torch.empty(n_seq, length, dtype=torch.int64)
        out[:, 0] = torch.multinomial(self.unigram, n_seq, replacement=True, generator=self.gen)
        choice = torch.randint(0, self.branching, (n_seq, length), generator=self.gen)
        for i in range(1, length):  # vectorized over sequences; one pass over positions
            out[:, i] = self.successors[out[:, i - 1], choice[:, i]]
        return out


class Batches:
    """`n_train` training batches and one held-out batch, generated once on the CPU and moved to
    the device as contiguous inputs and targets, so the timed loop does no data work."""

    def __init__(self, cfg: GPTConfig, n_train: int, device: torch.device, seed: int):
        lang = SyntheticLanguage(cfg.vocab, seed)
        tokens = lang.sample((n_train + 1) * cfg.batch, cfg.seq + 1)
        self.x = tokens[:, :-1].contiguous().to(device)
        self.y = tokens[:, 1:].contiguous().to(device)
        self.batch, self.n_train = cfg.batch, n_train

    def train(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = (step % self.n_train) * self.batch
        return self.x[i:i + self.batch], self.y[i:i + self.batch]

    def held_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.n_train * self.batch
        return self.x[i:], self.y[i:]
