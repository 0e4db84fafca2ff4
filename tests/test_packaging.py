"""The design card's folders install into the gpudiag.* namespace, editable and normal, and nothing leaks."""

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("agent", "probes", "analyzers", "reference_engine", "dashboards", "runbooks")


def declared_packages():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return cfg["packages"], cfg["package-dir"]


def test_every_package_folder_in_the_tree_is_declared():
    packages, package_dir = declared_packages()
    found = set()
    for name, folder in package_dir.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    # gpudiag's own subpackages live under gpudiag/ (mapped to itself).
    assert found <= set(packages), f"undeclared packages: {sorted(found - set(packages))}"


def test_the_editable_install_maps_top_level_folders_under_gpudiag():
    import gpudiag.agent
    import gpudiag.reference_engine

    assert Path(gpudiag.agent.__file__).parent == ROOT / "agent"
    assert Path(gpudiag.reference_engine.__file__).parent == ROOT / "reference_engine"


def test_a_normal_install_puts_everything_under_gpudiag_and_nothing_at_top_level(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True, text=True)
    for name in TOP_LEVEL:
        assert not (target / name).exists(), f"{name} leaked into site-packages"
        assert (target / "gpudiag" / name / "__init__.py").is_file()
    assert (target / "gpudiag" / "catalog.py").is_file()
    probe = subprocess.run(
        [sys.executable, "-I", "-c",
         "import sys; sys.path.insert(0, sys.argv[1]); import gpudiag.reference_engine.core.scheduler as s; "
         "print(s.__file__)", str(target)],
        capture_output=True, text=True, check=True)
    assert probe.stdout.strip().startswith(str(target))


def test_the_command_line_lists_every_command_and_runs_one_with_only_its_own_module_loaded(cli):
    import pkgutil

    from gpudiag import commands

    names = sorted(m.name for m in pkgutil.iter_modules(commands.__path__))
    listed = cli("--help")
    assert listed.returncode == 0, listed.stderr
    for name in names:
        assert f"  {name} " in listed.stdout, name
    for name in ("investigate", "repro"):
        p = cli(name, "--help")
        assert p.returncode == 0 and f"Usage: gpudiag {name}" in p.stdout, p.stderr
    wrong = cli("investigat")
    assert wrong.returncode == 2 and "No such command" in wrong.stderr
