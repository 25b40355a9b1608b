#!/usr/bin/env bash
# Runs Apex's own L0 tests (carried, unchanged, in the git-ignored .apex-tests/) against mixprec's apex alias: a measurement.
#
# The tests are not in the repository (Apex's code stays out of it): they are fetched by hand into
# .apex-tests/ keeping Apex's layout (tests/L0/run_amp/..., see tests/apex_l0/MANIFEST.txt for the
# files, their Apex commits and sha256), and carried to the GPU machine with the working tree.
# Usage: scripts/run_apex_l0.sh [extra pytest args]. Writes $OUT/apex_l0.xml (JUnit) and
# $OUT/apex_l0.txt; OUT defaults to out/. Exits 0 whatever the tests do (a figure, not a gate),
# but non-zero when the set-up is wrong: missing files, a checksum that differs, or `import apex`
# finding anything but mixprec's alias.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-${PYTHON:-python3}}  # as scripts/gpu_session.sh: the machine's python3 and its torch
OUT=${OUT:-out}
mkdir -p "$OUT"
SRC=.apex-tests
MANIFEST=tests/apex_l0/MANIFEST.txt

[ -d "$SRC/tests/L0" ] || { echo "run_apex_l0: no $SRC/tests/L0 (see $MANIFEST)" >&2; exit 2; }
# Every file in the manifest, byte for byte as fetched.
bad=0
while read -r path _commit sha; do
  case "$path" in ''|'#'*) continue ;; esac
  got=$(sha256sum "$SRC/$path" 2>/dev/null | cut -d' ' -f1)
  if [ "$got" != "$sha" ]; then echo "run_apex_l0: $SRC/$path missing or changed" >&2; bad=1; fi
done < "$MANIFEST"
[ "$bad" = 0 ] || exit 2

export MIXPREC_APEX_ALIAS=1
# Apex's test_adam.py and run_fused_layer_norm import torch.testing._internal, which needs
# expecttest; the GPU machine has no network, so its pure-Python wheel is carried in
# $SRC/wheels (fetched with `pip download --no-deps expecttest -d .apex-tests/wheels`) and put on
# the path as a zip, without installing anything there.
if ! $PY -c 'import expecttest' 2>/dev/null; then
  for whl in "$SRC"/wheels/expecttest-*.whl; do
    [ -f "$whl" ] && export PYTHONPATH="$PWD/$whl${PYTHONPATH:+:$PYTHONPATH}"
  done
fi
# `import apex` must be mixprec's stand-in, and amp_C too; a real Apex would make this a run of Apex.
$PY - <<'EOF' || exit 3
import apex, amp_C, apex.amp
assert getattr(apex, "__mixprec_alias__", False), f"import apex found a real Apex: {apex!r}"
assert apex.amp.__name__ == "mixprec.amp", apex.amp
assert amp_C.__name__ == "mixprec.apex_compat.amp_c", amp_C
print("run_apex_l0: apex ->", apex.__doc__)
EOF

dirs=()
for d in run_amp run_optimizers run_fused_layer_norm; do
  [ -d "$SRC/tests/L0/$d" ] && dirs+=("$SRC/tests/L0/$d")
done
# Each directory in its own process, as Apex's run_test.py does: the amp tests set a CUDA default
# tensor type and patch torch, and test_adam's import of torch.testing._internal locks the cudnn
# flags that test_checkpointing sets; in one process these would leak from one directory into the next.
status=0
for d in "${dirs[@]}"; do
  name=$(basename "$d")
  $PY -m pytest "$d" -p no:cacheprovider --continue-on-collection-errors -q -rA --junitxml="$OUT/apex_l0_$name.xml" "$@" \
    2>&1 | tee "$OUT/apex_l0_$name.txt"
  rc=${PIPESTATUS[0]}
  # pytest: 0 all passed, 1 some failed, 5 none collected (run_fused_layer_norm instantiates its
  # tests for CUDA only); anything else (2-4) is a broken run, not a measurement.
  if [ "$rc" -gt 1 ] && [ "$rc" -ne 5 ]; then echo "run_apex_l0: pytest exited $rc on $d" >&2; status=4; fi
done
echo "run_apex_l0: summaries"
for d in "${dirs[@]}"; do
  name=$(basename "$d")
  echo "$name: $(tail -n 1 "$OUT/apex_l0_$name.txt")"
done | tee "$OUT/apex_l0.txt"
exit $status
