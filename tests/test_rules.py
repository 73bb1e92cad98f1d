"""Two rules of the code base, checked over the source tree (no kvtier import needed):

- product code (`src/kvtier`) names no performance target, run id, lab path or design/perf
  document, and carries no dated or measured figure in its comments and docstrings: measurements
  rot, the lab keeps them;
- `src/kvtier` has no import cycles: a module that must import its importer is part of it.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvtier"
FILES = sorted(p for p in SRC.rglob("*") if p.suffix in (".py", ".c"))

# anywhere in the file: code, strings, comments
TARGET = re.compile(r"(?<![\w-])(?:P(?:1[0-2]|[1-9])|V[1-5])(?![\w])")
DOCUMENT = re.compile(r"\b(?:PERF|DESIGN)\.md\b|\bbenchmarks/|(?<![\w.])lab/|\bpython -m lab\b")
MODEL_NAME = re.compile(r"(?i)deepseek-v\d(?:/v\d)*")  # a model's name, not a target
RUN_ID = re.compile(r"\bnvidia-[a-z0-9]+-20\d\d-\d\d-\d\d|\bruns? `?-\d+[a-z]?\b")
# in comments and docstrings only: a date, or a figure with a unit beside a GPU's name
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
GPU_NAME = re.compile(r"\b(?:[HAB]100|H200|B200|L40S|A10G|MI300X?)\b")
FIGURE = re.compile(r"\d(?:\.\d+)?\s?(?:µs|us|ms|GB/s|TB/s|%|x)(?![\w])")


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file; the whole text of a C file."""
    text = path.read_text()
    if path.suffix == ".c":
        return list(enumerate(text.splitlines(), 1))
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                start = node.body[0].lineno
                out.extend((start + i, line) for i, line in enumerate(doc.splitlines()))
    return out


def _rel(path: Path) -> str:
    return str(path.relative_to(SRC.parent))


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_product_names_no_target_run_or_lab(path):
    bad = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = MODEL_NAME.sub("", line)
        for rule in (TARGET, DOCUMENT, RUN_ID):
            if m := rule.search(line):
                bad.append(f"{_rel(path)}:{n}: {m.group(0)!r} in {line.strip()[:100]}")
    assert not bad, "product code names a target, run id or lab document:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_product_prose_has_no_dated_figures(path):
    bad = []
    for n, line in _prose(path):
        if DATE.search(line) or (GPU_NAME.search(line) and FIGURE.search(line)):
            bad.append(f"{_rel(path)}:{n}: {line.strip()[:110]}")
    assert not bad, (
        "a dated or measured figure in a comment or docstring (the lab keeps them):\n" + "\n".join(bad)
    )


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.Module, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The kvtier modules `module` imports anywhere: at the top, inside functions, and under
    `if TYPE_CHECKING:` (a type-only import of its importer still means a class cut in two)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(n for n in names if n in known)
    out.discard(module)
    return out


def test_no_import_cycles():
    paths = [p for p in FILES if p.suffix == ".py"]
    known = {_module(p) for p in paths}
    graph = {
        _module(p): _imports(ast.parse(p.read_text()), _module(p), p.name == "__init__.py", known)
        for p in paths
    }
    # a package's __init__ importing its own submodules is how a package offers its names, not a cycle
    for mod, deps in graph.items():
        graph[mod] = {
            d
            for d in deps
            if not (
                d.startswith(mod + ".") and any(p.name == "__init__.py" and _module(p) == mod for p in paths)
            )
        }
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles in src/kvtier:\n" + "\n".join(" -> ".join(c) for c in cycles)
