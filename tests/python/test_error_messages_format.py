# The error-message rule of csrc/ops/format.h: no number or shape reaches std::ostream inside libmixprec
# (a crash in std::num_put on the H200 toolchain). Checks that csrc reports errors only through the
# MIXPREC_CHECK* macros, that those refuse non-text message arguments at compile time, and that the
# num()/shape() messages read right.
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import random_tensors

REPO = Path(__file__).resolve().parents[2]
FORMAT_H = REPO / "csrc" / "ops" / "format.h"

# What csrc must not use: torch's check, warning and string macros (they stream their message
# arguments unchecked; format.h wraps the checks) and std::ostream in any form.
UNCHECKED = re.compile(r"\b(?:TORCH_(?:CHECK|WARN|INTERNAL_ASSERT|DCHECK)\w*|AT_(?:ERROR|ASSERTM?)|(?:c10|at)::str"
                       r"|std::(?:c(?:out|err|log)|format)|fmt::\w+|(?:basic_)?(?:(?:i|o|io)(?:string|f)?|string|f)stream)\b"
                       r"|#\s*include\s*<\w*stream>")
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def unchecked_uses(text: str) -> list[tuple[int, str]]:
    """(line, token) of every use of UNCHECKED outside comments."""
    code = COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)
    return [(code.count("\n", 0, m.start()) + 1, m.group()) for m in UNCHECKED.finditer(code)]


def test_csrc_reports_errors_through_the_checked_macros_only():
    sources = [p for p in sorted((REPO / "csrc").rglob("*")) if p.suffix in {".h", ".cpp", ".cu", ".cuh"}]
    found = [f"{p.relative_to(REPO)}:{line}: {token}" for p in sources if p != FORMAT_H
             for line, token in unchecked_uses(p.read_text())]
    assert not found, "use MIXPREC_CHECK* (csrc/ops/format.h) instead:\n" + "\n".join(found)


@pytest.mark.parametrize("code", [
    'TORCH_CHECK_VALUE(ok, "got ", n);', "TORCH_CHECK(ok);", "TORCH_CHECK_EQ(n, 3);", 'TORCH_WARN("lr ", lr);',
    "TORCH_INTERNAL_ASSERT(ok);", 'TORCH_CHECK_WITH(IndexError, ok, "i");', 'AT_ERROR("x");',
    'auto m = c10::str("n ", n);', "std::ostringstream os;", "std::cout << n;", "#include <sstream>",
    "void f(std::ostream& os);", 'auto s = std::format("{}", n);'])
def test_unchecked_use_is_reported(code):
    uses = unchecked_uses("int x;\n" + code)
    assert uses and {line for line, _ in uses} == {2}


def test_comments_and_checked_macros_are_not_reported():
    assert unchecked_uses('// TORCH_CHECK(ok, n)\nMIXPREC_CHECK_VALUE(ok, "a");\n/* std::cout\n c10::str */ x;') == []


# ---- the compile-time check: snippets through the system compiler, with torch's headers ---------

# Parameters of every snippet: the types error messages meet in csrc (a Tensor's sizes(), numel(),
# device(), scalar_type() and dtype() are these), and an ops-tier helper returning std::string.
SIGNATURE = ("const std::string& what, const char* op, double lr, int64_t n, size_t i, bool ok, float f, "
             "uint8_t byte, c10::IntArrayRef sizes, c10::SymIntArrayRef sym_sizes, c10::SymInt s, "
             "std::optional<int64_t> opt, c10::Device device, c10::ScalarType dtype, caffe2::TypeMeta meta, "
             "c10::Layout layout, const std::vector<int64_t>& v, const std::string* p")
PRELUDE = """#include "ops/format.h"
#include <c10/core/Layout.h>
#include <c10/util/typeid.h>
#include <optional>
#include <vector>
using namespace mixprec::detail;
std::string arg_name(const char* op, const char* arg, int64_t index = -1);
"""

# Each must fail to compile, at its own line.
REFUSED = [
    'MIXPREC_CHECK_VALUE(n > 0, what, " must be positive, got ", n);',
    'MIXPREC_CHECK_VALUE(lr >= 0, arg_name("sgd_", "lr"), " got ", lr);',
    'MIXPREC_CHECK_INDEX(i < 3, what, " index ", i, " out of range");',
    'MIXPREC_CHECK(ok, what, " flag ", ok);',
    'MIXPREC_CHECK_TYPE(ok, what, " got ", f);',
    'MIXPREC_CHECK(ok, what, " byte ", byte);',
    'MIXPREC_CHECK_VALUE(ok, what, " has shape ", sizes);',
    'MIXPREC_CHECK_VALUE(ok, what, " has shape ", sym_sizes);',
    'MIXPREC_CHECK(ok, what, " size ", s);',
    'MIXPREC_CHECK(ok, what, " got ", n + 1);',
    'MIXPREC_CHECK(ok, what, " got ", *opt);',
    'MIXPREC_CHECK_VALUE(ok, what, " has ", v.size(), " entries");',
    'const auto k = sizes[0]; MIXPREC_CHECK(ok, what, " k ", k);',
    'MIXPREC_CHECK_TYPE(ok, what, " dtype ", meta);',
    'MIXPREC_CHECK(ok, what, " layout ", layout);',
    'MIXPREC_CHECK(ok, what, " at ", p);',
    'MIXPREC_INTERNAL_ASSERT(ok, "bad index ", i);',
    'MIXPREC_CHECK_VALUE(ok, what,\n                    " has ", n);',
]
# Each must compile: text, the format.h helpers, and the types whose operator<< writes text only.
ACCEPTED = [
    'MIXPREC_CHECK(ok, "mixprec::sgd_: ", "a, b (c)", \'x\');',
    'MIXPREC_CHECK_VALUE(ok, arg_name("sgd_", "lr"), " got ", num(lr), " shape ", shape(sizes), " sym ",'
    ' shape(sym_sizes), " n ", num(n), " s ", num(s), " i ", num(i), " f ", num(f));',
    'const std::string w = what + ": x"; MIXPREC_CHECK(ok, w, op, what, std::string_view("v"));',
    'MIXPREC_CHECK_TYPE(ok, what, " is on ", device, " ", device.str(), " dtype ", dtype);',
    'MIXPREC_CHECK(ok, what, ok ? " or bfloat16" : "");',
    'MIXPREC_CHECK(ok, what + " (" + std::to_string(n) + ")");',
    "MIXPREC_CHECK(n == 3 && lr < 1.0 && sizes.size() == i);",
    'MIXPREC_CHECK_INDEX(i < 3, "index ", num(i), " of ", op);',
    "MIXPREC_INTERNAL_ASSERT(!sizes.empty());",
]


def compile_snippets(tmp_path: Path, bodies: list[str]) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Compiles each body in a function of its own (syntax only); returns the result and each body's line."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    lines, text = [], PRELUDE
    for k, body in enumerate(bodies):
        text += f"void f{k}({SIGNATURE}) {{\n"
        lines.append(text.count("\n") + 1)
        text += body + "\n}\n"
    (tmp_path / "snippet.cpp").write_text(text)
    # ATen's headers need C++20 from torch 2.14 on (CMakeLists.txt makes the same choice).
    std = "c++20" if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 14) else "c++17"
    include = Path(torch.__file__).parent / "include"
    cmd = [cxx, f"-std={std}", "-fsyntax-only", "-I", str(REPO / "csrc"), "-I", str(include), "snippet.cpp"]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True), lines


def test_checked_macros_refuse_non_text_arguments_at_compile_time(tmp_path):
    result, lines = compile_snippets(tmp_path, ACCEPTED + REFUSED)
    reported = {int(n) for n in re.findall(r"^snippet\.cpp:(\d+):", result.stderr, re.M)}
    refused = set(lines[len(ACCEPTED):])
    assert result.returncode != 0
    # Every refused call is named, no accepted one is, and each failure is format.h's own check.
    assert reported == refused, result.stderr[-4000:]
    assert result.stderr.count("an error-message argument is not text") == len(REFUSED), result.stderr[-4000:]


def test_checked_macros_compile_the_accepted_arguments(tmp_path):
    result, _ = compile_snippets(tmp_path, ACCEPTED)
    assert result.returncode == 0, result.stderr[-4000:]


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
    with pytest.raises(ValueError, match=r"mixprec::novograd_: grads has 1 tensors but params has 2$"):
        mixprec.novograd_(params, grads[:1], avgs, norms, **NOVOGRAD_HP)
    with pytest.raises(ValueError, match=r"mixprec::novograd_: exp_avg_sq_norms must have shape \[2\] .*got \[3, 1\]"):
        mixprec.novograd_(params, grads, avgs, torch.zeros(3, 1, device=device), **NOVOGRAD_HP)
