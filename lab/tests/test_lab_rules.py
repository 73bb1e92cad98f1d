"""The lab uses kvtier only through public names and explicit hooks: an AST scan of every
`lab/**/*.py` fails on an import of a private kvtier name or module (`from kvtier.x import _y`,
`kvtier._slab`), on any `x._name` attribute access (save `self._` / `cls._` and dunders), and on
`setattr` / `monkeypatch.setattr` / `delattr` aimed at kvtier."""

import ast
from pathlib import Path

import pytest

LAB = Path(__file__).resolve().parents[1]
# torch's sleep kernel (`torch.cuda._sleep`) is torch's private, not kvtier's: one file holds it
TORCH_PRIVATE_OK = {LAB / "spin.py"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _kvtier_names(tree: ast.AST) -> set[str]:
    """Local names bound to kvtier modules or objects imported from kvtier."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("kvtier")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvtier"):
            names |= {a.asname or a.name for a in node.names}
    return names


def problems(path: Path) -> list[str]:
    """Each breach of the rule in one file, as 'file:line: what'."""
    tree = ast.parse(path.read_text(), str(path))
    kvtier = _kvtier_names(tree)
    out = []

    def bad(node: ast.AST, what: str) -> None:
        out.append(f"{path.relative_to(LAB.parent)}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kvtier") and any(_private(p) for p in a.name.split(".")):
                    bad(node, f"import of private module {a.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvtier"):
            if any(_private(p) for p in node.module.split(".")):
                bad(node, f"import from private module {node.module}")
            for a in node.names:
                if _private(a.name):
                    bad(node, f"import of private name {node.module}.{a.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if path in TORCH_PRIVATE_OK:
                continue
            bad(node, f"private attribute .{node.attr}")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("setattr", "delattr") and node.args:
                target = node.args[0]
                root = target
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in kvtier:
                    bad(node, f"{name} on kvtier object {ast.unparse(target)}")
                if isinstance(target, ast.Constant) and str(target.value).startswith("kvtier"):
                    bad(node, f"{name} on {target.value}")
    return out


def lab_files() -> list[Path]:
    return sorted(p for p in LAB.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_lab_uses_kvtier_through_public_names_only():
    found = [p for f in lab_files() for p in problems(f)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "code, what",
    [
        ("from kvtier.engine import _fast", "private name"),
        ("from kvtier._slab import thing", "private module"),
        ("import kvtier._slab", "private module"),
        ("def f(eng):\n    return eng._auto", "private attribute"),
        ("import kvtier.engine as e\ndef t(monkeypatch):\n    monkeypatch.setattr(e, 'x', 1)", "setattr"),
        ("from kvtier.engine import TransferEngine\nsetattr(TransferEngine, 'x', 1)", "setattr"),
        ("def t(monkeypatch):\n    monkeypatch.setattr('kvtier.engine.x', 1)", "setattr"),
    ],
)
def test_the_scan_catches_each_kind_of_breach(tmp_path, code, what):
    path = LAB / "tests" / f"_rule_probe_{tmp_path.name}.py"  # inside the lab: the report names it so
    path.write_text(code)
    try:
        assert any(what in p for p in problems(path))
    finally:
        path.unlink()


def test_the_scan_lets_a_class_use_its_own_private_members_and_dunders(tmp_path):
    path = LAB / "tests" / f"_rule_probe_{tmp_path.name}.py"
    path.write_text("class A:\n    def f(self):\n        return self._x, type(self).__name__\n")
    try:
        assert problems(path) == []
    finally:
        path.unlink()
