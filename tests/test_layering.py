"""The rooms of the house import in one direction: no room reaches into a room above it.

The reference engine serves its metrics through :mod:`gpudiag.exposition`, not
the agent; the agent opens a node's probes through :mod:`gpudiag.probes.node`,
not a CLI command. Each rule reads every ``import`` statement of the room's
source (top level and inside functions), so a lazy import cannot hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# room (a source folder) -> module prefixes it must not import
FORBIDDEN = {
    "reference_engine": ("gpudiag.agent", "gpudiag.commands", "gpudiag.cli", "gpudiag.analyzers"),
    "agent": ("gpudiag.commands", "gpudiag.cli"),
    "probes": ("gpudiag.agent", "gpudiag.commands", "gpudiag.cli", "gpudiag.analyzers"),
    "analyzers": ("gpudiag.agent", "gpudiag.commands", "gpudiag.cli", "gpudiag.probes"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module an ``import`` or ``from ... import`` in the file names, with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_does_not_import_rooms_above_it(room):
    offenders = [f"{p.relative_to(ROOT)}:{line} imports {mod}"
                 for p in sorted((ROOT / room).rglob("*.py"))
                 for line, mod in imported_modules(p)
                 if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN[room])]
    assert not offenders, "\n".join(offenders)


def test_reference_engine_is_split_into_rooms():
    """A newcomer finds the engine's parts by name; nothing but the package marker sits flat."""
    flat = sorted(p.name for p in (ROOT / "reference_engine").glob("*.py"))
    assert flat == ["__init__.py"]
    for room in ("core", "sim", "model", "serving", "scenarios"):
        assert (ROOT / "reference_engine" / room / "__init__.py").is_file()
    assert (ROOT / "reference_engine" / "core" / "scheduler.py").is_file()  # the scheduler reads in one file


def test_every_engine_module_imports_first():
    """Each module of the engine imports on its own, first: no cycle between rooms hides behind an import order."""
    import subprocess
    import sys

    mods = sorted("gpudiag.reference_engine." + ".".join(p.relative_to(ROOT / "reference_engine").with_suffix("").parts)
                  for p in (ROOT / "reference_engine").rglob("*.py") if p.name != "__init__.py")
    script = (
        "import importlib, sys\n"
        "bad = []\n"
        f"for m in {mods!r}:\n"
        "    for k in [k for k in sys.modules if k.startswith('gpudiag.reference_engine')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ImportError as e:\n"
        "        bad.append(f'{m}: {e}')\n"
        "print('\\n'.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", out.stdout
