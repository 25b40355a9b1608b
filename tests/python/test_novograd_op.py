# Tests of the fused NovoGrad op mixprec.novograd_ on CPU and CUDA: one step against the float64
# reference at chunk boundaries, skipped steps, loss scale, device scalars, masters, bad inputs.
from __future__ import annotations

import math

import pytest
import torch

import mixprec
from conftest import (
    CHUNK,
    MANY_TENSORS,
    NON_FINITE,
    assert_bitwise_equal,
    assert_rel_err,
    assert_unchanged,
    boundary_sizes,
    check_rejected,
    inject_non_finite,
    random_tensor,
    random_tensors,
    scalar,
    snapshot,
    sync,
    unaligned_view,
)
from test_novograd import (  # shared helpers
    HP,
    OP,
    all_state,
    check_one_step,
    expected_one_step,
    flags_id,
    make_state,
    run_op,
)


# ---- op: one step against the reference, edge sizes -------------------------------------------------

# (flags, step): v seeded (step 1) and blended, both norm types, every flag off its default.
ONE_STEP_CASES = [
    (dict(), 1),  # Apex's defaults: decoupled decay, grad averaging, bias correction, L2, seeded v
    (dict(), 4),
    (dict(reg_inside_moment=True, init_zero=True, norm_type=math.inf), 1),
    (dict(grad_averaging=False, bias_correction=False, reg_inside_moment=True), 4),
    (dict(norm_type=math.inf), 1),
]


@pytest.mark.parametrize("flags,step", ONE_STEP_CASES, ids=lambda c: flags_id(c) if isinstance(c, dict) else f"step{c}")
def test_op_step_matches_reference_at_chunk_boundaries(device, gen, rng, flags, step):
    sizes = boundary_sizes(rng)
    st = make_state(sizes, torch.float32, torch.float32, device, gen, master=False)
    exp = expected_one_step(st, step, **flags)
    run_op(st, step=step, **flags)
    check_one_step(st, exp, f"step {step} {flags}")


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_op_master_weights_write_every_rounded_param(device, gen, rng, param_dtype):
    # The model copy is pure output with master weights: poisoned, it must be fully rewritten.
    sizes = boundary_sizes(rng)
    st = make_state(sizes, param_dtype, param_dtype, device, gen, master=True)
    for p in st["params"]:
        p.fill_(math.nan)
    exp = expected_one_step(st, 3)
    run_op(st, step=3)
    check_one_step(st, exp, f"{param_dtype} with masters")


def test_op_mixed_dtypes_in_one_call(device, gen):
    # Every (param, grad) dtype pair in one call: several groups for the norms and the update.
    combos = [(p, g) for p in (torch.float32, torch.float16, torch.bfloat16)
              for g in (torch.float32, torch.float16, torch.bfloat16)]
    sizes = [CHUNK + 1 + 7 * i for i in range(len(combos))]
    params = [random_tensor(s, p, device, gen, 0.1) for s, (p, _) in zip(sizes, combos)]
    st = dict(params=params, grads=[random_tensor(s, g, device, gen) for s, (_, g) in zip(sizes, combos)],
              exp_avgs=random_tensors(sizes, torch.float32, device, gen, 0.1),
              exp_avg_sq_norms=torch.rand(len(sizes), generator=gen).add(1).to(device),
              master_params=[p.float() for p in params])
    exp = expected_one_step(st, 2, reg_inside_moment=True)
    run_op(st, step=2, reg_inside_moment=True)
    check_one_step(st, exp, "mixed dtypes")


def test_op_more_tensors_than_a_launch_holds(device, gen, rng):
    # Beyond one launch table of the norm pass (1 list) and of the update (4 lists).
    sizes = [rng.randint(1, 64) for _ in range(MANY_TENSORS)]
    sizes[rng.randrange(len(sizes))] = CHUNK + 5
    st = make_state(sizes, torch.float32, torch.bfloat16, device, gen, master=False)
    exp = expected_one_step(st, 2, norm_type=math.inf)
    run_op(st, step=2, norm_type=math.inf)
    check_one_step(st, exp, "many tensors")


def test_op_unaligned_views(device, gen):
    # Views at an odd offset take the element-wise path; their bases' ends must stay untouched.
    n = 2 * CHUNK + 3
    p, p_base = unaligned_view(n, torch.float16, device, gen, 0.1)
    g, _ = unaligned_view(n, torch.bfloat16, device, gen)
    m, m_base = unaligned_view(n, torch.float32, device, gen, 0.1)
    w, w_base = unaligned_view(n, torch.float32, device, gen, 0.1)
    ends = [t[[0, -1]].clone() for t in (p_base, m_base, w_base)]
    st = dict(params=[p], grads=[g], exp_avgs=[m], exp_avg_sq_norms=scalar(3.0, device), master_params=[w])
    exp = expected_one_step(st, 5)
    run_op(st, step=5)
    check_one_step(st, exp, "unaligned")
    for base, end in zip((p_base, m_base, w_base), ends):
        assert_bitwise_equal(base[[0, -1]], end, "an unaligned view's neighbours were written")


@pytest.mark.parametrize("init_zero", [False, True])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_op_zero_size_and_empty(device, gen, init_zero, norm_type):
    # Zero-size tensors have no elements but a second moment, blended with a zero norm as in Apex.
    sizes = [0, 5, 0, CHUNK + 1]
    st = make_state(sizes, torch.float32, torch.float32, device, gen, master=False)
    step = 1 if not init_zero else 2
    exp = expected_one_step(st, step, norm_type=norm_type, init_zero=init_zero)
    run_op(st, step=step, norm_type=norm_type, init_zero=init_zero)
    check_one_step(st, exp, "zero-size tensors")
    assert st["exp_avg_sq_norms"][0].item() == (0.0 if not init_zero else pytest.approx(exp[2][0].item(), rel=1e-6))
    # Only zero-size tensors: no chunk at all, yet the moments still move.
    st = make_state([0, 0], torch.float32, torch.float32, device, gen, master=False)
    exp = expected_one_step(st, 3, norm_type=norm_type)
    run_op(st, step=3, norm_type=norm_type)
    assert_rel_err(st["exp_avg_sq_norms"], exp[2], 1e-6, "all zero-size")
    # Empty lists: nothing to do, and no error.
    mixprec.novograd_([], [], [], torch.empty(0, device=device), step=1, **HP)


# ---- op: skipped steps, loss scale, device scalars ----------------------------------------------------


@pytest.mark.parametrize("first_step", [True, False])
def test_op_found_inf_skips_everything(device, gen, first_step):
    sizes = [CHUNK + 9, 100, 3]
    st = make_state(sizes, torch.float16, torch.float16, device, gen, master=True)
    for g, where, value in zip(st["grads"], ("first", "last", "random"), NON_FINITE):
        inject_non_finite(g, where, value, gen)
    step_tensor = scalar(0.0 if first_step else 6.0, device)
    before = snapshot(all_state(st, step_tensor))
    run_op(st, step_tensor=step_tensor, found_inf=scalar(1.0, device), grad_scale=scalar(1024.0, device),
           lr_tensor=scalar(0.1, device))
    sync(device)
    assert_unchanged(before, all_state(st, step_tensor), "skipped step")
    # A clear found_inf then runs the step (and counts it).
    for g in st["grads"]:
        g.copy_(random_tensor(g.shape, g.dtype, device, gen))
    exp = expected_one_step(st, 1 if first_step else 7)
    run_op(st, step_tensor=step_tensor, found_inf=scalar(0.0, device))
    check_one_step(st, exp, "step after a skipped one")
    assert step_tensor.item() == (1.0 if first_step else 7.0)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_op_grad_scale_unscales_exactly(device, gen, grad_dtype, norm_type):
    # A power-of-two scale is exact in every step of the math, norms included: the scaled run must
    # equal the unscaled one bit for bit.
    sizes = [CHUNK + 17, 333, 1]
    a = make_state(sizes, torch.float32, grad_dtype, device, gen, master=False)
    b = {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone()) for k, v in a.items()}
    for g in b["grads"]:
        g.mul_(256.0)
    run_op(a, step=3, norm_type=norm_type)
    run_op(b, step=3, norm_type=norm_type, grad_scale=scalar(256.0, device))
    for key in ("params", "exp_avgs"):
        for i, (x, y) in enumerate(zip(a[key], b[key])):
            assert_bitwise_equal(y, x, f"{key}[{i}] with grad_scale")
    assert_bitwise_equal(b["exp_avg_sq_norms"], a["exp_avg_sq_norms"], "exp_avg_sq_norms with grad_scale")


def _raw_novograd(st, **kw):
    """torch.ops.mixprec.novograd_ itself: grad_norms is the op's argument, not the wrapper's."""
    args = dict(HP, bias_correction=True, grad_averaging=True, reg_inside_moment=False, norm_type=2.0,
                init_zero=False, step=3)
    args.update(kw)
    torch.ops.mixprec.novograd_(st["params"], st["grads"], st["exp_avgs"], st["exp_avg_sq_norms"],
                                st["master_params"], None, **args)


def _copy_state(st):
    return {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone()) for k, v in st.items()}


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_op_given_grad_norms_replace_its_own(device, gen, norm_type):
    # Sharded tensors hand in whole-gradient norms (reduced across ranks). Handed the norms the
    # op would compute itself (multi_tensor_norm's, of the grads as stored: still scaled), the
    # step is the same bit for bit; handed other norms, the second moments follow those.
    sizes = [CHUNK + 17, 0, 333, 1]
    own = make_state(sizes, torch.float16, torch.bfloat16, device, gen, master=True)
    given, doubled = _copy_state(own), _copy_state(own)
    scale = scalar(8.0, device)
    _raw_novograd(own, norm_type=norm_type, grad_scale=scale)
    norms = mixprec.multi_tensor_norm(given["grads"], norm_type, per_tensor=True)[1]
    _raw_novograd(given, norm_type=norm_type, grad_scale=scale, grad_norms=norms)
    for key in ("params", "exp_avgs", "master_params"):
        for i, (a, b) in enumerate(zip(given[key], own[key])):
            assert_bitwise_equal(a, b, f"{key}[{i}]")
    assert_bitwise_equal(given["exp_avg_sq_norms"], own["exp_avg_sq_norms"], "exp_avg_sq_norms")
    v_before = doubled["exp_avg_sq_norms"].double().cpu()
    _raw_novograd(doubled, norm_type=norm_type, grad_scale=scale, grad_norms=2.0 * norms)
    # The second moments follow the norms handed in: v' = beta2 v + (1 - beta2) n (inf) or
    # v'^2 = beta2 v^2 + (1 - beta2) n^2 (L2), n = 2 * norms / scale, here in float64. (Not as the
    # difference from the op's own run: v' - beta2 v cancels when v dominates, seen 1.4e-4.)
    beta2 = HP["beta2"]
    n = 2.0 * norms.double().cpu() / 8.0
    want = beta2 * v_before + (1 - beta2) * n if norm_type != 2.0 else \
        (beta2 * v_before**2 + (1 - beta2) * n**2).sqrt()
    assert_rel_err(doubled["exp_avg_sq_norms"], want, 1e-5, "second moments from the given norms")


def test_op_rejects_bad_grad_norms_and_modifies_nothing(device, gen):
    st = make_state([100, 7, 3], torch.float16, torch.float16, device, gen, master=True)
    for bad, exc in ((torch.ones(2, device=device), ValueError), (torch.ones(3, 1, device=device), ValueError),
                     (torch.ones(3, device=device, dtype=torch.float64), TypeError),
                     (torch.ones(6, device=device)[::2], RuntimeError)):
        check_rejected(lambda: _raw_novograd(st, grad_norms=bad), all_state(st), exc, OP, "grad_norms", None, device)


def test_op_device_lr_and_step_equal_host_scalars(device, gen):
    # From step 0 on the device: the first step seeds v, as host step=1 does; lr from a tensor.
    sizes = [CHUNK - 1, 40]
    host = make_state(sizes, torch.bfloat16, torch.float32, device, gen, master=True)
    dev = {k: ([t.clone() for t in v] if isinstance(v, list) else v.clone()) for k, v in host.items()}
    step_tensor, lr_tensor = scalar(0.0, device), scalar(0.03, device)
    for step in (1, 2, 3):
        grads = random_tensors(sizes, torch.float32, device, gen)
        host["grads"], dev["grads"] = grads, [g.clone() for g in grads]
        run_op(host, **dict(HP, lr=0.03), step=step)
        run_op(dev, **dict(HP, lr=123.0), step_tensor=step_tensor, lr_tensor=lr_tensor)
    assert step_tensor.item() == 3.0
    for key in ("params", "exp_avgs", "master_params"):
        for i, (x, y) in enumerate(zip(host[key], dev[key])):
            assert_bitwise_equal(y, x, f"{key}[{i}] with device scalars")
    assert_bitwise_equal(dev["exp_avg_sq_norms"], host["exp_avg_sq_norms"], "exp_avg_sq_norms")


def test_op_without_bias_correction_needs_no_step_with_init_zero(device, gen):
    st = make_state([10], torch.float32, torch.float32, device, gen, master=False)
    exp = expected_one_step(st, 5, bias_correction=False, init_zero=True)  # step unused by this math
    run_op(st, step=0, bias_correction=False, init_zero=True)
    check_one_step(st, exp, "no step")


# ---- op: bad inputs -------------------------------------------------------------------------------------


def test_op_rejects_bad_inputs_and_modifies_nothing(device, gen):
    sizes = [100, 7, 3]

    def fresh():
        return make_state(sizes, torch.float16, torch.float16, device, gen, master=True)

    def rejects(st, exc, arg, index=None, **kw):
        check_rejected(lambda: run_op(st, **dict(dict(step=2), **kw)), all_state(st), exc, OP, arg, index, device)

    st = fresh()
    st["grads"] = st["grads"][:2]
    rejects(st, ValueError, "grads")
    st = fresh()
    st["exp_avgs"] = st["exp_avgs"][:1]
    rejects(st, ValueError, "exp_avgs")
    st = fresh()
    st["master_params"] = st["master_params"][:2]
    rejects(st, ValueError, "master_params")
    st = fresh()
    st["exp_avg_sq_norms"] = torch.ones(2, device=device)
    rejects(st, ValueError, "exp_avg_sq_norms")
    st = fresh()
    st["exp_avg_sq_norms"] = torch.ones(1, 3, device=device)
    rejects(st, ValueError, "exp_avg_sq_norms")
    st = fresh()
    st["exp_avg_sq_norms"] = torch.ones(3, device=device, dtype=torch.float64)
    rejects(st, TypeError, "exp_avg_sq_norms")
    st = fresh()
    st["exp_avg_sq_norms"] = torch.ones(6, device=device)[::2]
    rejects(st, RuntimeError, "exp_avg_sq_norms")
    st = fresh()
    st["exp_avgs"][1] = st["exp_avgs"][1].half()
    rejects(st, TypeError, "exp_avgs", 1)
    st = fresh()
    st["master_params"][2] = st["master_params"][2].bfloat16()
    rejects(st, TypeError, "master_params", 2)
    st = fresh()
    st["params"][1] = st["params"][1].double()
    rejects(st, TypeError, "params", 1)
    st = fresh()
    st["grads"][2] = torch.ones(4, device=device, dtype=torch.float16)
    rejects(st, ValueError, "grads", 2)
    st = fresh()
    st["params"][0] = torch.ones(200, device=device, dtype=torch.float16)[::2]
    rejects(st, RuntimeError, "params", 0)
    st = fresh()
    st["exp_avgs"][0] = torch.ones(200, device=device)[::2]
    rejects(st, RuntimeError, "exp_avgs", 0)
    st = fresh()
    rejects(st, ValueError, "norm_type", norm_type=1.0)
    rejects(st, ValueError, "norm_type", norm_type=0.0)
    rejects(st, ValueError, "beta1", beta1=1.0)
    rejects(st, ValueError, "beta2", beta2=-0.1)
    rejects(st, ValueError, "eps", eps=-1e-8)
    rejects(st, ValueError, "weight_decay", weight_decay=-0.1)
    rejects(st, ValueError, "lr", lr=-1.0)
    rejects(st, ValueError, "step", step=0)
    rejects(st, ValueError, "step", step=0, bias_correction=False)  # init_zero=False must know step 1
    rejects(st, TypeError, "grad_scale", grad_scale=torch.ones(1, device=device, dtype=torch.float64))
    rejects(st, ValueError, "found_inf", found_inf=torch.zeros(2, device=device))
    rejects(st, ValueError, "step_tensor", step_tensor=torch.zeros(2, device=device))
    if torch.device(device).type == "cuda":
        st = fresh()
        st["exp_avg_sq_norms"] = st["exp_avg_sq_norms"].cpu()
        rejects(st, RuntimeError, "exp_avg_sq_norms")
        st = fresh()
        rejects(st, RuntimeError, "found_inf", found_inf=torch.zeros(1))
        st = fresh()
        st["grads"][1] = st["grads"][1].cpu()
        rejects(st, RuntimeError, "grads", 1)


def test_opcheck(device, gen):
    # opcheck runs the op several times (real, fake, functionalized) and compares the mutations.
    op = torch.ops.mixprec.novograd_.default
    for master, scalars in ((True, True), (False, False)):
        st = make_state([1000, 10, 1], torch.float16, torch.float16, device, gen, master=master)
        grad_norms = random_tensor(3, torch.float32, device, gen).abs() if master else None
        kw = dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, bias_correction=True,
                  grad_averaging=True, reg_inside_moment=master, norm_type=2.0, init_zero=False, step=3,
                  grad_norms=grad_norms)
        step_tensor = scalar(2.0, device) if scalars else None
        if scalars:
            kw.update(lr_tensor=scalar(0.01, device), grad_scale=scalar(8.0, device), found_inf=scalar(0.0, device))
        torch.library.opcheck(op, (st["params"], st["grads"], st["exp_avgs"], st["exp_avg_sq_norms"],
                                   st["master_params"], step_tensor), kw)


@pytest.mark.cuda
def test_cuda_step_never_syncs_and_captures_in_a_cuda_graph(gen):
    device = "cuda"
    sizes = [CHUNK + 3, 100, 5]
    st = make_state(sizes, torch.float16, torch.float16, device, gen, master=True)
    step_tensor, lr_tensor = scalar(0.0, device), scalar(0.05, device)
    found, scale = scalar(0.0, device), scalar(64.0, device)

    def step():
        run_op(st, step_tensor=step_tensor, lr_tensor=lr_tensor, grad_scale=scale, found_inf=found)

    torch.cuda.set_sync_debug_mode("error")  # any host synchronization inside the op raises
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    # Replays read step, lr, scale and found_inf from the device and match the reference.
    for replay_step, skip in ((2, False), (3, False), (3, True)):
        for g in st["grads"]:
            g.copy_(random_tensor(g.shape, g.dtype, device, gen, 64.0))
        found.fill_(1.0 if skip else 0.0)
        before = snapshot(all_state(st, step_tensor))
        exp = expected_one_step(st, replay_step, grad_scale=64.0)
        graph.replay()
        torch.cuda.synchronize()
        if skip:
            assert_unchanged(before, all_state(st, step_tensor), "skipped replay")
        else:
            check_one_step(st, exp, f"replay at step {replay_step}")
            assert step_tensor.item() == replay_step
