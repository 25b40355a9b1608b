# libmixprec exports its public C++ API and nothing else: symbols are hidden by default and the
# public headers mark the API with MIXPREC_API (csrc/include/mixprec/export.h, CMakeLists.txt).
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PUBLIC_HEADERS = sorted((REPO / "csrc" / "include" / "mixprec").rglob("*.h"))
# Namespaces of the implementation: the kernel tier, the ops tier's helpers, the options classes'
# internals and every anonymous namespace.
INTERNAL = re.compile(r"mixprec::(?:fp8::)?(?:kernels|detail|optim::internal)\b|\(anonymous namespace\)")
# ops.h's inline kLinkedAgainstTorch references it, so every C++ client links libmixprec (whose
# static initializers register the ops) even under --as-needed: public, though in detail.
PUBLIC_IN_DETAIL = {"mixprec::detail::built_torch_version()"}


def dynamic_symbols(path, *flags: str) -> set[str]:
    """Demangled names in the dynamic symbol table of `path` (nm -D), without addresses and kinds."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run([nm, "-D", "-C", *flags, str(path)], check=True, capture_output=True, text=True).stdout
    # "<address> T name" for defined symbols, "         U name" (no address) for undefined ones.
    return {m.group(1) for m in re.finditer(r"^\s*(?:[0-9a-f]+ )?\S (.+)$", out, re.M)}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    from mixprec import _library

    return dynamic_symbols(_library.library_path(), "--defined-only")


def annotated_names() -> tuple[set[str], set[str]]:
    """The classes and the functions the public headers mark MIXPREC_API (operators as operator<<)."""
    text = "\n".join(p.read_text() for p in PUBLIC_HEADERS)
    classes = set(re.findall(r"\b(?:class|struct)\s+MIXPREC_API\s+(\w+)", text))
    # MIXPREC_FUSED_PARAM_STATE(Name, ...) declares each family's MIXPREC_API state struct `Name`.
    classes |= set(re.findall(r"^MIXPREC_FUSED_PARAM_STATE\((\w+),", text, re.M)) - {"Name"}
    functions = set(re.findall(r"^\s*MIXPREC_API\s[^;{(]*?\b(operator\W+|\w+)\s*\(", text, re.M))
    return classes - {"Name"}, functions


def entity(symbol: str) -> str:
    """The mixprec name a symbol belongs to: 'mixprec::optim::FusedAdam' for its methods and
    vtable, 'mixprec::amp::initialize' for the function (template arguments and parameters cut)."""
    name = re.sub(r"^(?:vtable|typeinfo(?: name)?|VTT|construction vtable|guard variable) for ", "", symbol)
    name = re.sub(r"\[abi:\w+\]", "", name)  # a std::string return's ABI tag: ineligibility[abi:cxx11]
    operator = re.match(r"([\w:]*\boperator\W+?)\(", name)  # operator<< is no template
    if operator:
        return operator.group(1)
    depth, out = 0, ""
    for c in name:  # drop template arguments, then stop at the parameter list
        depth += c == "<"
        if depth == 0 and c == "(":
            break
        if depth == 0:
            out += c
        depth -= c == ">" and depth > 0
    return out.strip()


def test_no_internal_symbol_is_exported(exported):
    leaked = sorted(s for s in exported if INTERNAL.search(entity(s)) and s not in PUBLIC_IN_DETAIL)
    assert not leaked, f"{len(leaked)} internal symbols exported, e.g.:\n" + "\n".join(leaked[:20])


def test_every_exported_mixprec_symbol_is_marked_public(exported):
    classes, functions = annotated_names()
    unmarked = []
    for s in sorted(exported):
        parts = entity(s).split("::")
        if parts[0] != "mixprec" or s in PUBLIC_IN_DETAIL:
            continue
        # mixprec[::amp|::optim|::fp8]::Name[::member]: Name must be a MIXPREC_API class or function.
        name = next(p for p in parts[1:] if p not in {"amp", "optim", "fp8"})
        if name not in classes and name not in functions:
            unmarked.append(s)
    assert not unmarked, "exported but not MIXPREC_API in csrc/include:\n" + "\n".join(unmarked[:20])


def test_every_marked_function_is_exported(exported):
    _, functions = annotated_names()
    names = {entity(s).split("::")[-1] for s in exported}
    assert functions and functions <= names, sorted(functions - names)


@pytest.mark.parametrize("binary", [
    os.path.join(os.environ.get("MIXPREC_CPP_TEST_BUILD_DIR", "build/tests-cpp"), "mixprec_tests"),
    os.path.join(os.environ.get("MIXPREC_CPP_TEST_BUILD_DIR", "build/tests-cpp"), "mixprec_conformance"),
    os.path.join(os.environ.get("MIXPREC_CPP_EXAMPLE_BUILD_DIR", "build/examples-cpp"), "train_amp"),
])
def test_cpp_clients_find_every_mixprec_symbol_they_use(exported, binary):
    # The GoogleTest suite, the conformance driver and the C++ example, as scripts/test.sh builds them
    # against the installed package: what they import from mixprec must be exported by this library.
    path = REPO / binary
    if not path.is_file():
        pytest.skip(f"{binary} is not built (scripts/test.sh builds it)")
    used = {s for s in dynamic_symbols(path, "--undefined-only") if "mixprec::" in s}
    assert used, f"{binary} uses nothing of libmixprec"
    assert used <= exported, sorted(used - exported)[:20]
