"""A static check that kernels never allocate: OpenCL C and CUDA C sources, shipped or generated.

IREE's GPU sort once kept its temporary in global memory and ended up calling ``malloc`` inside
a kernel. In polyhal every scratch is declared and placed by the bufferize pass, so a kernel
source must not allocate at all. :func:`lint` rejects, outside comments and string literals:

``heap-allocation``
    calls of ``malloc``, ``calloc``, ``realloc``, ``aligned_alloc``, ``free``, device-side
    ``cudaMalloc``/``cudaMallocAsync``/``cudaFree`` and ``__builtin_alloca``;
``new-expression``
    C++ ``new`` / ``new[]`` (CUDA C++);
``alloca``
    ``alloca`` / ``_alloca`` (a stack allocation whose size is only known at run time);
``variable-length-array``
    an array declared in a function body whose extent is not a compile-time constant (C99
    VLAs; an extent naming a variable or a parameter);
``unbounded-array``
    an array declared with an empty extent, other than the two forms of *launch-sized*
    workgroup memory: CUDA's ``extern __shared__ T s[];`` and an OpenCL ``__kernel``'s
    ``__local T*`` parameter. Those are allowed because their size is an argument of the launch,
    which the backend takes from the plan's :class:`~polyhal.hal.scratch.ScratchBinding` (a
    WORKGROUP placement); :func:`scan` lists them with ``dynamic=True``.

An extent is constant when it is made of integer literals, operators, ``sizeof`` and macros:
``#define``\\ s of the source itself, evaluated (``__local int idx[NP]`` with ``#define NP 1024``
is 1024 elements), or upper-case names a template leaves to its generator (``.cl`` templates
get their ``#define`` lines prepended when a kernel is generated, and are then checked again
with the values). :func:`scan` also returns every fixed-size array with its memory space and,
where the element type and extent are known, its size in bytes: the OpenCL backend declares a
generated kernel's ``__local`` arrays to the bufferize pass from this.
"""

from __future__ import annotations

import ast
import operator
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from polyhal.errors import ProgramError

__all__ = ["ArrayDecl", "Finding", "KernelLintError", "check", "lint", "lint_file", "scan", "shipped_sources"]

#: File suffixes of kernel sources, and their language.
SUFFIXES = {".cl": "opencl", ".cu": "cuda", ".cuh": "cuda", ".hip": "cuda"}  # HIP C++ is CUDA C++


class KernelLintError(ProgramError):
    """A kernel source allocates memory (or declares an unbounded or variable-length array)."""


@dataclass(frozen=True)
class Finding:
    """One violation: the rule, where (``name:line``) and what was found."""

    rule: str
    name: str
    line: int
    text: str
    message: str

    def __str__(self) -> str:
        return f"{self.name}:{self.line}: [{self.rule}] {self.message}: {self.text.strip()}"


@dataclass(frozen=True)
class ArrayDecl:
    """A fixed-size array declared in a function body.

    ``space`` is ``"workgroup"`` (``__local``, ``__shared__``), ``"constant"`` or ``"private"``;
    ``elements`` and ``nbytes`` are None where a template macro or an unknown type leaves them open.
    """

    name: str
    space: str
    elem_type: str
    extents: tuple[str, ...]
    elements: int | None
    nbytes: int | None
    line: int
    function: str
    #: Launch-sized workgroup memory (``extern __shared__``, a ``__local`` kernel parameter).
    dynamic: bool = False


# -- lexing -----------------------------------------------------------------------------------------

def _strip(source: str) -> str:
    """``source`` with comments and string/char literals blanked out (newlines kept, so that line
    numbers stay right)."""
    out = []
    i, n = 0, len(source)
    while i < n:
        c = source[i]
        if source.startswith("//", i):
            j = source.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif source.startswith("/*", i):
            j = source.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in source[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and source[j] != c and source[j] != "\n":
                j += 2 if source[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * (j - i - 2) + c if j - i >= 2 else c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)(?!\()(?:[ \t]+(.*))?$", re.M)
_TYPEDEF = re.compile(r"\btypedef\s+([^;]+?)\s+([A-Za-z_]\w*)\s*;")


def _defines(text: str) -> dict[str, str]:
    """Object-like macros of the (stripped) source: name -> replacement text. The first
    definition wins, as for a generated prefix followed by a template's fallback defaults."""
    table: dict[str, str] = {}
    for m in _DEFINE.finditer(text):
        table.setdefault(m.group(1), (m.group(2) or "").strip())
    return table


# -- constant extents ---------------------------------------------------------------------------------

_SCALAR_BYTES = {
    "char": 1, "uchar": 1, "bool": 1, "short": 2, "ushort": 2, "half": 2, "int": 4, "uint": 4, "float": 4,
    "long": 8, "ulong": 8, "double": 8, "size_t": 8, "ptrdiff_t": 8, "intptr_t": 8, "uintptr_t": 8,
    "int8_t": 1, "uint8_t": 1, "int16_t": 2, "uint16_t": 2, "int32_t": 4, "uint32_t": 4, "int64_t": 8,
    "uint64_t": 8, "__half": 2, "unsigned": 4, "signed": 4,
}
_VECTOR = re.compile(r"^(char|uchar|short|ushort|int|uint|long|ulong|float|double|half)(2|3|4|8|16)$")

#: Words that start a statement or qualify a declaration but are not its type.
_QUALIFIERS = {
    "__local", "local", "__private", "private", "__global", "global", "__constant", "constant",
    "__shared__", "__device__", "__constant__", "static", "const", "volatile", "extern", "register",
    "restrict", "__restrict__", "inline", "__inline__", "__forceinline__", "unsigned", "signed",
    "struct", "union", "enum", "__attribute__", "_Alignas", "alignas", "__align__",
}
_NOT_TYPES = {
    "return", "else", "case", "goto", "sizeof", "typedef", "if", "while", "for", "do", "switch", "break",
    "continue", "default", "delete", "new", "throw", "using", "namespace", "template", "typename",
}
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Div: operator.floordiv, ast.Mod: operator.mod, ast.LShift: operator.lshift,
           ast.RShift: operator.rshift, ast.BitOr: operator.or_, ast.BitAnd: operator.and_,
           ast.BitXor: operator.xor}


_CMPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
         ast.Eq: operator.eq, ast.NotEq: operator.ne}


class _Open(Exception):
    """An extent that is constant but not known here (a template macro without a value)."""


class _Variable(Exception):
    """An extent that names a run-time value."""


def _type_bytes(t: str, defines: dict[str, str], typedefs: dict[str, str], depth: int = 0) -> int | None:
    t = t.strip()
    if depth > 16:
        return None
    if t in _SCALAR_BYTES:
        return _SCALAR_BYTES[t]
    m = _VECTOR.match(t)
    if m:
        lanes = int(m.group(2))
        return _SCALAR_BYTES[m.group(1)] * (4 if lanes == 3 else lanes)
    for table in (defines, typedefs):
        if t in table and table[t] != t:
            words = [w for w in table[t].split() if w not in _QUALIFIERS]
            if len(words) == 1:
                return _type_bytes(words[0], defines, typedefs, depth + 1)
            if table[t].split()[:1] == ["unsigned"] and len(words) == 1:
                return _type_bytes(words[0], defines, typedefs, depth + 1)
    return None


def _closing(text: str) -> int:
    """Index of the parenthesis closing ``text[0]`` (an opening one), or -1."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return i
    return -1


def _split_ternary(text: str) -> tuple[str, str, str] | None:
    """``cond ? a : b`` at the top level of ``text`` (parentheses respected), or None."""
    depth, q = 0, -1
    for i, ch in enumerate(text):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "?" and depth == 0 and q < 0:
            q = i
    if q < 0:
        return None
    depth, nested = 0, 0
    for i in range(q + 1, len(text)):
        ch = text[i]
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif depth == 0 and ch == "?":
            nested += 1
        elif depth == 0 and ch == ":":
            if nested == 0:
                return text[:q], text[q + 1:i], text[i + 1:]
            nested -= 1
    return None


def _eval_extent(expr: str, defines: dict[str, str], depth: int = 0) -> int:
    """The value of a constant extent; raises _Variable (names a variable) or _Open (a template
    macro with no value here)."""
    if depth > 32:
        raise _Open(expr)
    expr = expr.strip()
    while expr.startswith("(") and _closing(expr) == len(expr) - 1:
        expr = expr[1:-1].strip()  # (e) -> e, so that a parenthesised ternary is seen
    parts = _split_ternary(expr)
    if parts is not None:
        cond, yes, no = parts
        return _eval_extent(yes if _eval_extent(cond, defines, depth + 1) else no, defines, depth + 1)
    text = re.sub(r"\b(\d+)[uUlL]+\b", r"\1", expr.strip())
    text = re.sub(r"\bsizeof\s*\(([^()]*)\)", lambda m: "SIZEOF_" + re.sub(r"\W", "_", m.group(1).strip()), text)
    text = text.replace("/", "//").replace("////", "//").replace("&&", " and ").replace("||", " or ")
    text = re.sub(r"!(?!=)", " not ", text).strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise _Variable(expr) from None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Invert)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else (~v if isinstance(node.op, ast.Invert) else v)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return int(not ev(node.operand))
        if isinstance(node, ast.BoolOp):
            vals = [ev(v) for v in node.values]
            return int(all(vals)) if isinstance(node.op, ast.And) else int(any(vals))
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMPS:
            return int(_CMPS[type(node.ops[0])](ev(node.left), ev(node.comparators[0])))
        if isinstance(node, ast.Name):
            name = node.id
            if name.startswith("SIZEOF_"):
                raise _Open(name)
            if name in defines:
                return _eval_extent(defines[name], defines, depth + 1)
            if name.isupper() or re.fullmatch(r"[A-Z][A-Z0-9_]*", name):
                raise _Open(name)  # a template parameter: the generator defines it
            raise _Variable(name)
        raise _Variable(ast.dump(node))

    return ev(tree)


# -- scanning -----------------------------------------------------------------------------------------

_HEAP = re.compile(r"\b(malloc|calloc|realloc|aligned_alloc|free|cudaMalloc\w*|cudaFree\w*|__builtin_alloca"
                   r"|__builtin_malloc)\s*\(")
_ALLOCA = re.compile(r"\b(_?alloca)\s*\(")
_NEW = re.compile(r"(?:\bnew\s*\(|\bnew\s+[A-Za-z_(]|::\s*new\b)")
_KERNEL = re.compile(r"(?:__kernel|\bkernel)\s+(?:__attribute__\s*\(\(.*?\)\)\s*)?void\s+(\w+)\s*\(([^)]*)\)", re.S)
_FUNC = re.compile(r"\b([A-Za-z_]\w*)\s*\([^;{}]*\)\s*\{")
_DECL_HEAD = re.compile(r"^\s*((?:[A-Za-z_]\w*\s*\*?\s+)+?)([A-Za-z_]\w*\s*(?:\[[^\]]*\]\s*)+.*)$", re.S)
_ATTRS = re.compile(r"\b(?:__align__|alignas|_Alignas|__attribute__)\s*\((?:[^()]|\([^()]*\))*\)")
_DECLARATOR = re.compile(r"^\s*\**\s*([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)+)")


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _split_top(s: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _signature_name(text: str, brace: int) -> str:
    """The name of the function whose body opens at ``text[brace]``, or "" (a struct, an
    initializer): the identifier before the parameter list that closes just before the brace."""
    j = brace - 1
    while j >= 0 and text[j].isspace():
        j -= 1
    if j < 0 or text[j] != ")":
        return ""
    depth = 0
    while j >= 0:
        if text[j] == ")":
            depth += 1
        elif text[j] == "(":
            depth -= 1
            if depth == 0:
                break
        j -= 1
    m = re.search(r"([A-Za-z_]\w*)\s*$", text[:max(j, 0)])
    return m.group(1) if m and m.group(1) not in _NOT_TYPES else ""


def _function_spans(text: str) -> list[tuple[int, int, str]]:
    """(start, end, name) of every function body (top-level brace blocks after a signature)."""
    spans = []
    depth = 0
    start = -1
    name = ""
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                name = _signature_name(text, i)
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0 and start >= 0:
                if name:
                    spans.append((start, i, name))
                start = -1
    return spans


def scan(source: str, name: str = "<source>", language: str = "opencl",
         defines: dict[str, str] | None = None) -> tuple[list[Finding], list[ArrayDecl]]:
    """Findings (see the module docstring) and the fixed-size arrays of ``source``.

    ``defines`` adds macro values (as ``-D`` options would); the source's own ``#define`` lines
    are read too.
    """
    text = _strip(source)
    table = {**_defines(text), **(defines or {})}
    typedefs = {m.group(2): m.group(1) for m in _TYPEDEF.finditer(text)}
    code = "\n".join("" if ln.lstrip().startswith("#") else ln for ln in text.split("\n"))
    lines = source.split("\n")
    findings: list[Finding] = []

    def find(rule: str, pos: int, message: str) -> None:
        ln = _line_of(code, pos)
        findings.append(Finding(rule, name, ln, lines[ln - 1] if ln <= len(lines) else "", message))

    for m in _HEAP.finditer(code):
        find("heap-allocation", m.start(), f"{m.group(1)}() allocates inside a kernel; declare the memory as "
             "scratch (polyhal.hal.scratch.ScratchDecl) so that the planner places it")
    for m in _ALLOCA.finditer(code):
        find("alloca", m.start(), f"{m.group(1)}() is a stack allocation sized at run time; declare a scratch")
    for m in _NEW.finditer(code):
        find("new-expression", m.start(), "operator new allocates inside a kernel; declare a scratch")
    arrays: list[ArrayDecl] = []
    if language == "opencl":
        for m in _KERNEL.finditer(code):
            for param in _split_top(m.group(2)):
                if re.search(r"\b(__local|local)\b", param) and "*" in param:
                    pname = re.findall(r"[A-Za-z_]\w*", param)[-1]
                    ptype = [w for w in re.findall(r"[A-Za-z_]\w*", param)[:-1] if w not in _QUALIFIERS]
                    arrays.append(ArrayDecl(pname, "workgroup", ptype[-1] if ptype else "", (), None, None,
                                            _line_of(code, m.start(2)), m.group(1), dynamic=True))
    spans = _function_spans(code)
    # File scope too (CUDA allows __shared__ arrays there), with function bodies blanked out.
    top = list(code)
    for start, end, _ in spans:
        top[start + 1:end] = [c if c == "\n" else " " for c in code[start + 1:end]]
    for start, end, fname in [(-1, len(code), "")] + spans:
        body = "".join(top) if fname == "" else code[start + 1:end]
        offset = start + 1
        pos = 0
        for stmt in re.split(r"([;{}])", body):
            stmt_pos = offset + pos
            pos += len(stmt)
            if stmt in (";", "{", "}") or "[" not in stmt:
                continue
            _declarations(stmt, stmt_pos, fname, table, typedefs, code, find, arrays)
    return findings, arrays


def _declarations(stmt: str, stmt_pos: int, fname: str, table: dict[str, str], typedefs: dict[str, str],
                  code: str, find, arrays: list[ArrayDecl]) -> None:
    stmt = _ATTRS.sub(" ", stmt)
    # A for-loop header may declare too: keep the part after the last '('.
    head_cut = stmt.rfind("(") if stmt.lstrip().startswith(("for", "if", "while")) else -1
    part = stmt[head_cut + 1:] if head_cut >= 0 else stmt
    m = _DECL_HEAD.match(part)
    if not m:
        return
    all_words = m.group(1).replace("*", " ").split()
    if not all_words:
        return
    # The type is the last word; qualifiers may precede it. Anything before those belongs to an
    # earlier statement without a semicolon (a template macro such as X_PROLOGUE).
    words = all_words[-1:]
    for w in reversed(all_words[:-1]):
        if w not in _QUALIFIERS:
            break
        words.insert(0, w)
    elem_type = words[-1]
    if elem_type in _NOT_TYPES or elem_type in _QUALIFIERS:
        return
    ws = set(all_words)
    space = ("workgroup" if ws & {"__local", "local", "__shared__"} else
             "constant" if ws & {"__constant", "constant", "__constant__"} else "private")
    is_extern = "extern" in ws
    base = stmt_pos + (head_cut + 1 if head_cut >= 0 else 0) + m.start(2)
    for decl in _split_top(m.group(2)):
        decl = decl.split("=", 1)[0]
        d = _DECLARATOR.match(decl)
        if not d:
            continue
        aname, ext_text = d.group(1), d.group(2)
        extents = tuple(e.strip() for e in re.findall(r"\[([^\]]*)\]", ext_text))
        where = base + m.group(2).find(decl.strip()) if decl.strip() else base
        if any(e == "" for e in extents):
            if is_extern and space == "workgroup":  # CUDA dynamic shared memory: sized by the launch
                arrays.append(ArrayDecl(aname, space, elem_type, extents, None, None, _line_of(code, where),
                                        fname, dynamic=True))
                continue
            find("unbounded-array", where, f"array {aname!r} has an empty extent: nothing bounds it; give it "
                 "a constant extent (a scratch declaration sizes it)")
            continue
        elements: int | None = 1
        for e in extents:
            try:
                value = _eval_extent(e, table)
            except _Variable as exc:
                find("variable-length-array", where,
                     f"array {aname!r} has extent [{e}], which names the run-time value {exc.args[0]!r}; "
                     "use a constant (a #define the generator sets) and declare the size as scratch")
                elements = None
                break
            except _Open:
                elements = None
                continue
            if elements is not None:
                elements *= value
        else:
            size = _type_bytes(elem_type, table, typedefs)
            arrays.append(ArrayDecl(aname, space, elem_type, extents, elements,
                                    None if elements is None or size is None else elements * size,
                                    _line_of(code, where), fname))


def lint(source: str, name: str = "<source>", language: str = "opencl",
         defines: dict[str, str] | None = None) -> list[Finding]:
    """Every violation in ``source`` (empty when it allocates nothing)."""
    return scan(source, name, language, defines)[0]


def check(source: str, name: str = "<source>", language: str = "opencl",
          defines: dict[str, str] | None = None) -> list[ArrayDecl]:
    """Raise :class:`KernelLintError` listing every violation; else return the fixed-size arrays."""
    findings, arrays = scan(source, name, language, defines)
    if findings:
        raise KernelLintError(f"kernel source {name} allocates memory, which kernels must not do "
                              f"(scratch is declared and placed by the planner):\n"
                              + "\n".join(f"  {f}" for f in findings))
    return arrays


def lint_file(path: str | Path) -> list[Finding]:
    """Lint one ``.cl`` / ``.cu`` / ``.cuh`` file."""
    path = Path(path)
    return lint(path.read_text(encoding="utf-8"), str(path), SUFFIXES.get(path.suffix, "opencl"))


def shipped_sources(roots: Iterable[str | Path]) -> list[Path]:
    """Every kernel source file under ``roots`` (skipping build and cache directories)."""
    found = []
    for root in roots:
        for p in sorted(Path(root).rglob("*")):
            if p.suffix in SUFFIXES and p.is_file() and not any(
                    part in (".git", "build", "__pycache__", ".venv", "node_modules") for part in p.parts):
                found.append(p)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m polyhal.hal.kernel_lint PATH...``: lint files or directories; exit 1 on findings."""
    paths = list(argv if argv is not None else sys.argv[1:]) or ["."]
    bad = 0
    for p in shipped_sources(paths) + [Path(p) for p in paths if Path(p).is_file()]:
        for f in lint_file(p):
            print(f)
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
