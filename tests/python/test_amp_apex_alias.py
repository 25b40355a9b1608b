# The opt-in legacy alias: `import apex`, `from apex import amp`, `from apex.optimizers import
# FusedAdam` resolve to mixprec after mixprec.enable_apex_alias() or MIXPREC_APEX_ALIAS=1, never
# shadow a real apex, and run Apex's documented amp examples unchanged. Each case runs in a fresh
# interpreter, so no alias leaks into this process.
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Apex's README/amp.rst example and its checkpointing recipe, verbatim where the docs show code
# (the docs' "..." filled in with a small regression problem).
APEX_EXAMPLE = '''
import torch
from apex import amp

N, D_in, D_out = 64, 256, 16
x = torch.randn(N, D_in).cuda()
y = torch.randn(N, D_out).cuda()

# Declare model and optimizer as usual, with default (FP32) precision
model = torch.nn.Linear(D_in, D_out).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

# Allow Amp to perform casts as required by the opt_level
opt_level = 'O1'
model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level)

losses = []
for t in range(20):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    # loss.backward() becomes:
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    losses.append(loss.item())

# Save checkpoint
checkpoint = {
    'model': model.state_dict(),
    'optimizer': optimizer.state_dict(),
    'amp': amp.state_dict()
}
torch.save(checkpoint, 'amp_checkpoint.pt')

# Restore
model = torch.nn.Linear(D_in, D_out).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
checkpoint = torch.load('amp_checkpoint.pt')

model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level)
model.load_state_dict(checkpoint['model'])
optimizer.load_state_dict(checkpoint['optimizer'])
amp.load_state_dict(checkpoint['amp'])

# Continue training
for t in range(5):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    losses.append(loss.item())

# apex.optimizers with O2, as in Apex's README
import apex
model = torch.nn.Linear(D_in, D_out).cuda()
opt = apex.optimizers.FusedAdam(model.parameters(), lr=1e-3)
model, opt = amp.initialize(model, opt, opt_level="O2")
for t in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled_loss:
        scaled_loss.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
    opt.step()
    losses.append(loss.item())
'''

# On a machine without CUDA the example's .cuda() calls become no-ops; the example itself is
# unchanged.
CPU_PRELUDE = '''
import torch
torch.nn.Module.cuda = lambda self, *a, **k: self
torch.Tensor.cuda = lambda self, *a, **k: self
'''

CHECK = '''
import math, sys
assert all(math.isfinite(l) for l in losses), losses
assert losses[19] < losses[0], "O1 training must reduce the loss"
assert type(amp).__module__ == "mixprec.amp" or amp.__name__ == "mixprec.amp"
print("EXAMPLE-OK", sys.modules["apex"].__mixprec_alias__)
'''


def run_python(code: str, tmp_path, env_extra: dict | None = None, pythonpath: str | None = None):
    env = dict(os.environ)
    env.pop("MIXPREC_APEX_ALIAS", None)
    env["OMP_NUM_THREADS"] = "1"  # tiny problems: threads only add contention
    env.update(env_extra or {})
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_env_var_alias_resolves_all_three_imports(tmp_path):
    r = run_python('''
        import mixprec, apex
        from apex import amp
        from apex.optimizers import FusedAdam
        import apex.amp
        assert amp is mixprec.amp and apex.amp is mixprec.amp
        # apex.optimizers: mixprec's classes, FusedSGD with Apex's momentum dtype (apex_compat)
        assert apex.optimizers is mixprec.apex_compat.optimizers
        assert FusedAdam is mixprec.optimizers.FusedAdam
        assert mixprec.amp.__spec__.name == "mixprec.amp"
        print("OK")
    ''', tmp_path, {"MIXPREC_APEX_ALIAS": "1"})
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_no_alias_without_opt_in_then_enable_and_disable_in_process(tmp_path):
    r = run_python('''
        import mixprec
        import mixprec.apex_alias as alias
        try:
            import apex
            raise SystemExit("apex must be absent before the opt-in")
        except ModuleNotFoundError:
            pass
        assert mixprec.enable_apex_alias() is True and alias.enable_apex_alias() is True
        from apex import amp
        assert amp is mixprec.amp
        alias.disable_apex_alias()
        try:
            import apex
        except ModuleNotFoundError:
            print("GONE")
    ''', tmp_path, {"MIXPREC_APEX_ALIAS": "0"})
    assert r.returncode == 0 and "GONE" in r.stdout, r.stderr


def test_a_real_apex_always_wins(tmp_path):
    real = tmp_path / "site" / "apex"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    (real / "amp.py").write_text("REAL_AMP = True\n")
    r = run_python('''
        import mixprec.apex_alias as alias
        assert alias.enable_apex_alias() is False
        import apex
        from apex import amp
        assert apex.REAL and amp.REAL_AMP
        print("REAL")
    ''', tmp_path, {"MIXPREC_APEX_ALIAS": "1"}, pythonpath=str(tmp_path / "site"))
    assert r.returncode == 0 and "REAL" in r.stdout, r.stderr
    # The start-up hook too: it is never reached, so mixprec is not even imported.
    r = run_python(pth_prelude(tmp_path) + textwrap.dedent('''
        import sys
        import apex
        from apex import amp
        assert apex.REAL and amp.REAL_AMP and "mixprec" not in sys.modules
        print("REAL")
    '''), tmp_path, {"MIXPREC_APEX_ALIAS": "1"}, pythonpath=str(tmp_path / "site"))
    assert r.returncode == 0 and "REAL" in r.stdout, r.stderr


# -- the .pth start-up hook: MIXPREC_APEX_ALIAS for scripts that never import mixprec ------------
REPO_PTH = Path(__file__).resolve().parents[2] / "python" / "mixprec_apex_alias.pth"


def installed_site() -> Path | None:
    """The site-packages holding the mixprec under test when it is an installed wheel (as in
    CI), else None (a source checkout on PYTHONPATH: no .pth was installed)."""
    spec = importlib.util.find_spec("mixprec")
    root = Path(spec.origin).resolve().parent.parent
    return root if root.name in ("site-packages", "dist-packages") else None


def pth_prelude(tmp_path) -> str:
    """What makes a subprocess see the .pth as interpreter start-up does: nothing when the wheel
    installed it (start-up already ran it); otherwise the repository's file through
    site.addsitedir, which runs a .pth's lines exactly as start-up does."""
    if installed_site() is not None:
        return ""
    site_dir = tmp_path / "pth_site"
    site_dir.mkdir(exist_ok=True)
    shutil.copy(REPO_PTH, site_dir / REPO_PTH.name)
    return f"import site; site.addsitedir({str(site_dir)!r})\n"


def test_the_wheel_installs_the_pth_at_site_packages_root():
    site_dir = installed_site()
    if site_dir is None:
        pytest.skip("mixprec runs from a source checkout: the wheel's .pth is not installed here")
    installed = site_dir / REPO_PTH.name
    assert installed.is_file(), f"the wheel must install {REPO_PTH.name} in {site_dir}"
    assert installed.read_text() == REPO_PTH.read_text()


def test_pth_hook_is_free_until_apex_is_imported(tmp_path):
    r = run_python(pth_prelude(tmp_path) + textwrap.dedent('''
        import sys
        assert "mixprec" not in sys.modules and "torch" not in sys.modules, "the hook must import nothing"
        from apex.optimizers import FusedAdam
        import mixprec
        assert FusedAdam is mixprec.optimizers.FusedAdam
        print("LAZY")
    '''), tmp_path, {"MIXPREC_APEX_ALIAS": "1"})
    assert r.returncode == 0 and "LAZY" in r.stdout and not r.stderr, r.stderr
    for off in ("0", "", "no"):
        r = run_python(pth_prelude(tmp_path) + textwrap.dedent('''
            import sys
            hooks = [f for f in sys.meta_path if "Hook" in getattr(f, "__name__", "")]
            try:
                import apex
            except ImportError:
                print("OFF", "mixprec" in sys.modules, hooks)
        '''), tmp_path, {"MIXPREC_APEX_ALIAS": off})
        assert r.returncode == 0 and "OFF False []" in r.stdout and not r.stderr, (off, r.stdout, r.stderr)


def test_pth_never_breaks_start_up_and_names_a_broken_mixprec(tmp_path):
    # A mixprec that fails to import (a broken build) shadows the real one: the interpreter still
    # starts silently, and only `import apex` fails, saying why.
    broken = tmp_path / "broken" / "mixprec"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise RuntimeError('broken build')\n")
    r = run_python(pth_prelude(tmp_path) + textwrap.dedent('''
        print("UP")
        try:
            import apex
        except ImportError as e:
            print("ERR", e)
    '''), tmp_path, {"MIXPREC_APEX_ALIAS": "1"}, pythonpath=str(tmp_path / "broken"))
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert "UP" in r.stdout and "MIXPREC_APEX_ALIAS" in r.stdout and "broken build" in r.stdout, r.stdout


@pytest.mark.parametrize("opt_in", ["one_line", "env"])
def test_apex_documented_example_runs_unchanged_on_cpu(opt_in, tmp_path):
    # The documented one-line opt-in, or the environment variable with the .pth hook.
    prelude = "import mixprec; mixprec.enable_apex_alias()\n" if opt_in == "one_line" else pth_prelude(tmp_path)
    r = run_python(prelude + CPU_PRELUDE + APEX_EXAMPLE + CHECK, tmp_path, {"MIXPREC_APEX_ALIAS": "1"})
    assert r.returncode == 0 and "EXAMPLE-OK True" in r.stdout, r.stdout + r.stderr


@pytest.mark.cuda
def test_apex_documented_example_runs_unchanged_on_cuda(tmp_path):
    r = run_python(pth_prelude(tmp_path) + APEX_EXAMPLE + CHECK, tmp_path, {"MIXPREC_APEX_ALIAS": "1"})
    assert r.returncode == 0 and "EXAMPLE-OK True" in r.stdout, r.stdout + r.stderr


# -- the Megatron-LM/NeMo-era modules: multi_tensor_apply, amp_C, parallel.LARC, normalization -----
MEGATRON_IMPORTS = '''
import sys, torch
import apex.multi_tensor_apply
from apex.multi_tensor_apply import multi_tensor_applier
import amp_C
from apex.parallel import LARC
from apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from apex.normalization.fused_layer_norm import fused_layer_norm_affine, mixed_dtype_fused_rms_norm_affine
import apex.parallel.LARC
from apex.parallel.LARC import LARC as LARC2
import mixprec.apex_compat as compat
assert multi_tensor_applier is compat.multi_tensor_applier and amp_C is compat.amp_c
assert LARC is LARC2 is compat.LARC and apex.parallel.LARC is compat.LARC  # the class, not the module
assert FusedLayerNorm is compat.FusedLayerNorm and FusedRMSNorm is compat.FusedRMSNorm
assert fused_layer_norm_affine is compat.fused_layer_norm_affine
assert apex.normalization.fused_layer_norm is compat.normalization
# Apex's own call shape, end to end through the alias.
noop = torch.zeros(1, dtype=torch.int32)
norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [[torch.full((4,), 2.0)]], False)
assert norm.item() == 4.0 and noop.item() == 0
for name in ("DistributedDataParallel", "SyncBatchNorm", "convert_syncbn_model"):
    try:
        exec(f"from apex.parallel import {name}")
        raise SystemExit(name + " must not import")
    except ImportError as e:
        assert "not provided by mixprec" in str(e) and "torch" in str(e), e
print("IMPORTS-OK")
'''


def test_alias_resolves_megatron_era_modules_and_disable_forgets_them(tmp_path):
    r = run_python("import mixprec, sys\nassert mixprec.enable_apex_alias()\n" + MEGATRON_IMPORTS + textwrap.dedent('''
        import apex
        assert apex.multi_tensor_apply is sys.modules["apex.multi_tensor_apply"]
        mixprec.apex_alias.disable_apex_alias()
        names = ("apex", "amp_C", "apex.parallel", "apex.parallel.LARC", "apex.normalization",
                 "apex.normalization.fused_layer_norm", "apex.multi_tensor_apply")
        assert not [n for n in names if n in sys.modules], [n for n in names if n in sys.modules]
        for name in names:
            try:
                __import__(name)
                raise SystemExit(name + " still imports")
            except ModuleNotFoundError:
                pass
        print("FORGOTTEN")
    '''), tmp_path, {"MIXPREC_APEX_ALIAS": "0"})
    assert r.returncode == 0 and "IMPORTS-OK" in r.stdout and "FORGOTTEN" in r.stdout, r.stdout + r.stderr


def test_amp_c_needs_the_opt_in_and_never_shadows_a_real_apex(tmp_path):
    r = run_python('''
        import mixprec
        try:
            import amp_C
            raise SystemExit("amp_C must be absent without the opt-in")
        except ModuleNotFoundError:
            print("ABSENT")
    ''', tmp_path, {"MIXPREC_APEX_ALIAS": "0"})
    assert r.returncode == 0 and "ABSENT" in r.stdout, r.stderr
    real = tmp_path / "site" / "apex"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    r = run_python('''
        import mixprec.apex_alias as alias
        assert alias.enable_apex_alias() is False
        import apex
        for name in ("amp_C", "apex.parallel", "apex.normalization"):
            try:
                __import__(name)
                raise SystemExit(name + " must come from the real apex or nowhere")
            except ModuleNotFoundError:
                pass
        print("REAL-ONLY")
    ''', tmp_path, {"MIXPREC_APEX_ALIAS": "1"}, pythonpath=str(tmp_path / "site"))
    assert r.returncode == 0 and "REAL-ONLY" in r.stdout, r.stderr


def test_env_var_alias_serves_amp_c_imported_first(tmp_path):
    # Megatron imports amp_C before apex in some files: the start-up hook answers amp_C too.
    r = run_python(pth_prelude(tmp_path) + textwrap.dedent('''
        import sys
        import amp_C
        assert "mixprec" in sys.modules and amp_C.__name__ == "mixprec.apex_compat.amp_c"
    ''') + MEGATRON_IMPORTS, tmp_path, {"MIXPREC_APEX_ALIAS": "1"})
    assert r.returncode == 0 and "IMPORTS-OK" in r.stdout and not r.stderr, r.stdout + r.stderr
