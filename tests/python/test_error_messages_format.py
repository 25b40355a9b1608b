# Guard against error messages in csrc/ that stream numbers or shapes through std::ostream (a crash in
# std::num_put on the H200 toolchain), and checks that the string-formatted messages read right.
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from conftest import random_tensors
from error_format_scan import scan_source, scan_tree, split_top

REPO = Path(__file__).resolve().parents[2]

# A header declaring the names the snippets below use, as a real source would include it.
DECLS = """
struct NamedList { const char* name; at::TensorList tensors; };
std::string arg_name(const char* op, const char* arg, int64_t index = -1);
"""


def scan(body: str) -> list:
    """Violations in a function body placed at line 2 of a source (line 1 declares its parameters)."""
    src = ("void f(const std::string& what, const at::Tensor& t, double lr, int64_t n, size_t i, bool ok,\n"
           "       const at::Device& device, c10::SymInt s, const NamedList& l) {\n" + body + "\n}\n")
    return scan_source(src, "planted.cpp", DECLS)


def test_csrc_streams_no_number_into_an_error_message():
    violations = scan_tree(REPO)
    assert not violations, (
        "error-message arguments that std::ostream would format (wrap numbers in num(), shapes in shape(), "
        "csrc/ops/format.h):\n" + "\n".join(map(str, violations)))


# Each planted line streams a number or a shape and must be reported at its own line (3).
PLANTED = {
    "int64": 'TORCH_CHECK_VALUE(n > 0, what, " must be positive, got ", n);',
    "double": 'TORCH_CHECK_VALUE(lr >= 0, arg_name("sgd_", "lr"), " got ", lr);',
    "size_t": 'TORCH_CHECK_INDEX(i < 3, what, " index ", i, " out of range");',
    "bool": 'TORCH_CHECK(ok, what, " flag ", ok);',
    "sizes": 'TORCH_CHECK_VALUE(t.dim() == 1, what, " has shape ", t.sizes());',
    "sym_sizes": 'TORCH_CHECK_VALUE(t.dim() == 1, what, " has shape ", t.sym_sizes());',
    "numel": 'TORCH_CHECK_TYPE(t.numel() == 1, what, " has ", t.numel(), " elements");',
    "symint": 'TORCH_CHECK(false, what, " size ", s);',
    "member_size": 'TORCH_CHECK_VALUE(false, arg_name("x", l.name), " has ", l.tensors.size(), " tensors");',
    "auto_from_number": 'const auto k = t.numel();\nTORCH_CHECK(false, what, " k ", k);',
    "ternary_branch": 'TORCH_CHECK(ok, what, ok ? " none" : n);',
    "arithmetic": 'TORCH_CHECK(ok, what, " got ", n + 1);',
    "deref_optional": 'TORCH_CHECK(ok, what, " got ", *opt);',
    "c10_str": 'const std::string m = c10::str("step ", n);',
    "warn": 'TORCH_WARN("lr is ", lr);',
    "internal_assert": 'TORCH_INTERNAL_ASSERT(ok, "bad index ", i);',
    "check_eq": "TORCH_CHECK_EQ(n, 3);",
    "check_with": 'TORCH_CHECK_WITH(IndexError, ok, what, " index ", i);',
    "ostringstream": 'std::ostringstream os; os << n;',
    "multi_line": 'TORCH_CHECK_VALUE(ok, what,\n                  " has ", n);',
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_guard_reports_a_planted_number(name):
    violations = scan(PLANTED[name])
    assert violations, f"planted {name!r} line was not reported"
    assert {v.path for v in violations} == {"planted.cpp"}
    assert all(v.line >= 3 and v.arg in " ".join(PLANTED[name].split()) for v in violations), list(map(str, violations))


# Arguments that are strings already, or types whose operator<< is safe (csrc/ops/format.h says why).
SAFE = {
    "literals": 'TORCH_CHECK(ok, "mixprec::sgd_: ", "a, b (c)", \'x\');',
    "helpers": 'TORCH_CHECK_VALUE(ok, arg_name("sgd_", "lr"), " got ", num(lr), " shape ", shape(t.sizes()),'
               ' " sym ", detail::shape(t.sym_sizes()), " n ", mixprec::detail::num(n));',
    "string_variables": 'const std::string w = what + ": x";\nconst char* op = "sgd_";\nTORCH_CHECK(ok, w, op, what);',
    "member_name": 'TORCH_CHECK(ok, l.name, " is empty");',
    "device_dtype": 'TORCH_CHECK(ok, what, " is on ", t.device(), " ", device.str(), " dtype ", t.scalar_type());',
    "ternary_of_literals": 'TORCH_CHECK(ok, what, ok ? " or bfloat16" : "");',
    "concatenation": 'TORCH_CHECK(ok, what + " (" + std::to_string(n) + ")");',
    "auto_string": 'const auto w = arg_name("sgd_", "lr");\nTORCH_CHECK(ok, w);',
    "condition_only_numbers": 'TORCH_CHECK(n == 3 && lr < 1.0, "bad");',
}


@pytest.mark.parametrize("name", sorted(SAFE))
def test_guard_accepts_string_arguments(name):
    assert scan(SAFE[name]) == []


def test_guard_fails_on_a_planted_line_in_a_copy_of_csrc(tmp_path):
    """The real tree scanned from a temporary copy, with the sgd_ crash site of the H200 run undone."""
    shutil.copytree(REPO / "csrc", tmp_path / "csrc")
    assert scan_tree(tmp_path) == []
    path = tmp_path / "csrc" / "ops" / "sgd.cpp"
    text = path.read_text()
    fixed = '" must be finite, got ", num(dampening));'
    assert fixed in text
    path.write_text(text.replace(fixed, '" must be finite, got ", dampening);'))
    line = text[:text.index(fixed)].count("\n") + 1
    # The violation names the line the macro starts on; the argument sits on it or just below.
    start = max(i + 1 for i, s in enumerate(text.splitlines()[:line]) if "TORCH_CHECK" in s)
    assert [(v.path, v.line, v.arg) for v in scan_tree(tmp_path)] == [("csrc/ops/sgd.cpp", start, "dampening")]


def test_split_top_keeps_nested_commas_and_literals():
    assert split_top('a, f(b, c), "d, e", x[1, 2], {g, h}') == ["a", "f(b, c)", '"d, e"', "x[1, 2]", "{g, h}"]


# ---- the messages themselves, built through the helpers (the H200 run's crash sites) -----------


def _sgd_operands(device, gen, n=2):
    params = random_tensors([5] * n, [torch.float32] * n, device, gen)
    grads = random_tensors([5] * n, [torch.float32] * n, device, gen)
    bufs = random_tensors([5] * n, [torch.float32] * n, device, gen)
    return params, grads, bufs


def test_sgd_dampening_message_formats_nan(device, gen):
    import mixprec

    params, grads, bufs = _sgd_operands(device, gen)
    with pytest.raises(ValueError, match=r"mixprec::sgd_: dampening must be finite, got nan"):
        mixprec.sgd_(params, grads, bufs, lr=0.1, momentum=0.9, dampening=math.nan, step=1)


def test_sgd_nesterov_message_formats_shortest_decimals(device, gen):
    import mixprec

    params, grads, bufs = _sgd_operands(device, gen)
    # 0.9 and 0.1 as Python prints them, not 0.90000000000000002 (%.17g) or 0.9 rounded to 6 digits.
    with pytest.raises(ValueError, match=r"mixprec::sgd_: nesterov requires .*got momentum 0\.9 and dampening 0\.1$"):
        mixprec.sgd_(params, grads, bufs, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True, step=1)


def test_sgd_meta_length_message_formats_sizes(gen):
    import mixprec

    params = [torch.empty(5, device="meta") for _ in range(3)]
    with pytest.raises(ValueError, match=r"mixprec::sgd_: grads has 2 tensors but params has 3"):
        mixprec.sgd_(params, params[:2], [], lr=0.1, step=1)
    # The one Meta kernel of every optimizer op checks lengths only (which lists may be empty is
    # the impls' rule).
    with pytest.raises(ValueError, match=r"mixprec::sgd_: momentum_buffers has 1 tensors but params has 3"):
        mixprec.sgd_(params, params, params[:1], lr=0.1, momentum=0.5, step=1)


NOVOGRAD_HP = dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, step=1)


def test_novograd_messages_format_counts_shapes_and_norm_type(device, gen):
    import mixprec

    params, grads, avgs = _sgd_operands(device, gen)
    norms = torch.zeros(2, device=device)
    with pytest.raises(ValueError, match=r"mixprec::novograd_: norm_type must be 2 or inf, got 1\.5 "):
        mixprec.novograd_(params, grads, avgs, norms, norm_type=1.5, **NOVOGRAD_HP)
    with pytest.raises(ValueError, match=r"mixprec::novograd_: grads has 1 tensors but mixprec::novograd_: "
                                         r"params has 2$"):
        mixprec.novograd_(params, grads[:1], avgs, norms, **NOVOGRAD_HP)
    with pytest.raises(ValueError, match=r"mixprec::novograd_: exp_avg_sq_norms must have shape \[2\] .*got \[3, 1\]"):
        mixprec.novograd_(params, grads, avgs, torch.zeros(3, 1, device=device), **NOVOGRAD_HP)
