# amp.initialize's layer kernels: O2/O3 turn plain nn.Linear and nn.LayerNorm into subclasses that
# run on mixprec.linear / mixprec.layer_norm (and leave subclasses, O0/O1 and layer_kernels=False
# alone); a model trained that way tracks one trained on torch's layers; state dicts, deep copies
# and pickles are unchanged; torch.compile traces through them; bad values of the keyword are
# refused.
from __future__ import annotations

import copy
import io

import pytest
import torch

from mixprec import amp
from mixprec.amp import _layers
from mixprec.optimizers import FusedAdam
from conftest import DEVICES, rel_err


class Tagged(torch.nn.Linear):
    """A Linear subclass with a forward of its own: must not be swapped."""

    def forward(self, x):
        return super().forward(x) * 2


def make(seed: int, device="cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.GELU(),
                               Tagged(64, 64), torch.nn.LayerNorm(64, elementwise_affine=False),
                               torch.nn.Linear(64, 8, bias=False)).to(device)


@pytest.mark.parametrize("opt_level", ["O2", "O3"])
def test_cast_levels_swap_plain_linear_and_layer_norm(opt_level):
    model = amp.initialize(make(0), opt_level=opt_level, dtype=torch.bfloat16, verbosity=0)
    kinds = [type(m) for m in model]
    assert kinds[0] is _layers.Linear and kinds[1] is _layers.LayerNorm and kinds[4] is _layers.LayerNorm
    assert kinds[5] is _layers.Linear and kinds[3] is Tagged  # the subclass keeps its own forward
    assert all(isinstance(m, torch.nn.Linear) for m in (model[0], model[3], model[5]))


@pytest.mark.parametrize("opt_level,kwargs", [("O0", {}), ("O1", {}), ("O2", {"layer_kernels": False})])
def test_other_levels_and_the_opt_out_keep_torchs_layers(opt_level, kwargs):
    model = amp.initialize(make(0), opt_level=opt_level, dtype=torch.bfloat16, verbosity=0, **kwargs)
    assert [type(m) for m in model][:2] == [torch.nn.Linear, torch.nn.LayerNorm]


def test_bad_layer_kernels_values_are_refused():
    with pytest.raises(ValueError, match="layer_kernels=True needs a model cast"):
        amp.initialize(make(0), opt_level="O1", verbosity=0, layer_kernels=True)
    with pytest.raises(TypeError, match="layer_kernels must be True, False or None"):
        amp.initialize(make(0), opt_level="O2", verbosity=0, layer_kernels="yes")


def train(layer_kernels: bool, device: str, steps: int = 6) -> tuple[list[float], torch.nn.Module]:
    model = make(1, device)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", dtype=torch.bfloat16, verbosity=0,
                                layer_kernels=layer_kernels)
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=gen).to(device)
        y = torch.randn(32, 8, generator=gen).to(device)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model


@pytest.mark.parametrize("device", DEVICES)
def test_training_tracks_torchs_layers(device):
    ours, model = train(True, device)
    theirs, peer = train(False, device)
    assert type(model[1]) is _layers.LayerNorm and type(peer[1]) is torch.nn.LayerNorm
    # The same math rounded differently (fp32 sums in another order): bf16-level agreement.
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(ours, theirs)), (ours, theirs)
    assert ours[-1] < ours[0]
    for (name, p), q in zip(model.named_parameters(), peer.parameters()):
        assert rel_err(p, q) < 5e-2, name


def test_state_dict_copy_and_pickle_are_unchanged():
    _, model = train(True, "cpu", steps=1)
    _, peer = train(False, "cpu", steps=1)
    assert list(model.state_dict()) == list(peer.state_dict())
    peer.load_state_dict(model.state_dict())  # across the two, both ways
    model.load_state_dict(peer.state_dict())
    clone = copy.deepcopy(model)
    assert type(clone[0]) is _layers.Linear
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(4, 16).bfloat16()
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_runs_the_layer_kernels(backend):
    # The ops have fake (Meta) kernels and a C++ autograd node: AOTAutograd traces through them.
    torch._dynamo.reset()
    model = amp.initialize(make(0), opt_level="O2", dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(8, 16)
    eager = model(x)
    compiled = torch.compile(model, backend=backend)(x)
    assert torch.equal(compiled, eager)
    compiled.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
