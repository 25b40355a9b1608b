# FusedAdam(state_dtype=torch.int8) and the adam_ op's refusals of 8-bit moments: state, checkpoints
# (8-bit <-> fp32, weights_only), state_dtype changes, and a small GPT-2-shaped model trained both ways.
from __future__ import annotations

import io
import math

import pytest
import torch

import mixprec
from conftest import assert_bitwise_equal, assert_unchanged, random_tensor, scalar, snapshot
from mixprec.optimizers import FusedAdam
from test_adam_8bit import BLOCK, HYPER, adam8, ref_moments, ref_state, state_of

# ---- the op refuses bad 8-bit operands, naming the list and index, and changes nothing ---------------


def operands(device, gen):
    params = [random_tensor(s, torch.float32, device, gen) for s in [(5, 7), (BLOCK + 3,)]]
    grads = [random_tensor(p.shape, torch.float32, device, gen) for p in params]
    return params, grads, state_of(params, gen, device)


def _swap(lst, i, t):
    lst[i] = t


BAD = {
    "float_codes": (lambda s, p: _swap(s[0], 1, torch.zeros_like(p[1])), TypeError, "exp_avgs[1]", "expected int8 codes"),
    "signed_sq_codes": (lambda s, p: _swap(s[2], 0, s[2][0].to(torch.int8)), TypeError, "exp_avg_sqs[0]",
                        "expected uint8 codes"),
    "codes_shape": (lambda s, p: _swap(s[0], 1, torch.zeros(BLOCK + 4, dtype=torch.int8, device=p[1].device)),
                    ValueError, "exp_avgs[1]", "has shape"),
    "codes_layout": (lambda s, p: _swap(s[2], 0, torch.zeros(7, 5, dtype=torch.uint8, device=p[0].device).t()),
                     ValueError, "exp_avg_sqs[0]", "has strides"),
    "scales_size": (lambda s, p: _swap(s[1], 1, torch.zeros(1, device=p[1].device)), ValueError, "exp_avg_scales[1]",
                    "2 elements, one per 256"),
    "scales_dtype": (lambda s, p: _swap(s[3], 0, s[3][0].double()), TypeError, "exp_avg_sq_scales[0]",
                     "expected float32"),
    "scales_short": (lambda s, p: s[3].pop(), ValueError, "exp_avg_sq_scales", "has 1 tensors but params has 2"),
    "one_scale_list": (lambda s, p: s[3].clear(), ValueError, "exp_avg_sq_scales", "has 0 tensors"),
    "shared_scales": (lambda s, p: _swap(s[3], 1, s[1][1]), ValueError, "shares memory", "exp_avg"),
}


@pytest.mark.parametrize("case", BAD)
def test_op_refuses_bad_8bit_operands_and_changes_nothing(case, device, gen):
    params, grads, state = operands(device, gen)
    edit, exc, arg, words = BAD[case]
    edit(state, params)
    step_tensor = scalar(3.0, device)
    everything = params + grads + [t for lst in state for t in lst] + [step_tensor]
    before = snapshot(everything)
    for validate_only in (True, False):
        with pytest.raises(exc) as err:
            adam8(params, grads, state, **HYPER, step_tensor=step_tensor, validate_only=validate_only)
        msg = str(err.value)
        assert msg.startswith("mixprec::adam_: ") and arg in msg and words in msg, msg
        assert_unchanged(before, everything, f"refused {case}")


def test_op_refuses_amsgrad_with_8bit_moments(gen):
    params, grads, state = operands("cpu", gen)
    maxes = [torch.zeros_like(p) for p in params]
    before = snapshot(params + maxes + state[0])
    with pytest.raises(ValueError, match=r"mixprec::adam_: max_exp_avg_sqs must be empty with 8-bit moments"):
        adam8(params, grads, state, **HYPER, step=1, max_exp_avg_sqs=maxes)
    assert_unchanged(before, params + maxes + state[0])


# ---- FusedAdam(state_dtype=torch.int8) ----------------------------------------------------------------


def model_params(gen, device="cpu"):
    return [torch.nn.Parameter(random_tensor(s, torch.float32, device, gen)) for s in [(40, 9), (BLOCK + 1,), (3,)]]


def set_grads(params, gen):
    for p in params:
        p.grad = random_tensor(p.shape, p.dtype, p.device, gen)


def test_state_is_codes_and_scales(gen):
    params = model_params(gen)
    opt = FusedAdam(params, lr=1e-2, state_dtype=torch.int8, weight_decay=0.01)
    set_grads(params, gen)
    opt.step()
    for p in params:
        s = opt.state[p]
        assert s["exp_avg"].dtype == torch.int8 and s["exp_avg"].shape == p.shape
        assert s["exp_avg_sq"].dtype == torch.uint8 and s["exp_avg_sq"].shape == p.shape
        n = -(-p.numel() // BLOCK)
        assert s["exp_avg_scale"].shape == (n,) and s["exp_avg_sq_scale"].shape == (n,)
        assert bool((s["exp_avg_scale"] > 0).all())  # written: zeros would mean no step


def test_construction_refuses_amsgrad_and_unknown_state_dtypes(gen):
    with pytest.raises(ValueError, match=r"FusedAdam: .*invalid combination amsgrad=True, state_dtype=torch.int8"):
        FusedAdam(model_params(gen), amsgrad=True, state_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"invalid state_dtype torch.uint8; expected torch.float32, torch.bfloat16 "
                                         r"or torch.int8"):
        FusedAdam(model_params(gen), state_dtype=torch.uint8)


def test_setting_state_dtype_int8_refuses_amsgrad_groups_and_changes_nothing(gen):
    params = model_params(gen)
    opt = FusedAdam([dict(params=params[:1]), dict(params=params[1:], amsgrad=True)], lr=1e-2)
    set_grads(params, gen)
    opt.step()
    before = snapshot([t for s in opt.state.values() for t in s.values()])
    with pytest.raises(ValueError, match=r"FusedAdam: setting state_dtype: param group 1: invalid combination "
                                         r"amsgrad=True, state_dtype=torch.int8"):
        opt.state_dtype = torch.int8
    assert [g["state_dtype"] for g in opt.param_groups] == [torch.float32] * 2
    assert_unchanged(before, [t for s in opt.state.values() for t in s.values()])


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def trained(gen, state_dtype, steps=3):
    params = model_params(gen)
    opt = FusedAdam(params, lr=1e-2, state_dtype=state_dtype, weight_decay=0.01)
    for _ in range(steps):
        set_grads(params, gen)
        opt.step()
    return params, opt


def test_checkpoint_round_trip_continues_bit_for_bit(gen):
    params, opt = trained(gen, torch.int8)
    sd = roundtrip(opt.state_dict())
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = FusedAdam(twin, lr=1e-2, weight_decay=0.01)  # fp32: the checkpoint's state_dtype is restored
    opt2.load_state_dict(sd)
    assert opt2.state_dtype is torch.int8
    for p, q in zip(params, twin):
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
            assert_bitwise_equal(opt2.state[q][key], opt.state[p][key], key)
    for p, q in zip(params, twin):
        p.grad = random_tensor(p.shape, p.dtype, p.device, gen)
        q.grad = p.grad.clone()
    opt.step()
    opt2.step()
    for p, q in zip(params, twin):
        assert_bitwise_equal(q, p, "param after the reloaded step")
        assert_bitwise_equal(opt2.state[q]["exp_avg"], opt.state[p]["exp_avg"], "codes after the reloaded step")


def test_fp32_checkpoint_into_8bit_and_back(gen):
    # Policy (as for bfloat16): loading restores the checkpoint's state_dtype with its other
    # options; setting optimizer.state_dtype then converts the moments in place.
    params, opt = trained(gen, torch.float32)
    sd = roundtrip(opt.state_dict())
    opt8 = FusedAdam([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2, state_dtype=torch.int8)
    opt8.load_state_dict(sd)
    assert opt8.state_dtype is torch.float32
    opt8.state_dtype = torch.int8
    for p, q in zip(params, opt8.param_groups[0]["params"]):
        want = ref_state(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
        for key, w in zip(("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"), want):
            assert_bitwise_equal(opt8.state[q][key], w, f"quantized {key}")
    # ... and back: the dequantized moments are the reference's decoding of those codes.
    sd8 = roundtrip(opt8.state_dict())
    opt32 = FusedAdam(opt8.param_groups[0]["params"], lr=1e-2)
    opt32.load_state_dict(sd8)
    opt32.state_dtype = torch.float32
    for q in opt32.param_groups[0]["params"]:
        s8 = opt8.state[q]
        m, v = ref_moments(s8["exp_avg"], s8["exp_avg_scale"], s8["exp_avg_sq"], s8["exp_avg_sq_scale"])
        assert_bitwise_equal(opt32.state[q]["exp_avg"], m, "dequantized exp_avg")
        assert_bitwise_equal(opt32.state[q]["exp_avg_sq"], v, "dequantized exp_avg_sq")
        assert "exp_avg_scale" not in opt32.state[q]


CORRUPT = {
    "code_range": (lambda s: s["exp_avg"].view(-1).__setitem__(0, -121), "codes outside [-120, 120]"),
    "sq_code_range": (lambda s: s["exp_avg_sq"].view(-1).__setitem__(0, 241), "codes above 240"),
    "negative_scale": (lambda s: s["exp_avg_scale"].__setitem__(0, -1.0), "negative, inf or NaN scales"),
    "nan_scale": (lambda s: s["exp_avg_sq_scale"].__setitem__(0, math.nan), "negative, inf or NaN scales"),
    "scale_size": (lambda s: s.__setitem__("exp_avg_scale", torch.zeros(5)), "expected (2,)"),
    "missing_scale": (lambda s: s.pop("exp_avg_sq_scale"), "lacks ['exp_avg_sq_scale']"),
    "codes_dtype": (lambda s: s.__setitem__("exp_avg_sq", s["exp_avg_sq"].to(torch.int8)), "expected a torch.uint8"),
}


@pytest.mark.parametrize("case", CORRUPT)
def test_corrupt_8bit_checkpoint_is_refused_and_changes_nothing(case, gen):
    params, opt = trained(gen, torch.int8)
    sd = roundtrip(opt.state_dict())
    edit, words = CORRUPT[case]
    edit(sd["state"][1])
    tensors = list(params) + [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    before, groups = snapshot(tensors), [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match=r"FusedAdam.load_state_dict: state\[1\]") as err:
        opt.load_state_dict(sd)
    assert words in str(err.value), str(err.value)
    assert_unchanged(before, tensors, f"refused {case}")
    assert [dict(g) for g in opt.param_groups] == groups


# ---- a small GPT-2-shaped model, fp32 moments against 8-bit -----------------------------------------


class TinyGPT(torch.nn.Module):
    """GPT-2's block structure (pre-LayerNorm, causal attention, GELU MLP, tied embeddings), small."""

    def __init__(self, vocab=96, width=64, layers=2, heads=4, seq=32):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, width), torch.nn.Embedding(seq, width)
        layer = lambda: torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                                         batch_first=True, norm_first=True)
        self.blocks = torch.nn.ModuleList(layer() for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        for emb in (self.tok, self.pos):
            torch.nn.init.normal_(emb.weight, std=0.02)  # GPT-2's init: the first loss is about ln(vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        for b in self.blocks:
            x = b(x, src_mask=mask, is_causal=True)
        return self.norm(x) @ self.tok.weight.t()


def train(state_dtype, steps=100):
    torch.manual_seed(0)
    model = TinyGPT()
    opt = FusedAdam(model.parameters(), lr=3e-3, weight_decay=0.01, state_dtype=state_dtype)
    data = torch.Generator().manual_seed(1)
    # A learnable stream: each token is a fixed function of the one before, except 10% at random.
    table = torch.randint(0, 96, (96,), generator=data)
    losses = []
    for _ in range(steps):
        seq = torch.randint(0, 96, (16, 33), generator=data)
        for t in range(1, 33):
            keep = torch.rand(16, generator=data) > 0.1
            seq[:, t] = torch.where(keep, table[seq[:, t - 1]], seq[:, t])
        logits = model(seq[:, :32])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 96), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_tiny_gpt_trains_with_8bit_moments_as_with_fp32():
    fp32, q8 = train(torch.float32), train(torch.int8)
    assert fp32[-1] < 0.5 * fp32[0] and q8[-1] < 0.5 * q8[0]  # both learn (from ln(96) = 4.56 to ~0.83)
    late32, late8 = sum(fp32[-10:]) / 10, sum(q8[-10:]) / 10
    # Issue 24's bar is 0.5% on GPT-2 small after 300 steps. Here the two runs differ by 0.07%
    # (measured; both deterministic on the CPU); 1% leaves room for other torch builds' model
    # numerics, while a broken code map (a zeroed or mis-scaled sqrt(v) or m) moves the loss by
    # far more than that.
    assert abs(late8 - late32) <= 0.01 * late32, (late32, late8)
