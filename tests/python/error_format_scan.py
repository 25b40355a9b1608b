# Source scanner behind test_error_messages_format.py: finds every error-message argument in csrc/
# that would reach std::ostream's number formatting (std::num_put) inside libmixprec.
"""Why: on the H200 machine (GCC 13.3, torch 2.11, in a Python process) any number or IntArrayRef that
code compiled into libmixprec streams through std::ostream crashed in std::num_put, so a ValueError
became a segfault. TORCH_CHECK*, TORCH_WARN*, TORCH_INTERNAL_ASSERT* and c10::str stream their message
arguments through an ostringstream instantiated in our library, so each argument must be a string
already: a literal, a call of the helpers in csrc/ops/format.h, or an expression on the allowlist
below. Streams used directly (ostringstream, std::cout, ...) are banned outright.

The scanner is textual, not a compiler: it errs on the side of reporting. Anything it cannot prove
to be a string (or a type whose operator<< is known safe) is a violation naming file:line.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# Macros whose first argument is a condition and whose remaining arguments are streamed.
CHECK_MACROS = re.compile(r"\b(TORCH_CHECK(?:_VALUE|_TYPE|_INDEX|_NOT_IMPLEMENTED|_LINALG)?|TORCH_INTERNAL_ASSERT"
                          r"(?:_DEBUG_ONLY)?|AT_ASSERT|AT_ASSERTM)\s*\(")
# TORCH_CHECK_WITH(ErrorType, cond, ...): the message starts at the third argument.
CHECK_WITH = re.compile(r"\b(TORCH_CHECK_WITH(?:_MSG)?)\s*\(")
# Macros and functions that stream every argument.
STREAM_ALL = re.compile(r"\b(TORCH_WARN(?:_ONCE|_DEPRECATION)?|AT_ERROR|(?:c10|at)::str)\s*\(")
# Never allowed: they stream their (numeric) operands, or are streams themselves.
BANNED = re.compile(r"\b(TORCH_CHECK_(?:EQ|NE|LE|LT|GE|GT)|TORCH_DCHECK_\w+|std::(?:o|i)?stringstream|std::ostream"
                    r"|std::cout|std::cerr|std::clog|std::format|fmt::\w+)\b|#\s*include\s*<(?:sstream|iostream)>")
# `operator<<` may be declared only for torch's serialize archives, which are not std::ostreams.
OPERATOR_SHIFT = re.compile(r"\boperator\s*<<\s*\(([^,)]*)")

# Calls that return a std::string built without std::ostream (csrc/ops/format.h), or a std::string /
# const char* anyway: arg_name (mixprec's "op: arg[i]" prefix), std::to_string, c10::toString.
STRING_FUNCTIONS = {"num", "shape", "arg_name", "std::string", "std::to_string", "c10::toString",
                    "c10::DeviceTypeName"}
# Member calls whose result is safe to stream:
#   str()          c10::Device::str() and SymNode::str() return std::string
#   what()         std::exception::what() returns const char*
#   tagKind()      c10::IValue::tagKind() returns std::string
#   toStringRef()  c10::IValue's string payload
#   scalar_type()  c10::ScalarType: its operator<< is inline but streams a const char* (toString)
#   device()       c10::Device: its operator<< is defined out of line, in libc10
#   c_str()        const char*
#   msg()          c10::Error::msg() returns const std::string&
SAFE_METHODS = {"str", "what", "tagKind", "toStringRef", "scalar_type", "device", "c_str", "msg"}
# Declared types whose values stream safely (see SAFE_METHODS for why Device and ScalarType are).
STRING_TYPES = {"std::string", "string", "std::string_view", "c10::string_view", "c10::Device", "at::Device",
                "Device", "c10::ScalarType", "at::ScalarType", "ScalarType"}
KEYWORDS = {"return", "else", "case", "throw", "new", "delete", "co_return", "sizeof", "typedef", "using", "goto"}

STRING_LITERAL = r'(?:u8|u|U|L)?"(?:[^"\\\n]|\\.)*"'
LITERALS = re.compile(rf"\s*(?:{STRING_LITERAL}\s*)+")
CHAR_LITERAL = re.compile(r"'(?:[^'\\\n]|\\.)+'")


@dataclass
class Violation:
    path: str
    line: int
    arg: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.why}: {self.arg}"


TOKENS = re.compile(r"//[^\n]*|/\*.*?(?:\*/|\Z)|" + STRING_LITERAL + r"|'(?:[^'\\\n]|\\.)*'", re.S)


def strip_comments(src: str) -> str:
    """Blanks out comments, keeping string and char literals and every newline (so offsets map to lines)."""
    def blank(m: re.Match) -> str:
        t = m.group(0)
        return re.sub(r"[^\n]", " ", t) if t.startswith("/") else t
    return TOKENS.sub(blank, src)


def _skip_literal(s: str, i: int) -> int:
    """Index just past the string or char literal starting at s[i]."""
    q, j = s[i], i + 1
    while j < len(s) and s[j] != q:
        j += 2 if s[j] == "\\" else 1
    return j + 1


def _top_level(s: str, start: int = 0):
    """Yields (index, char, depth) for each character of s from `start` outside string and char
    literals; depth counts the brackets open after that character (an opening bracket counts)."""
    depth, i = 0, start
    while i < len(s):
        c = s[i]
        if c in "\"'":
            i = _skip_literal(s, i)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        yield i, c, depth
        i += 1


def matching_paren(s: str, open_index: int) -> int:
    """Index of the ')' closing the '(' at open_index (string literals and nesting respected)."""
    for i, c, depth in _top_level(s, open_index):
        if c in ")]}" and depth == 0:
            return i
    raise ValueError(f"unbalanced parenthesis at offset {open_index}")


def split_top(s: str, seps: str = ",") -> list[str]:
    """Splits s at the characters of `seps` that are outside brackets and literals."""
    parts, start = [], 0
    for i, c, depth in _top_level(s):
        if c in seps and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return [p.strip() for p in parts]


def _split_ternary(expr: str):
    """(cond, a, b) when expr is `cond ? a : b` at top level (`::` is not a colon), else None."""
    q = -1
    for i, c, depth in _top_level(expr):
        if depth == 0 and c == "?" and q < 0:
            q = i
        elif depth == 0 and c == ":" and q >= 0 and expr[i - 1] != ":" and expr[i + 1:i + 2] != ":":
            return expr[:q], expr[q + 1:i], expr[i + 1:]
    return None


def _whole_call(expr: str):
    """(callee, args) when expr is exactly `callee(args)`, else None."""
    m = re.match(r"([A-Za-z_][\w:]*(?:\s*(?:\.|->)\s*[A-Za-z_]\w*)*)\s*\(", expr)
    if not m or matching_paren(expr, m.end() - 1) != len(expr) - 1:
        return None
    return m.group(1), expr[m.end():-1]


def _type_is_safe(typ: str, marks: str) -> bool:
    return (typ == "char" and "*" in marks) or typ in STRING_TYPES


# What stands before a declared name: its type, any const, * and &, and a qualifier (Class::name).
TYPE_BEFORE = re.compile(r"(?:^|[^\w:])([A-Za-z_][\w:]*(?:<[^<>;(){}]*>)?)\s*((?:const\b|[*&\s])*)(?:\w+::)*$")


def _declarations(text: str, name: str, after: str):
    """(type, marks, match of `after`) for each occurrence of `name` that a type precedes and `after` follows."""
    follow = re.compile(after)
    for m in re.finditer(rf"\b{re.escape(name)}\b", text):
        before = TYPE_BEFORE.search(text, max(0, m.start() - 160), m.start())
        f = follow.match(text, m.end())
        if before and f and before.group(1) not in KEYWORDS and before.group(1) != "const":
            yield before.group(1), re.sub(r"const|\s", "", before.group(2)), f


def _declared_type(text: str, name: str):
    """(type, pointer/reference marks, initializer) of the last declaration of variable or member `name`."""
    found = None
    for found in _declarations(text, name, r"\s*(=(?!=)[^;]*|[;,)\[{(:])"):
        pass
    if found is None:
        # TORCH_ARG(T, x) declares the member x_ (and the accessor x(), see _return_types).
        arg = re.findall(rf"\bTORCH_ARG\(\s*([^,]+?)\s*,\s*{re.escape(name[:-1])}\s*\)", text) if name.endswith("_") else []
        return (arg[-1], "", "") if arg else None
    typ, marks, f = found
    init = f.group(1)[1:].strip() if f.group(1).startswith("=") else ""
    return typ, marks, init


def _return_types(text: str, name: str) -> list[tuple[str, str]]:
    """(type, marks) of every declaration of function `name` in text, TORCH_ARG accessors included."""
    out = [(t, m) for t, m, _ in _declarations(text, name, r"\s*\(")]
    out += [(m.group(1).strip(), "") for m in re.finditer(rf"\bTORCH_ARG\(\s*([^,]+?)\s*,\s*{re.escape(name)}\s*\)", text)]
    return out


def why_unsafe(expr: str, visible: str, depth: int = 0):
    """None when streaming `expr` is safe; else the reason. `visible` is the source text (included
    project headers, then the file up to the use) whose declarations say what names are."""
    expr = expr.strip()
    while expr.startswith("(") and matching_paren(expr, 0) == len(expr) - 1:
        expr = expr[1:-1].strip()
    if not expr:
        return "empty argument"
    if LITERALS.fullmatch(expr) or CHAR_LITERAL.fullmatch(expr):
        return None
    tern = _split_ternary(expr)
    if tern:
        return why_unsafe(tern[1], visible, depth) or why_unsafe(tern[2], visible, depth)
    pieces = split_top(expr, "+")
    if len(pieces) > 1:  # std::string concatenation: every operand must be a string
        bad = [p for p in pieces if why_unsafe(p, visible, depth)]
        return f"concatenation with non-string operand {bad[0]}" if bad else None
    method = re.search(r"(?:\.|->)\s*(\w+)\s*\(\s*\)$", expr)
    if method and method.group(1) in SAFE_METHODS:
        return None
    call = _whole_call(expr)
    if call:
        callee = re.sub(r"\s+", "", call[0])
        if re.sub(r"^(?:mixprec::)?(?:detail::)?", "", callee) in STRING_FUNCTIONS or callee in STRING_FUNCTIONS:
            return None
        last = re.split(r"\.|->|::", callee)[-1]
        types = _return_types(visible, last)
        if types and all(_type_is_safe(t, m) for t, m in types):
            return None
        return f"{callee}() returns {types[0][0] + types[0][1] if types else 'something undeclared here'}"
    if re.fullmatch(r"[A-Za-z_][\w:]*(?:\s*(?:\.|->)\s*[A-Za-z_]\w*)*", expr):
        name = re.split(r"\.|->", expr)[-1].strip()
        decl = _declared_type(visible, name)
        if decl is None:
            return "no declaration found"
        typ, marks, init = decl
        if _type_is_safe(typ, marks):
            return None
        if typ == "auto" and init and depth < 4 and why_unsafe(init, visible, depth + 1) is None:
            return None
        return f"declared as {typ}{marks}"
    return "not a string literal, a format.h helper call or an allowlisted expression"


def project_headers(text: str, root: Path, seen: set[Path] | None = None) -> str:
    """The text of the project headers `text` includes, recursively (csrc/ and csrc/include/)."""
    seen = set() if seen is None else seen
    out = []
    for inc in re.findall(r'#\s*include\s*[<"]([^>"]+)[>"]', text):
        for base in (root / "csrc", root / "csrc" / "include"):
            p = base / inc
            if p.is_file() and p not in seen:
                seen.add(p)
                body = p.read_text()
                out.append(project_headers(body, root, seen))
                out.append(strip_comments(body))
                break
    return "\n".join(out)


def scan_source(text: str, path: str = "<string>", headers: str = "") -> list[Violation]:
    """Every unsafe message argument, banned stream use and stray operator<< in one C++ source;
    `headers` is the text of the project headers it includes (for declarations)."""
    src = strip_comments(text)
    line_of = lambda off: src.count("\n", 0, off) + 1
    out: list[Violation] = []
    for m in BANNED.finditer(src):
        out.append(Violation(path, line_of(m.start()), m.group(0), "streams numbers through std::ostream"))
    for m in OPERATOR_SHIFT.finditer(src):
        if "OutputArchive" not in m.group(1):
            out.append(Violation(path, line_of(m.start()), m.group(0), "operator<< on a stream"))
    for pattern, first_message_arg in ((CHECK_MACROS, 1), (CHECK_WITH, 2), (STREAM_ALL, 0)):
        for m in pattern.finditer(src):
            if re.search(r"#\s*define\s*$", src[:m.start()]):
                continue
            close = matching_paren(src, m.end() - 1)
            visible = headers + "\n" + src[:m.start()]
            for arg in split_top(src[m.end():close])[first_message_arg:]:
                why = why_unsafe(arg, visible)
                if why:
                    out.append(Violation(path, line_of(m.start()), " ".join(arg.split()), why))
    return sorted(out, key=lambda v: v.line)


def scan_tree(root: Path, subdirs=("csrc",)) -> list[Violation]:
    """scan_source over every C++ source and header under root/subdirs."""
    out: list[Violation] = []
    for sub in subdirs:
        for p in sorted((root / sub).rglob("*")):
            if p.suffix in {".h", ".cpp", ".cu", ".cuh", ".hpp", ".cc"}:
                text = p.read_text()
                out += scan_source(text, str(p.relative_to(root)), project_headers(text, root))
    return out
