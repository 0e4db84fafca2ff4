"""No private name crosses a package boundary, and no module sets another's underscore attributes.

What one package needs from another is a public, documented name (``gpudiag.frames`` gives the
store ``Table.set_sources``, ``merge_codes``, ...). The source tree is read as text (no imports):

* ``from X import _name`` (absolute or relative) where X lies in another package than the
  importing module: ``gpudiag/frames/`` and ``agent/store/`` are packages of their own, so
  their modules share private names among themselves and with no one else;
* ``obj._attr = ...`` (or ``setattr(obj, "_attr", ...)``) on anything but ``self`` or ``cls``,
  where no class of the same module sets ``self._attr``: a module writing another's internals.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Top-level folders as pyproject.toml maps them into gpudiag.*; bench/ holds scripts of their own.
PACKAGE_DIRS = {"gpudiag": "gpudiag", "agent": "gpudiag.agent", "probes": "gpudiag.probes",
                "analyzers": "gpudiag.analyzers", "reference_engine": "gpudiag.reference_engine", "bench": "bench"}


def sources() -> list[tuple[Path, str]]:
    """(file, its dotted module name) of every Python file of the tree."""
    out = []
    for folder, dotted in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name.endswith("_pb2.py"):
                continue  # protoc's output (probes/proto): generated, regenerated, never edited
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out.append((path, ".".join([dotted, *parts])))
    return out


def module_path(dotted: str) -> Path | None:
    """The file or package folder of a dotted gpudiag (or bench) module; None outside the tree."""
    for folder, prefix in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(kv[1])):
        if dotted == prefix or dotted.startswith(prefix + "."):
            rest = dotted[len(prefix):].lstrip(".")
            base = ROOT / folder / Path(*rest.split(".")) if rest else ROOT / folder
            if base.is_dir():
                return base
            if base.with_suffix(".py").exists():
                return base.with_suffix(".py")
            return None
    return None


def package_of(dotted: str) -> str:
    """The package a module lives in: a package is its own; a plain module's is its parent's."""
    path = module_path(dotted)
    if path is not None and path.is_dir():
        return dotted
    return dotted.rsplit(".", 1)[0] if "." in dotted else dotted


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports() -> list[str]:
    offenders = []
    for path, dotted in sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        here = package_of(dotted)
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:  # relative: from the importing module's package up
                base = dotted if is_package else dotted.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not (target.startswith("gpudiag") or target.startswith("bench")):
                continue
            for alias in node.names:
                if not is_private(alias.name):
                    continue
                # `from pkg import _mod` names a module of pkg: its package is pkg itself.
                there = package_of(f"{target}.{alias.name}") if module_path(f"{target}.{alias.name}") \
                    else package_of(target)
                if there != here:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {target} import {alias.name}")
    return offenders


def _self_attrs(tree: ast.AST) -> set[str]:
    """Attributes the module's own classes set on ``self`` (or ``cls``), and the slots they declare."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            for elt in ast.walk(node.value):
                if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                    own.add(elt.value)
    return own


def foreign_writes() -> list[str]:
    offenders = []
    for path, _ in sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        own = _self_attrs(tree)
        for node in ast.walk(tree):
            targets: list[tuple[ast.AST, str]] = []
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                targets.append((node.value, node.attr))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("setattr", "delattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                targets.append((node.args[0], node.args[1].value))
            for obj, attr in targets:
                if not is_private(attr) or attr in own:
                    continue
                if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
                    continue
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(obj)}.{attr} set")
    return offenders


def test_no_private_name_is_imported_across_a_package_boundary():
    offenders = private_imports()
    assert not offenders, "private names imported from another package:\n" + "\n".join(offenders)


def test_no_module_sets_another_modules_underscore_attributes():
    offenders = foreign_writes()
    assert not offenders, "underscore attributes set from outside their module:\n" + "\n".join(offenders)


@pytest.mark.parametrize("source, count", [
    ("from gpudiag.frames import _cut_codes\n", 1),
    ("from gpudiag.frames.codes import merge_codes\n", 0),
    ("table._code_source = None\n", 1),
])
def test_the_checks_catch_what_they_look_for(tmp_path, monkeypatch, source, count):
    (tmp_path / "gpudiag").mkdir()
    (tmp_path / "gpudiag" / "frames").mkdir()
    (tmp_path / "gpudiag" / "frames" / "__init__.py").write_text("")
    (tmp_path / "gpudiag" / "frames" / "codes.py").write_text("")
    (tmp_path / "gpudiag" / "probe.py").write_text(source)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "PACKAGE_DIRS", {"gpudiag": "gpudiag"})
    assert len(private_imports()) + len(foreign_writes()) == count
