# mixprec.amp's per-step shortcuts give the answers of the slower code they replace: the forward
# wrapper's first-parameter walk (module.parameters()'s order), scale_loss as a class-based context
# manager (grads restored when the block raises), and grad mode off only around the grad updates.
from __future__ import annotations

import pytest
import torch

from amp_support import make_model, make_optimizers, one_cpu_thread  # noqa: F401  (autouse fixture)
from mixprec import amp
from mixprec.amp._casts import _first_param


class Empty(torch.nn.Module):
    pass


class Reversed(torch.nn.Module):
    """Overrides parameters(): the walk must defer to it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def parameters(self, recurse=True):
        return iter(reversed(list(super().parameters(recurse))))


class OwnWalk(torch.nn.Module):
    """A child overriding named_modules (so its subtree's order is its own)."""

    def __init__(self):
        super().__init__()
        self.x, self.y = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield prefix, self
        yield prefix + ".y", self.y
        yield prefix + ".x", self.x


def structures():
    shared = torch.nn.Linear(3, 3)
    none_child = torch.nn.Sequential(torch.nn.ReLU())
    none_child.register_module("gap", None)
    none_child.add_module("lin", torch.nn.Linear(2, 2))
    none_param = torch.nn.Linear(2, 2)
    none_param.register_parameter("aaa", None)  # a None entry before the real ones
    own_and_children = torch.nn.Linear(2, 2)
    own_and_children.add_module("child", torch.nn.Linear(2, 2))
    nested = torch.nn.Sequential(torch.nn.Sequential(torch.nn.ReLU(), Empty()), torch.nn.Sequential(Empty()),
                                 torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2)))
    cycle = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2))
    cycle[0].add_module("back", cycle)  # a submodule that holds its parent
    return {
        "linear": torch.nn.Linear(2, 2),
        "sequential": make_model(torch.Generator().manual_seed(0), "cpu"),
        "shared": torch.nn.Sequential(torch.nn.Sequential(shared), shared, torch.nn.Linear(3, 3)),
        "none_child": none_child,
        "none_param": none_param,
        "own_and_children": own_and_children,
        "nested": nested,
        "cycle": cycle,
        "no_params": torch.nn.Sequential(torch.nn.ReLU(), Empty()),
        "overridden_parameters": Reversed(),
        "overridden_named_modules": torch.nn.Sequential(torch.nn.ReLU(), OwnWalk()),
    }


@pytest.mark.parametrize("name", list(structures()))
def test_first_param_is_that_of_module_parameters(name):
    module = structures()[name]
    assert _first_param(module) is next(iter(module.parameters()), None)


def test_first_param_defers_to_overrides():
    # The cases above would pass by luck if the override were ignored only where it agrees.
    assert _first_param(Reversed()) is not None
    m = Reversed()
    assert _first_param(m) is m.b.bias
    m = torch.nn.Sequential(torch.nn.ReLU(), OwnWalk())
    assert _first_param(m) is m[1].y.weight


def o0_scaled(gen, kind="torch"):
    # O0 with a static power-of-two scale: the scaled path runs and unscaling is exact.
    model = make_model(gen, "cpu")
    opt = make_optimizers(kind, model)[0]
    return amp.initialize(model, opt, opt_level="O0", loss_scale=128.0, verbosity=0)


def test_an_exception_in_the_block_restores_the_stashed_grads(gen):
    model, opt = o0_scaled(gen)
    x = torch.randn(8, 8, generator=gen)
    with amp.scale_loss(model(x).pow(2).mean(), opt) as scaled:
        scaled.backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(KeyError, match="in the block"):
        with amp.scale_loss(model(x).pow(2).mean(), opt):  # stashes the grads above
            assert all(p.grad is None for p in model.parameters())
            raise KeyError("in the block")
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    assert not opt._amp_stash.stashed
    # The next block accumulates onto them as usual.
    with amp.scale_loss(model(x).pow(2).mean(), opt) as scaled:
        scaled.backward()
    assert all(torch.allclose(p.grad, 2 * b) for p, b in zip(model.parameters(), before))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("kind", ["torch", "fused"])
def test_create_graph_grads_are_unscaled_outside_autograd(kind, gen):
    # A create_graph backward leaves grads that require grad. Unscaling them and adding the
    # stashed ones (a second block) must not be recorded by autograd, as under torch.no_grad;
    # grad mode is on again after the block.
    model, opt = o0_scaled(gen, kind)
    reference = make_model(torch.Generator().manual_seed(0), "cpu")
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 8, generator=gen)
    for _ in range(2):
        reference(x).pow(2).mean().backward()
    with amp.scale_loss(model(x).pow(2).mean(), opt) as scaled:
        scaled.backward(create_graph=True)
    assert torch.is_grad_enabled()
    made_by_backward = {p: type(p.grad.grad_fn) for p in model.parameters()}
    with amp.scale_loss(model(x).pow(2).mean(), opt) as scaled:
        scaled.backward(create_graph=True)
    assert torch.is_grad_enabled()
    for p, r in zip(model.parameters(), reference.parameters()):
        assert p.grad.requires_grad and type(p.grad.grad_fn) is made_by_backward[p]
        torch.testing.assert_close(p.grad.detach(), r.grad, rtol=0, atol=0)
    opt.step()
    assert torch.is_grad_enabled()
