# Shared pieces of the mixprec.amp tests: a small model with BatchNorm, fresh random data, the
# optimizer configurations, and a training loop through amp.scale_loss with injected inf/NaN.
from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import random_tensor
from mixprec import amp
from mixprec.optimizers import FusedAdam

LEVELS = ("O0", "O1", "O2", "O3")


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """These models are tiny: ATen's thread pool only adds contention on a busy CI machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
OPT_KINDS = ("fused", "torch", "two")


def make_model(gen, device) -> torch.nn.Module:
    # No bias before the BatchNorm: its gradient is rounding noise, which Adam would amplify.
    model = torch.nn.Sequential(torch.nn.Linear(8, 32, bias=False), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(random_tensor(p.shape, torch.float32, "cpu", gen, scale=0.2))
    return model.to(device)


def make_batches(gen, device, steps: int, accum: int):
    return [[(random_tensor((16, 8), torch.float32, device, gen), random_tensor((16, 4), torch.float32, device, gen))
             for _ in range(accum)] for _ in range(steps)]


def make_optimizers(kind: str, model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    if kind == "fused":
        return [FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)]
    if kind == "torch":
        # eps representable in fp16, so that the pure-fp16 peer runs (O2/O3) stay finite.
        # capturable on GPUs, as amp's device-side skip turns it on (StepGuard.make_capturable):
        # its bias corrections round differently from the host-counted path, which a few steps
        # of Adam amplified to 3.5e-3 on one H200 seed, against O0's bound of 1e-5.
        on_gpu = next(model.parameters()).device.type == "cuda"
        return [torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3, capturable=on_gpu)]
    first = list(model[0].parameters()) + list(model[1].parameters())
    return [FusedAdam(first, lr=1e-2), torch.optim.SGD(model[3].parameters(), lr=0.05, momentum=0.9)]


def losses_of(out: torch.Tensor, y: torch.Tensor, n_losses: int) -> list[torch.Tensor]:
    out = out.float()
    return [torch.nn.functional.mse_loss(out, y), 0.1 * out.abs().mean()][:n_losses]


def poison(model: torch.nn.Module, layer: int, value: float) -> None:
    model[layer].weight.grad.view(-1)[3] = value


#: (step, micro-batch, loss id) -> (layer whose grad is poisoned, value); the steps to skip.
def injections(n_losses: int, accum: int) -> dict:
    return {(2, accum - 1, 0): (0, math.inf), (4, 0, n_losses - 1): (3, math.nan)}


def train_amp(model, optimizers, batches, n_losses: int, inject: dict, *, clip: float | None = None):
    """amp's training loop: one loss delays unscaling over micro-batches (Apex's accumulation
    recipe); several losses unscale each backward (the stash path). Returns the outputs."""
    accum = len(batches[0])
    outputs = []
    for step, micro in enumerate(batches):
        for opt in optimizers:
            opt.zero_grad()
        for mb, (x, y) in enumerate(micro):
            out = model(x)
            outputs.append(out.detach())
            losses = losses_of(out, y, n_losses)
            for lid, loss in enumerate(losses):
                delay = n_losses == 1 and mb < accum - 1
                with amp.scale_loss(loss, optimizers, loss_id=lid, delay_unscale=delay) as scaled:
                    scaled.backward(retain_graph=lid < n_losses - 1)
                    if (step, mb, lid) in inject:
                        poison(model, *inject[(step, mb, lid)])
        if clip is not None:
            for opt in optimizers:
                torch.nn.utils.clip_grad_norm_(amp.master_params(opt), clip)
        for opt in optimizers:
            opt.step()
    return outputs


def train_plain(model, optimizers, batches, n_losses: int, skip_steps: set, *, autocast=None, cast=None):
    """The plain-PyTorch loop the amp runs are measured against: grads accumulated over
    micro-batches and losses, steps skipped where amp's would overflow. ``cast`` casts inputs (a low-precision
    model); ``autocast`` runs the forward under torch.autocast."""
    for step, micro in enumerate(batches):
        for opt in optimizers:
            opt.zero_grad()
        for x, y in micro:
            x = x.to(cast) if cast is not None else x
            if autocast is not None:
                with torch.autocast(x.device.type, dtype=autocast):
                    out = model(x)
            else:
                out = model(x)
            losses = losses_of(out, y, n_losses)
            for i, loss in enumerate(losses):  # one backward per loss, as amp's loop does
                loss.backward(retain_graph=i < len(losses) - 1)
        if step not in skip_steps:
            for opt in optimizers:
                opt.step()


def train_o2_by_hand(model0, kind: str, dtype, batches, n_losses: int, skip_steps: set, loss_scale: float = 2.0**8):
    """O2 written out in plain PyTorch, the peer amp's O2 is judged against: a ``dtype`` model
    with BatchNorm kept fp32, fp32 master weights with fp32 optimizer state, the loss scaled by a
    constant, gradients copied to the masters and unscaled there, the masters copied back after
    each step. Gradients accumulate where amp's do: in the model's dtype over micro-batches of
    one loss (delay_unscale), in the fp32 masters after every backward of several losses.
    Returns the masters' module."""
    masters = fresh(model0)
    model = fresh(model0)
    for module in model:
        if not isinstance(module, torch.nn.BatchNorm1d):
            module.to(dtype)
    optimizers = make_optimizers(kind, masters)
    pairs = list(zip(model.parameters(), masters.parameters()))
    def unscale_into_masters():
        for p, m in pairs:
            g = p.grad.float() / loss_scale
            m.grad = g if m.grad is None else m.grad + g
            p.grad = None

    for step, micro in enumerate(batches):
        model.zero_grad(set_to_none=True)
        masters.zero_grad(set_to_none=True)
        for x, y in micro:
            losses = losses_of(model(x.to(dtype)), y, n_losses)
            for i, loss in enumerate(losses):
                (loss * loss_scale).backward(retain_graph=i < len(losses) - 1)
                if n_losses > 1:
                    unscale_into_masters()
        if n_losses == 1:
            unscale_into_masters()
        if step in skip_steps:
            continue
        for opt in optimizers:
            opt.step()
        with torch.no_grad():
            for p, m in pairs:
                p.copy_(m)
    return masters


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])


def fresh(model0: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model0)


# -- "a refused call changes nothing": everything amp, models and optimizers hold --------------------
def _tree(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.detach().cpu().clone())
    if isinstance(value, dict):
        return {k: _tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_tree(v) for v in value]
    return value


def amp_world(models=(), optimizers=()) -> dict:
    """A deep copy of every value a refused amp call must leave alone: amp's globals (options,
    each loss scaler's device values and settings), each model's params, grads and buffers
    (with dtypes), each optimizer's param groups, state and amp stash flags, and which methods
    are patched."""
    from mixprec.amp import _amp_state

    props = _amp_state.opt_properties
    world = {
        "options": None if props is None else dict(props.options),
        "verbosity": _amp_state.verbosity, "dtype": _amp_state.dtype, "handle": id(_amp_state.handle),
        "process_group": _amp_state.process_group, "deferred": len(_amp_state.deferred_updates),
        "scalers": [(id(s), s.dynamic, s.state.get_scale(), s.state.get_growth_tracker(),
                     s.state.get_hysteresis_tracker(), s.state.get_skipped(), s.state.hysteresis,
                     s.state.min_scale, s.state.max_scale) for s in _amp_state.loss_scalers],
        "models": [[(n, _tree(p), _tree(p.grad)) for n, p in m.named_parameters()]
                   + [(n, _tree(b)) for n, b in m.named_buffers()]
                   + [("forward patched", "forward" in m.__dict__)] for m in models],
        "optimizers": [],
    }
    for o in optimizers:
        stash = getattr(o, "_amp_stash", None)
        flags = None if stash is None else (stash.kind, stash.params_have_scaled_gradients, stash.poisoned,
                                            stash.unfinished is not None, _tree(stash.found))
        world["optimizers"].append((_tree(o.state_dict()), flags, "step" in o.__dict__,
                                    [_tree([(p, p.grad) for p in g["params"]]) for g in o.param_groups]))
    return world


def assert_same_world(before: dict, after: dict, path: str = "world") -> None:
    """Bitwise comparison of two amp_world() results (NaN equal to NaN), naming the first difference."""
    if isinstance(before, tuple) and before and before[0] == "tensor":
        assert isinstance(after, tuple) and after[:3] == before[:3], f"{path}: {after[:3]} != {before[:3]}"
        a, b = before[3], after[3]
        if a.is_floating_point():
            a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{path}: values changed"
        return
    if isinstance(before, dict):
        assert isinstance(after, dict) and before.keys() == after.keys(), f"{path}: keys differ"
        for k in before:
            assert_same_world(before[k], after[k], f"{path}[{k!r}]")
        return
    if isinstance(before, (list, tuple)):
        assert isinstance(after, (list, tuple)) and len(before) == len(after), f"{path}: length differs"
        for i, (x, y) in enumerate(zip(before, after)):
            assert_same_world(x, y, f"{path}[{i}]")
        return
    if isinstance(before, float) and math.isnan(before):
        assert isinstance(after, float) and math.isnan(after), f"{path}: {after!r} != nan"
        return
    assert before == after, f"{path}: {after!r} != {before!r}"
