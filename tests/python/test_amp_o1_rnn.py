# amp.init's O1 rules for RNNs (Apex's test_rnn): nn.RNN/LSTM/GRU, packed sequences and the cells run
# in low precision through the patched torch._VF functions, with gradients reaching fp32 weights.
from __future__ import annotations

import copy

import pytest
import torch

from amp_o1_support import low, make_handle  # noqa: F401 (fixtures)
from conftest import peer_bound, random_tensor, rel_err

CONFIGS = [(1, False), (2, False), (2, True)]  # (layers, bidirectional), as Apex's tests


def _make(kind: str, layers: int, bidir: bool, device):
    if kind == "rnn_relu":
        return torch.nn.RNN(8, 6, num_layers=layers, nonlinearity="relu", bidirectional=bidir).to(device)
    cls = {"rnn_tanh": torch.nn.RNN, "lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind]
    return cls(8, 6, num_layers=layers, bidirectional=bidir).to(device)


def _run(module, x, hidden, packed_lengths=None):
    if packed_lengths is not None:
        x = torch.nn.utils.rnn.pack_padded_sequence(x, packed_lengths)
    out, _ = module(x, hidden)
    return out.data if packed_lengths is not None else out


def _check(handle, module, x, hidden, low, msg, packed_lengths=None):
    """Output in ``low``; output and weight gradients within 2x plain torch's error in ``low``
    (the module converted) against a float64 copy; input gradient in the input's dtype."""
    x = x.detach().requires_grad_()
    out = _run(module, x, hidden, packed_lengths)
    assert out.dtype == low, f"{msg}: output {out.dtype}"
    out.float().sum().backward()
    assert x.grad.dtype == x.dtype, f"{msg}: input grad {x.grad.dtype}"
    with handle._disable_casts():
        results = {}
        for dt in (torch.float64, low):
            m = copy.deepcopy(module).to(dt)
            m.zero_grad()
            h = tuple(t.to(dt) for t in hidden) if isinstance(hidden, tuple) else hidden.to(dt)
            o = _run(m, x.detach().to(dt), h, packed_lengths)
            o.float().sum().backward()
            results[dt] = (o, [p.grad for p in m.parameters()])
    (ref, ref_grads), (peer, peer_grads) = results[torch.float64], results[low]
    assert rel_err(out, ref) < peer_bound(low, peer, ref), f"{msg}: output"
    for i, p in enumerate(module.parameters()):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, f"{msg}: weight {i}"
        bound = peer_bound(low, peer_grads[i], ref_grads[i])
        assert rel_err(p.grad, ref_grads[i]) < bound, f"{msg}: weight {i} grad"


@pytest.mark.parametrize("kind", ["rnn_tanh", "rnn_relu", "lstm", "gru"])
def test_rnn_runs_in_low_precision(kind, low, device, gen, make_handle):
    handle = make_handle(dtype=low)
    torch.manual_seed(gen.initial_seed())
    for layers, bidir in CONFIGS:
        module = _make(kind, layers, bidir, device)
        for typ in (torch.float32, low):
            x = random_tensor((5, 3, 8), typ, device, gen, scale=0.5)
            shape = (layers * (2 if bidir else 1), 3, 6)
            h = random_tensor(shape, typ, device, gen, scale=0.5)
            hidden = (h, random_tensor(shape, typ, device, gen, scale=0.5)) if kind == "lstm" else h
            module.zero_grad()
            _check(handle, module, x, hidden, low, f"{kind} layers={layers} bidir={bidir} {typ}")


@pytest.mark.parametrize("kind", ["rnn_tanh", "lstm", "gru"])
def test_packed_sequence_runs_in_low_precision(kind, device, gen, make_handle):
    handle = make_handle()
    torch.manual_seed(gen.initial_seed())
    module = _make(kind, 2, False, device)
    lengths = torch.tensor(sorted(torch.randint(3, 7, (4,), generator=gen).tolist(), reverse=True))
    lengths[0] = 6
    for typ in (torch.float32, torch.float16):
        x = random_tensor((6, 4, 8), typ, device, gen, scale=0.5)
        h = random_tensor((2, 4, 6), typ, device, gen, scale=0.5)
        hidden = (h, h.clone()) if kind == "lstm" else h
        module.zero_grad()
        _check(handle, module, x, hidden, torch.float16, f"packed {kind} {typ}", packed_lengths=lengths)


@pytest.mark.parametrize("cls", [torch.nn.RNNCell, torch.nn.GRUCell, torch.nn.LSTMCell])
def test_cells_run_in_low_precision(cls, low, device, gen, make_handle):
    # Apex's run_cell_test: several steps, the state fed back (fp32 input with a low state after
    # the first step); every output in low precision, gradients in each input's dtype.
    handle = make_handle(dtype=low)
    torch.manual_seed(gen.initial_seed())
    cell = cls(8, 8).to(device)
    for typ in (torch.float32, low):
        xs = [random_tensor((3, 8), typ, device, gen, scale=0.5).requires_grad_() for _ in range(4)]
        hidden = random_tensor((3, 8), typ, device, gen, scale=0.5)
        hidden = (hidden, hidden.clone()) if cls is torch.nn.LSTMCell else hidden
        outs = []
        for x in xs:
            hidden = cell(x, hidden)
            outs.append(hidden[0] if isinstance(hidden, tuple) else hidden)
        assert all(o.dtype == low for o in outs)
        cell.zero_grad()
        outs[-1].float().sum().backward()
        assert all(x.grad.dtype == typ for x in xs)
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in cell.parameters())
        with handle._disable_casts():  # one step against float64
            ref_cell = copy.deepcopy(cell).double()
            x0, h0 = xs[0].detach(), random_tensor((3, 8), torch.float32, device, gen, scale=0.5)
            h0 = (h0, h0.clone()) if cls is torch.nn.LSTMCell else h0
            as_ = (lambda h, dt: tuple(t.to(dt) for t in h) if isinstance(h, tuple) else h.to(dt))
            ref = ref_cell(x0.double(), as_(h0, torch.float64))
            peer = copy.deepcopy(cell).to(low)(x0.to(low), as_(h0, low))
        out = cell(x0, h0)
        first = (lambda r: r[0] if isinstance(r, tuple) else r)
        assert rel_err(first(out), first(ref)) < peer_bound(low, first(peer), first(ref))


def test_rnn_with_casts_off_refuses_mixed_dtypes_as_torch_does(device, make_handle):
    handle = make_handle()
    module = torch.nn.GRU(8, 6).to(device)
    with handle._disable_casts(), pytest.raises(ValueError, match="does not match weight dtype"):
        module(torch.randn(5, 2, 8, device=device).half())
