"""The task `mixprec compare` runs with no --task: a small transformer classifier on token
sequences generated deterministically in code (nothing is downloaded), sized to train every
default mode in about a minute on a 2-core CPU.

The label of a sequence is a token group (token id mod 4) that was over-represented when the
sequence was drawn, so the model must count group members across the sequence. In fp32 it
reaches about 96% validation accuracy in 3 epochs (counting exactly gives 99%), so accuracy lost
to low precision shows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..optimizers import FusedAdam
from .task import Task

VOCAB, SEQ, CLASSES = 32, 32, 4
WIDTH, HEADS, DEPTH = 64, 4, 2
TRAIN_SIZE, VAL_SIZE, BATCH = 2048, 512, 64
BIAS = 0.35
DATA_SEED = 1234  # the data never changes between runs or modes


class Block(nn.Module):
    """Pre-LayerNorm transformer block (attention through scaled_dot_product_attention, GELU MLP)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = VOCAB, seq: int = SEQ, classes: int = CLASSES, width: int = WIDTH,
                 heads: int = HEADS, depth: int = DEPTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq, width) / math.sqrt(width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).mean(dim=1))


def make_data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.randint(0, CLASSES, (n,), generator=generator)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
    # About 1 token in 3 is redrawn from the label's group (token % CLASSES == label): that group
    # then holds about three times as many tokens as any other, with enough noise to need counting.
    biased = torch.rand(n, SEQ, generator=generator) < BIAS
    in_group = labels[:, None] + CLASSES * torch.randint(0, VOCAB // CLASSES, (n, SEQ), generator=generator)
    return torch.where(biased, in_group, tokens), labels


class Batches:
    """Mini-batches of fixed tensors, reshuffled each epoch from torch's global generator (the
    compare seeds it per mode, so every mode sees the same order)."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, batch: int, shuffle: bool) -> None:
        self.inputs, self.targets, self.batch, self.shuffle = inputs, targets, batch, shuffle

    def __len__(self) -> int:
        return math.ceil(len(self.inputs) / self.batch)

    def __iter__(self):
        order = torch.randperm(len(self.inputs)) if self.shuffle else torch.arange(len(self.inputs))
        for i in range(0, len(order), self.batch):
            idx = order[i:i + self.batch].to(self.inputs.device)
            yield self.inputs[idx], self.targets[idx]


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (logits.argmax(dim=-1) == targets).float().mean()


def make_task(device: torch.device) -> Task:
    """The embedded task on ``device`` (its weights from torch's global generator)."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    x_train, y_train = make_data(TRAIN_SIZE, gen)
    x_val, y_val = make_data(VAL_SIZE, gen)
    model = TinyTransformer().to(device)
    # mixprec's fused AdamW: under O2 it keeps the fp32 masters and writes the low copy in its kernel.
    optimizer = FusedAdam(model.parameters(), lr=3e-3, weight_decay=0.01)
    return Task(
        model=model,
        optimizer=optimizer,
        loss_fn=F.cross_entropy,
        train_loader=Batches(x_train.to(device), y_train.to(device), BATCH, shuffle=True),
        val_loader=Batches(x_val.to(device), y_val.to(device), 256, shuffle=False),
        metric_fn=accuracy,
        metric_name="accuracy",
        higher_is_better=True,
        name="embedded: tiny transformer, token-group counting",
    )
