# Tests of mixprec.optimizers.FusedLAMB on CPU and CUDA against a float64 reference written from the
# paper with Apex's documented variant: 20-step trajectories, checkpoints, GradScaler, no host sync
# (the op itself: test_lamb_op.py).
from __future__ import annotations

import io
import math

import pytest
import torch

import mixprec
from conftest import (
    CHUNK,
    assert_bitwise_equal,
    assert_rel_err,
    assert_unchanged,
    peer_bound,
    random_tensor,
    scalar,
    snapshot,
)
from mixprec.optimizers.fused_lamb import FusedLAMB

OP = "lamb_"
LOW = (torch.float16, torch.bfloat16)


# ---- the reference ------------------------------------------------------------------------------


def reference_step(ws, gs, ms, vs, *, step, lr, betas, eps, weight_decay, bias_correction=True, grad_averaging=True,
                   adam_w_mode=True, use_nvlamb=False, clip=1.0, round_to=None):
    """One LAMB step (You et al. 2019, Algorithm 2) with Apex's FusedLAMB variant, in the dtype of
    the inputs (float64 for the reference): ``gs`` unscaled, divided by ``clip`` (the global clip
    factor); decay added to the gradient (L2) or to the update (adam_w_mode); trust ratio
    ||w|| / ||u||, 1 when either is 0, only with weight decay or use_nvlamb. ``round_to`` rounds
    the weights after the step (the plain-PyTorch peer of a low-precision parameter)."""
    b1, b2 = betas
    b3 = 1.0 - b1 if grad_averaging else 1.0
    bc1 = 1.0 - b1**step if bias_correction else 1.0
    bc2 = 1.0 - b2**step if bias_correction else 1.0
    for i, w in enumerate(ws):
        g = gs[i] / clip
        if not adam_w_mode:
            g = g + weight_decay * w
        ms[i] = b1 * ms[i] + b3 * g
        vs[i] = b2 * vs[i] + (1.0 - b2) * g * g
        u = (ms[i] / bc1) / ((vs[i] / bc2).sqrt() + eps)
        if adam_w_mode:
            u = u + weight_decay * w
        ratio = 1.0
        if weight_decay != 0.0 or use_nvlamb:
            wn, un = w.norm().item(), u.norm().item()
            if wn > 0.0 and un > 0.0:
                ratio = wn / un
        ws[i] = w - lr * ratio * u
        if round_to is not None:
            ws[i] = ws[i].to(round_to).to(w.dtype)


def clip_factor(grads, max_grad_norm) -> float:
    """max(1, ||all grads|| / max_grad_norm); 1 when clipping is off (0 or inf)."""
    if not 0.0 < max_grad_norm < math.inf:
        return 1.0
    norm = math.sqrt(sum(float(g.to(torch.float64).square().sum()) for g in grads))
    return max(1.0, norm / max_grad_norm)


class Track:
    """float64 reference state of a list of weights, and for low-precision weights without
    masters the float32 peer's (weights rounded to ``round_to`` every step), stepped alongside."""

    def __init__(self, weights, round_to=None):
        self.round_to = round_to
        self.ref = self._state(weights, torch.float64)
        self.peer = self._state(weights, torch.float32) if round_to is not None else None

    @staticmethod
    def _state(weights, dtype):
        ws = [w.detach().cpu().to(dtype) for w in weights]
        return [ws, [torch.zeros_like(w) for w in ws], [torch.zeros_like(w) for w in ws]]

    def step(self, grads64, clip, **hp):
        reference_step(*self._args(self.ref, grads64, torch.float64), clip=clip, **hp)
        if self.peer is not None:
            reference_step(*self._args(self.peer, grads64, torch.float32), clip=clip, round_to=self.round_to, **hp)

    @staticmethod
    def _args(s, grads64, dtype):
        return s[0], [g.to(dtype) for g in grads64], s[1], s[2]


def check_against(track: Track, weights, exp_avgs, exp_avg_sqs, weight_dtype, what):
    """docs/architecture.md's bounds: fp32 weights within 1e-5 of float64 math; low-precision ones within
    2x the plain-PyTorch peer's error (fp32 math, weights rounded to their dtype every step)."""
    for k, (name, outs) in enumerate((("w", weights), ("exp_avg", exp_avgs), ("exp_avg_sq", exp_avg_sqs))):
        if name == "exp_avg":
            # exp_avg averages signed grads: in a 1-element tensor the 20 terms can nearly cancel,
            # and fp32 rounding of the terms is then a large share of a tiny result (seed 17 gave
            # 2.7e-5 with fp32 weights; seed 3224930868 5.3e-5 with bf16 ones, whose fp32 exp_avg
            # does not depend on the weights under adam_w_mode). Judged over the group, where the
            # terms' cancellation is typical, for every weight dtype.
            def flat(ts):
                return torch.cat([t.detach().double().cpu().flatten() for t in ts])

            ref = flat(track.ref[k])
            bound = 1e-5 if track.peer is None else peer_bound(weight_dtype, flat(track.peer[k]), ref)
            assert_rel_err(flat(outs), ref, bound, f"{what}: {name}")
            continue
        for i, out in enumerate(outs):
            ref = track.ref[k][i]
            bound = 1e-5 if track.peer is None else peer_bound(weight_dtype, track.peer[k][i], ref)
            assert_rel_err(out, ref, bound, f"{what}: {name}[{i}]")


# ---- the optimizer over 20 steps -------------------------------------------------------------------

VARIANTS = {
    # Apex's defaults, clipping active (the global norm is far above 1); the second group has no
    # decay, so it takes no trust ratio and the one-pass path.
    "apex_defaults": dict(ctor={}, groups=({"weight_decay": 0.01}, {"weight_decay": 0.0, "lr": 3e-3}), scale=None),
    # L2 decay, no gradient averaging, NVLAMB (trust ratio on the undecayed group too), no bias
    # correction, a clip threshold above the norm.
    "l2_nvlamb": dict(ctor=dict(adam_w_mode=False, grad_averaging=False, use_nvlamb=True, bias_correction=False,
                                max_grad_norm=1e9),
                      groups=({"weight_decay": 0.05}, {"weight_decay": 0.0, "lr": 2e-3}), scale=None),
    # Clipping off, other betas, loss-scaled gradients handed over as a GradScaler does.
    "scaled_unclipped": dict(ctor=dict(max_grad_norm=0.0, betas=(0.8, 0.99), eps=1e-4, weight_decay=0.1),
                             groups=({}, {"max_grad_norm": 0.0, "lr": 5e-3}), scale=1024.0),
}
SIZES = (1, 7, CHUNK - 1, CHUNK + 1, 300, 3001)


# Every dtype/master combination under Apex's defaults; three of them under the other variants.
TRAJECTORY_CASES = [(v, d, m) for v in VARIANTS for d, m in
                    ([(torch.float32, False), (torch.float16, False), (torch.bfloat16, False), (torch.float16, True),
                      (torch.bfloat16, True)] if v == "apex_defaults" else
                     [(torch.float32, False), (torch.bfloat16, False), (torch.float16, True)])]


@pytest.mark.parametrize("variant,dtype,master", TRAJECTORY_CASES)
def test_twenty_steps_match_float64_reference(device, gen, dtype, master, variant):
    cfg = VARIANTS[variant]
    ctor = dict(lr=1e-2, **cfg["ctor"])
    shapes = [SIZES[0], (7, 1), SIZES[2], SIZES[3], (20, 15), SIZES[5]]
    params = [torch.nn.Parameter(random_tensor(s, dtype, device, gen)) for s in shapes]
    split = [params[0::2], params[1::2]]
    opt = FusedLAMB([dict(params=ps, **g) for ps, g in zip(split, cfg["groups"])], master_weights=master, **ctor)
    exact = dtype == torch.float32 or master
    tracks = [Track(ps, round_to=None if exact else dtype) for ps in split]
    scale = cfg["scale"]
    for step in range(1, 21):
        grads64 = [random_tensor(p.shape, torch.float64, "cpu", gen) for p in params]
        stored = [(g * (scale or 1.0)).to(dtype) for g in grads64]  # what backward would leave
        for p, g in zip(params, stored):
            p.grad = g.to(device)
        # The kernel's input, unscaled; taken before the step, which leaves the grads (on the CPU
        # the very tensors of `stored`) unscaled in place.
        seen = [g.double() / (scale or 1.0) for g in stored]
        if scale is not None:  # GradScaler's protocol for optimizers that unscale in the kernel
            opt.grad_scale, opt.found_inf = scalar(scale, device), scalar(0.0, device)
        opt.step()
        group_max = [g["max_grad_norm"] for g in opt.param_groups]
        for gi, (track, ps) in enumerate(zip(tracks, split)):
            group = opt.param_groups[gi]
            hp = dict(step=step, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                      weight_decay=group["weight_decay"], bias_correction=group["bias_correction"],
                      grad_averaging=group["grad_averaging"], adam_w_mode=group["adam_w_mode"],
                      use_nvlamb=group["use_nvlamb"])
            track.step(seen[gi::2], clip_factor(seen, group_max[gi]), **hp)
    assert all(float(g["step"]) == 20 for g in opt.param_groups)
    for gi, (track, ps) in enumerate(zip(tracks, split)):
        weights = [opt.state[p].get("master_param", p) for p in ps]
        check_against(track, weights, [opt.state[p]["exp_avg"] for p in ps], [opt.state[p]["exp_avg_sq"] for p in ps],
                      torch.float32 if exact else dtype, f"{variant} {dtype} master={master} group {gi}")
        if master:
            for i, p in enumerate(ps):
                assert_bitwise_equal(p.detach(), opt.state[p]["master_param"].to(dtype), f"model copy [{i}]")
                bound = peer_bound(dtype, track.ref[0][i].to(dtype), track.ref[0][i])
                assert_rel_err(p, track.ref[0][i], bound, f"model param [{i}]")


def test_global_norm_spans_every_group_and_dtype(device, gen):
    # Apex's rule: one norm over fp16 and fp32 grads of all groups. The groups' own norms clip
    # differently, so a per-group norm fails here.
    p32 = [torch.nn.Parameter(random_tensor(s, torch.float32, device, gen)) for s in (CHUNK + 9, 40)]
    p16 = [torch.nn.Parameter(random_tensor(s, torch.float16, device, gen)) for s in (5000, 3)]
    opt = FusedLAMB([{"params": p32}, {"params": p16, "weight_decay": 0.0}], lr=1e-2, master_weights=True)
    tracks = [Track(p32), Track(p16)]
    for step in range(1, 6):
        grads = [random_tensor(p.shape, p.dtype, "cpu", gen) for p in p32 + p16]
        for p, g in zip(p32 + p16, grads):
            p.grad = g.to(device)
        opt.step()
        seen = [g.double() for g in grads]
        clip = clip_factor(seen, 1.0)
        assert clip_factor(seen[:2], 1.0) != clip and clip_factor(seen[2:], 1.0) != clip
        for gi, track in enumerate(tracks):
            track.step(seen[2 * gi:2 * gi + 2], clip, step=step, lr=1e-2, betas=(0.9, 0.999), eps=1e-6,
                       weight_decay=0.01 if gi == 0 else 0.0)
    masters = list(opt.master_params())
    for i in range(4):
        assert_rel_err(masters[i], tracks[i // 2].ref[0][i % 2], 1e-5, f"master[{i}]")


def lamb_args(params, grads, exp_avgs, exp_avg_sqs, **kw):
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, bias_correction=True, grad_averaging=True,
              adam_w_mode=True, max_grad_norm=1.0, use_nvlamb=False, step=1)
    hp.update(kw)
    return (params, grads, exp_avgs, exp_avg_sqs), hp


# ---- the optimizer: checkpoints, GradScaler, no host sync -------------------------------------------


def _fill_grads(params, gen, device):
    for p in params:
        p.grad = random_tensor(p.shape, p.dtype, "cpu", gen).to(device)


def test_state_dict_round_trip_continues_bit_identically(device, gen):
    shapes = [(CHUNK + 2,), (30, 4), (5,)]
    dtypes = [torch.bfloat16, torch.float32, torch.float16]
    params = [torch.nn.Parameter(random_tensor(s, d, device, gen)) for s, d in zip(shapes, dtypes)]
    opt = FusedLAMB([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0, "lr": 4e-3}], lr=1e-2,
                    master_weights=True)
    for _ in range(3):
        _fill_grads(params, gen, device)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = FusedLAMB([{"params": twins[:2]}, {"params": twins[2:], "weight_decay": 0.0, "lr": 4e-3}], lr=1e-2,
                     master_weights=True)
    opt2.load_state_dict(loaded)
    for _ in range(3):
        _fill_grads(params, gen, device)
        for p, t in zip(params, twins):
            t.grad = p.grad.clone()
        opt.step()
        opt2.step()
    for i, (p, t) in enumerate(zip(params, twins)):
        assert_bitwise_equal(t, p, f"param[{i}]")
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            if key in opt.state[p]:
                assert_bitwise_equal(opt2.state[t][key], opt.state[p][key], f"state[{i}][{key}]")
    for g, g2 in zip(opt.param_groups, opt2.param_groups):
        assert_bitwise_equal(g2["step"], g["step"], "step")
        assert float(g["step"]) == 6


def _mlp(device, seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(device)


def test_torch_grad_scaler_drives_the_fused_path(device, gen):
    # A torch.amp.GradScaler hands scale and found_inf to step(): the run must equal one on
    # unscaled gradients, and a step with inf gradients must change nothing but the scale.
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    scaled_model, plain_model = _mlp(device, seed), _mlp(device, seed)
    opt_s = FusedLAMB(scaled_model.parameters(), lr=1e-2)
    opt_p = FusedLAMB(plain_model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10)

    def batch():
        return random_tensor((16, 32), torch.float32, device, gen), random_tensor((16, 8), torch.float32, device, gen)

    def train_step(x, y):
        for model, opt, scaled in ((scaled_model, opt_s, True), (plain_model, opt_p, False)):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            if scaled:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()

    for _ in range(4):
        train_step(*batch())
    for i, (a, b) in enumerate(zip(scaled_model.parameters(), plain_model.parameters())):
        assert_rel_err(a, b, 1e-6, f"param[{i}] after 4 scaled steps")

    params = list(scaled_model.parameters())
    everything = params + [opt_s.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
    everything += [g["step"] for g in opt_s.param_groups]
    before = snapshot(everything)
    x, y = batch()
    x[3, 5] = math.inf
    opt_s.zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(scaled_model(x), y)).backward()
    scaler.step(opt_s)
    scaler.update()
    assert_unchanged(before, everything, "step with inf gradients")
    assert scaler.get_scale() == 2.0**9
    train_step(*batch())  # the plain run never saw the bad batch: both continue in lockstep
    for i, (a, b) in enumerate(zip(scaled_model.parameters(), plain_model.parameters())):
        assert_rel_err(a, b, 1e-6, f"param[{i}] after the skipped step")


def test_closure_and_apex_legacy_arguments(device, gen):
    p = torch.nn.Parameter(random_tensor(10, torch.float32, device, gen))
    opt = FusedLAMB([p])

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss is not None and p.grad is not None and float(opt.param_groups[0]["step"]) == 1
    with pytest.raises(TypeError, match="step"):
        opt.step(grads=[p.grad])


@pytest.mark.cuda
def test_cuda_step_never_syncs_and_captures_in_a_graph(gen):
    device = "cuda"
    params = [torch.nn.Parameter(random_tensor(s, d, device, gen)) for s, d in
              ((CHUNK + 5, torch.float16), (300, torch.float32))]
    opt = FusedLAMB(params, lr=1e-2, master_weights=True)
    _fill_grads(params, gen, device)
    opt.step()  # state initialization allocates; later steps must not sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.grad_scale, opt.found_inf = scalar(4.0, device), scalar(0.0, device)
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        del opt.grad_scale, opt.found_inf

    # The op with every per-step scalar on the device replays from a CUDA graph like it runs eagerly.
    sizes = (CHUNK + 5, 77)
    init = [random_tensor(s, torch.float32, device, gen) for s in sizes]
    grads = [random_tensor(s, torch.float16, device, gen, 8.0) for s in sizes]
    runs = []
    for graphed in (False, True):
        ps = [p.clone() for p in init]
        ms = [torch.zeros_like(p) for p in ps]
        vs = [torch.zeros_like(p) for p in ps]
        step_t, lr_t, scale_t, found_t = scalar(0.0, device), scalar(1e-2, device), scalar(8.0, device), scalar(0.0, device)
        args, hp = lamb_args(ps, grads, ms, vs, lr=0.0, step=0)

        def call():
            mixprec.lamb_(*args, step_tensor=step_t, lr_tensor=lr_t, grad_scale=scale_t, found_inf=found_t, **hp)

        if graphed:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside capture, then undo its effects
                call()
            torch.cuda.current_stream().wait_stream(stream)
            for dst, src in zip(ps + ms + vs, [p.clone() for p in init] + [torch.zeros_like(p) for p in init] * 2):
                dst.copy_(src)
            step_t.zero_()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            for _ in range(3):
                graph.replay()
        else:
            for _ in range(3):
                call()
        torch.cuda.synchronize()
        assert float(step_t) == 3.0
        runs.append(ps + ms + vs)
    for i, (a, b) in enumerate(zip(*runs)):
        assert_bitwise_equal(a, b, f"graph replay tensor {i}")
