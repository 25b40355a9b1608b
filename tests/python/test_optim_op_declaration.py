# The fused optimizer ops as made from their one declaration (csrc/include/mixprec/optim_args.h):
# the generated schemas and their validate-only twins (<op>_check, mixprec.ops' validate_only=).
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import assert_unchanged, snapshot
from test_misuse_optimizer_ops import OPS, alias_cases, call, everything, operands

ARGS_H = Path(__file__).resolve().parents[2] / "csrc" / "include" / "mixprec" / "optim_args.h"

# The arguments Python callers rely on, in order: (name, type, written, optional). Shared pieces:
STEP_HEAD = [("step_tensor", "Tensor?", True, True), ("lr", "float", False, False)]
STEP_TAIL = [("step", "int", False, False), ("lr_tensor", "Tensor?", False, True),
             ("grad_scale", "Tensor?", False, True), ("found_inf", "Tensor?", False, True)]


# Every family's list ends with the lean-weight pair (stochastic rounding and its seed).
ROUNDING = [("stochastic_rounding", "bool", False, False), ("seed", "int", False, False)]


def lists(*names):
    return [(n, "Tensor[]", True, False) for n in names]


def floats(*names):
    return [(n, "float", False, False) for n in names]


def bools(*names):
    return [(n, "bool", False, False) for n in names]


EXPECTED = {
    "adam": lists("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "master_params", "exp_avg_scales",
                  "exp_avg_sq_scales") + STEP_HEAD
    + floats("beta1", "beta2", "eps", "weight_decay") + bools("adam_w_mode", "bias_correction", "maximize")
    + ROUNDING + STEP_TAIL,
    "sgd": lists("params", "grads", "momentum_buffers", "master_params") + STEP_HEAD
    + floats("momentum", "dampening", "weight_decay") + bools("nesterov", "wd_after_momentum", "maximize") + ROUNDING
    + STEP_TAIL,
    "lamb": lists("params", "grads", "exp_avgs", "exp_avg_sqs", "master_params") + STEP_HEAD
    + floats("beta1", "beta2", "eps", "weight_decay") + bools("bias_correction", "grad_averaging", "adam_w_mode")
    + floats("max_grad_norm") + bools("use_nvlamb") + ROUNDING + STEP_TAIL
    + [("global_grad_norm", "Tensor?", False, True), ("local_norms", "Tensor?", True, True),
       ("trust_norms", "Tensor?", False, True)],
    "adagrad": lists("params", "grads", "state_sums", "master_params") + STEP_HEAD
    + floats("eps", "weight_decay", "lr_decay") + bools("adagrad_w_mode", "maximize") + ROUNDING + STEP_TAIL,
    "novograd": lists("params", "grads", "exp_avgs") + [("exp_avg_sq_norms", "Tensor", True, False)]
    + lists("master_params") + STEP_HEAD + floats("beta1", "beta2", "eps", "weight_decay")
    + bools("bias_correction", "grad_averaging", "reg_inside_moment") + floats("norm_type") + bools("init_zero")
    + ROUNDING + STEP_TAIL + [("grad_norms", "Tensor?", False, True)],
}


def declared_defaults(family: str) -> dict:
    """The X(type, name, default) lines of MIXPREC_<FAMILY>_ARGS, read from the header itself."""
    text = ARGS_H.read_text()
    block = re.search(rf"#define MIXPREC_{family.upper()}_ARGS\(X\)(.*?)\n\n", text, re.S).group(1)
    out = {}
    for ctype, name, value in re.findall(r"X\((\w+), (\w+), ([^)]+)\)", block):
        out[name] = {"double": float, "int64_t": int}.get(ctype, lambda v: v == "true")(value)
    return out


@pytest.mark.parametrize("check", [False, True], ids=["step", "check"])
@pytest.mark.parametrize("family", EXPECTED)
def test_schema_lists_the_declared_arguments(family, check):
    op = getattr(torch.ops.mixprec, family + ("_check" if check else "_")).default
    schema = op._schema
    # The text parses back to the same schema (what torch.library and opcheck rely on).
    assert str(torch._C.parse_schema(str(schema))) == str(schema)
    assert schema.returns == []
    got = [(a.name, str(a.type).replace("List[Tensor]", "Tensor[]").replace("Optional[Tensor]", "Tensor?"),
            a.alias_info is not None and a.alias_info.is_write, a.type.kind() == "OptionalType")
           for a in schema.arguments]
    want = [(n, t, written and not check, opt) for n, t, written, opt in EXPECTED[family]]
    assert got == want
    # Keyword-only from lr on, as the wrappers call them.
    assert [a.kwarg_only for a in schema.arguments] == [i > [n for n, *_ in want].index("step_tensor")
                                                         for i in range(len(want))]
    # The hyper-parameters carry the declaration's defaults; lr has none, the step scalars theirs.
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    hyper = declared_defaults(family)
    assert hyper and {k: defaults[k] for k in hyper} == hyper
    assert "lr" not in defaults and defaults["step"] == 0
    assert all(defaults[n] is None for n, t, *_ in want if t == "Tensor?" and n != "step_tensor")


# ---- the validate-only twins -------------------------------------------------------------------

def layout_break(t):
    t["params"][1] = torch.empty(2 * t["params"][1].numel())[::2].copy_(t["params"][1])  # a strided view


def range_break(op):
    return {"adam_": dict(beta2=1.0), "sgd_": dict(momentum=-1.0), "lamb_": dict(max_grad_norm=-1.0),
            "adagrad_": dict(lr_decay=float("nan")), "novograd_": dict(norm_type=3.0)}[op]


def bad_calls(op):
    """name -> (edit of the operands, keywords of the call) for calls the step refuses."""
    cases = {f"alias_{c}": (edit, {}) for c, (edit, _) in alias_cases(op).items()}
    cases["strided_param"] = (layout_break, {})
    cases["hyper_parameter_range"] = (lambda t: None, range_break(op))
    cases["lr_negative"] = (lambda t: None, dict(lr=-1.0))
    cases["grads_too_short"] = (lambda t: t["grads"].pop(), {})
    return cases


BAD = [(op, c) for op in OPS for c in bad_calls(op)]


def refusal(fn):
    with pytest.raises(Exception) as err:
        fn()
    return type(err.value), str(err.value)


@pytest.mark.parametrize("op,case", BAD)
def test_check_raises_exactly_what_the_step_raises_and_both_change_nothing(op, case, gen):
    t = operands(op, gen)
    edit, kw = bad_calls(op)[case]
    edit(t)
    step_tensor = torch.ones(1)
    before = snapshot(everything(t) + [step_tensor])
    checked = refusal(lambda: call(op, t, validate_only=True, step_tensor=step_tensor, **kw))
    assert_unchanged(before, everything(t) + [step_tensor], f"{op} check refusing {case}")
    stepped = refusal(lambda: call(op, t, step_tensor=step_tensor, **kw))
    assert_unchanged(before, everything(t) + [step_tensor], f"{op} step refusing {case}")
    assert checked == stepped
    assert checked[1].startswith(f"mixprec::{op}: "), checked[1]


@pytest.mark.parametrize("op", OPS)
def test_valid_check_changes_no_tensor_and_the_step_then_runs(op, gen):
    t = operands(op, gen)
    step_tensor, grad_scale = torch.ones(1), torch.full((1,), 4.0)
    before = snapshot(everything(t) + [step_tensor, grad_scale])
    call(op, t, validate_only=True, step_tensor=step_tensor, grad_scale=grad_scale)
    assert_unchanged(before, everything(t) + [step_tensor, grad_scale], f"{op} check")
    call(op, t, step_tensor=step_tensor, grad_scale=grad_scale)  # the same call steps: it was valid
    assert step_tensor.item() == 2.0
    for key in OPS[op][0]:  # every list the step writes moved (grads: unscaled by grad_scale)
        assert any(not torch.equal(a, b) for a, b in zip(t[key], before)), key
        before = before[len(t[key]):]


@pytest.mark.parametrize("op", OPS)
def test_empty_params_is_a_step_over_nothing_after_the_range_checks(op):
    keys = OPS[op][0]
    empty = {k: [] for k in keys}
    empty["norms"] = [torch.empty(0)]
    step_tensor = torch.ones(1)
    for validate_only in (False, True):
        call(op, empty, step_tensor=step_tensor, validate_only=validate_only)
        assert step_tensor.item() == 1.0  # not even the step count moves
        with pytest.raises(ValueError, match=re.escape(f"mixprec::{op}: ")):
            call(op, empty, validate_only=validate_only, **range_break(op))
        with pytest.raises(ValueError, match=re.escape(f"mixprec::{op}: params is empty but grads has 1 tensors")
                           if op not in ("lamb_", "novograd_") else re.escape(f"mixprec::{op}: grads has 1 tensors")):
            call(op, dict(empty, grads=[torch.zeros(2)]), validate_only=validate_only)


@pytest.mark.parametrize("validate_only", [False, True])
@pytest.mark.parametrize("op", OPS)
def test_wrappers_trace_whole_under_torch_compile(op, validate_only, gen):
    """The wrappers pick the schema's arguments by name from their locals: dynamo must trace that
    without a graph break (fullgraph), and the compiled call must equal the eager one bit for bit."""
    t = operands(op, gen)
    eager = {k: [x.clone() for x in v] for k, v in t.items()}
    torch._dynamo.reset()
    torch.compile(lambda: call(op, t, validate_only=validate_only), fullgraph=True, backend="eager")()
    call(op, eager, validate_only=validate_only)
    for a, b in zip(everything(t), everything(eager)):
        assert torch.equal(a, b)
