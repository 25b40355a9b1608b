"""The models of real_models.py (and of tests/python/test_real_models.py): Hugging Face GPT-2 and a
Llama-style decoder, timm ResNet-50 (channels_last) and ViT-B/16, random-initialized from configs,
in full and tiny sizes, with learnable synthetic data made in code from a seed and their losses."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from typing import Callable

import torch
import torch.nn.functional as F

INSTALL_HINT = "pip install 'mixprec[bench]'  (or: pip install transformers timm)"


def import_torchvision() -> None:
    """Imports torchvision even where its compiled ops cannot load. PyPI's x86-64 torchvision is
    built against CUDA torch; beside a CPU-only torch (CI's) its _C fails to load, and torchvision
    0.28's unconditional fake-kernel registrations for torchvision::nms then make `import torchvision`
    raise. timm imports torchvision at import time (and transformers does when it is installed),
    though the models here use none of its ops: skip just those registrations and import again."""
    try:
        importlib.import_module("torchvision")
        return
    except ModuleNotFoundError:
        return  # not installed: timm's own import says so
    except RuntimeError as err:
        if "torchvision::" not in str(err):
            raise
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]  # the half-imported package
    real = torch.library.register_fake

    def register_fake_unless_torchvision(op, *args, **kwargs):
        if isinstance(op, str) and op.startswith("torchvision::"):
            return args[0] if args and callable(args[0]) else (lambda fn: fn)
        return real(op, *args, **kwargs)

    torch.library.register_fake = register_fake_unless_torchvision
    try:
        importlib.import_module("torchvision")
    finally:
        torch.library.register_fake = real


def import_libraries() -> dict[str, str]:
    """Imports transformers and timm; returns {library: why it is unavailable} for those that are
    not (empty when both import)."""
    missing = {}
    try:
        import_torchvision()
    except Exception as err:  # noqa: BLE001 - reported per library below
        missing["torchvision"] = f"{type(err).__name__}: {err}"
    for lib in ("transformers", "timm"):
        try:
            importlib.import_module(lib)
        except Exception as err:  # noqa: BLE001 - an absent or broken install is reported, not raised
            missing[lib] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    missing.pop("torchvision", None)  # only matters through timm / transformers, whose errors say so
    return missing


# ---- the models -------------------------------------------------------------------------------


def _gpt2(tiny: bool, seq_len: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    if tiny:
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=max(64, seq_len),
                         bos_token_id=0, eos_token_id=0)
    else:  # GPT-2 small: 124 M parameters, the LM head tied to the token embedding
        cfg = GPT2Config(n_positions=max(1024, seq_len))
    return GPT2LMHeadModel(cfg)


def _llama(tiny: bool, seq_len: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=512, max_position_embeddings=max(64, seq_len),
                          bos_token_id=0, eos_token_id=0)
    else:  # 0.67 B parameters: 12 layers of width 2048, 16 query heads over 4 key/value heads
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, num_attention_heads=16,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=max(2048, seq_len))
    return LlamaForCausalLM(cfg)


def _resnet50(tiny: bool, seq_len: int) -> torch.nn.Module:
    import timm

    kwargs = dict(num_classes=1000)
    if tiny:  # ResNet-50's bottleneck blocks and BatchNorms, one block per stage, narrow
        narrow = ({"channels": (8, 16, 32, 64)} if "channels" in inspect.signature(timm.models.resnet.ResNet).parameters
                  else {"base_width": 16})  # timm releases before ResNet(channels=...)
        kwargs = dict(layers=(1, 1, 1, 1), stem_width=8, num_classes=10, **narrow)
    return timm.create_model("resnet50", pretrained=False, **kwargs).to(memory_format=torch.channels_last)


def _vit(tiny: bool, seq_len: int) -> torch.nn.Module:
    import timm

    kwargs = (dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10) if tiny
              else dict(num_classes=1000))
    return timm.create_model("vit_base_patch16_224", pretrained=False, **kwargs)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    library: str  # transformers or timm
    kind: str  # "lm": batches of token ids; "image": batches of images and class labels
    about: str
    build: Callable[[bool, int], torch.nn.Module]
    dtypes: tuple[str, ...]  # the low dtypes the benchmark runs it in by default
    classes: tuple[int, int]  # (full, tiny) vocabulary size of an LM, number of classes of an image model
    channels_last: bool = False

    def unit(self) -> str:
        return "tok/s" if self.kind == "lm" else "img/s"

    def num_classes(self, tiny: bool) -> int:
        return self.classes[1] if tiny else self.classes[0]


MODELS = {m.name: m for m in (
    ModelSpec("gpt2", "transformers", "lm", "transformers GPT2LMHeadModel, 124 M (tied LM head)", _gpt2,
              ("fp16", "bf16"), (50257, 512)),
    ModelSpec("llama", "transformers", "lm", "transformers LlamaForCausalLM, 0.67 B (RMSNorm, GQA 16/4, RoPE)",
              _llama, ("bf16",), (32000, 512)),
    ModelSpec("resnet50", "timm", "image", "timm resnet50, channels_last", _resnet50, ("fp16", "bf16"),
              (1000, 10), channels_last=True),
    ModelSpec("vit", "timm", "image", "timm vit_base_patch16_224 (ViT-B/16)", _vit, ("fp16", "bf16"), (1000, 10)),
)}


def build(spec: ModelSpec, tiny: bool, seq_len: int, seed: int, device: torch.device) -> torch.nn.Module:
    """The model with weights drawn from ``seed`` (so every variant starts from the same ones),
    initialized on ``device`` itself (0.67 B parameters take a while on a host's cores)."""
    torch.manual_seed(seed)
    with device:
        model = spec.build(tiny, seq_len)
    return model.to(device).train()


def image_size(tiny: bool) -> int:
    return 32 if tiny else 224


# ---- data: learnable, so that a loss that falls tells training from noise ----------------------


class Batches:
    """``count`` batches made once from ``seed`` on ``device``. Token streams use 1/16 of the
    vocabulary and follow a fixed random successor table with 10% noise: within a few steps a model
    learns which tokens occur (the loss leaves log(vocab)), then the table. Images are a fixed
    pattern per class in noise. The same seed gives the same batches on every variant."""

    def __init__(self, spec: ModelSpec, tiny: bool, batch_size: int, seq_len: int, count: int, seed: int,
                 device: torch.device):
        g = torch.Generator().manual_seed(seed)
        self.items: list[tuple[torch.Tensor, torch.Tensor]] = []
        if spec.kind == "lm":
            vocab = spec.num_classes(tiny)
            used = torch.randperm(vocab, generator=g)[: max(2, vocab // 16)]
            successor = used[torch.randperm(len(used), generator=g)]
            position = torch.full((vocab,), -1, dtype=torch.long)
            position[used] = torch.arange(len(used))
            for _ in range(count):
                ids = torch.empty(batch_size, seq_len, dtype=torch.long)
                ids[:, 0] = used[torch.randint(len(used), (batch_size,), generator=g)]
                noise = torch.rand(batch_size, seq_len, generator=g) < 0.1
                random_ids = used[torch.randint(len(used), (batch_size, seq_len), generator=g)]
                for t in range(1, seq_len):
                    ids[:, t] = torch.where(noise[:, t], random_ids[:, t], successor[position[ids[:, t - 1]]])
                ids = ids.to(device)
                self.items.append((ids, ids))  # loss_of shifts the targets
        else:
            classes, size = spec.num_classes(tiny), image_size(tiny)
            patterns = torch.randn(classes, 3, size, size, generator=g)
            for _ in range(count):
                y = torch.randint(classes, (batch_size,), generator=g)
                x = patterns[y] + torch.randn(batch_size, 3, size, size, generator=g)
                if spec.channels_last:
                    x = x.contiguous(memory_format=torch.channels_last)
                self.items.append((x.to(device), y.to(device)))
        self.batch_size = batch_size
        self.per_batch = batch_size * (seq_len if spec.kind == "lm" else 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.items[i % len(self.items)]

    def __len__(self) -> int:
        return len(self.items)


def loss_of(spec: ModelSpec, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training loss as a training loop writes it: cross-entropy on the logits taken to fp32
    (next-token targets for an LM). Not transformers' ``labels=``: its loss upcasts the logits
    inside the forward, and O2's cast of the outputs to fp32 (Apex's) would then make a second fp32
    copy of them, 1.6 GB at GPT-2's batch 8 x 1024, at the forward's peak. Here O2's output is
    the fp32 copy the loss needs, as torch.amp's ``.float()`` is."""
    if spec.kind == "lm":
        logits = model(input_ids=x).logits
        ignore = torch.full_like(y[:, :1], -100)
        targets = torch.cat([y[:, 1:], ignore], dim=1)  # shift the targets, not the (large) logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return F.cross_entropy(model(x).float(), y)
