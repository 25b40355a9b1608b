#!/usr/bin/env bash
# CI's check of scripts/build_wheel.sh: builds the wheel, installs it into a clean venv that has
# only the same torch (from pip's usual sources) and the wheel's own dependencies, and runs an op
# and a fused optimizer step there, away from the source tree. Needs scripts/setup.sh's .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-${MIXPREC_VENV:-.venv}/bin/python}
work=$(mktemp -d -t mixprec-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
start=$SECONDS
PYTHON=$PY ./scripts/build_wheel.sh "$work/dist"
torch_version=$("$PY" -c 'import torch; print(torch.__version__)')
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q "torch==$torch_version" "$work"/dist/mixprec-*.whl
cd "$work"  # not the source tree: its python/ folder must not shadow the installed package
"$work/venv/bin/python" - <<'PY'
import torch, mixprec
from mixprec.optimizers import FusedAdam
assert "site-packages" in mixprec.__file__, mixprec.__file__
p = torch.nn.Parameter(torch.ones(4))
p.grad = torch.full((4,), 0.5)
FusedAdam([p], lr=0.1).step()
assert torch.allclose(p.detach(), torch.full((4,), 0.9)), p
found = torch.zeros(1)
mixprec.non_finite_check_and_unscale_([torch.tensor([1.0, float("inf")])], found, torch.ones(1))
assert found.item() == 1.0
print(f"[check_wheel] mixprec {mixprec.__version__} from the wheel imports and steps with torch {torch.__version__}")
PY
echo "[check_wheel] done in $((SECONDS - start)) s"
