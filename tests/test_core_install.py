"""The core install (``pip install -e .``, no extras) runs everything the package reaches.

The real proof is ``.ci/run``, which runs the README's main job in a virtual
environment made with the README's core install. These tests catch the same
mistake in the dev environment: a package imported by ``braintrace`` (at import
time or lazily, like a progress bar inside a training loop) that only the
``dev`` extra installs.
"""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE_DIRS = (ROOT / "braintrace", ROOT / "layers")  # layers/ installs as braintrace.layers


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _core_requirements() -> set[str]:
    """Canonical names of the distributions in pyproject's ``dependencies``."""
    return {canonicalize_name(Requirement(r).name) for r in _project()["dependencies"]}


def _imported_modules() -> dict[str, set[str]]:
    """Every absolute import in the installed package: dotted module name -> files."""
    found: dict[str, set[str]] = {}
    for directory in PACKAGE_DIRS:
        for path in sorted(directory.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def _third_party(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """Top-level third-party names among ``modules``, with the files importing them."""
    top: dict[str, set[str]] = {}
    for name, files in modules.items():
        head = name.partition(".")[0]
        if head in sys.stdlib_module_names or head in ("__future__", "braintrace"):
            continue
        top.setdefault(head, set()).update(files)
    return top


def undeclared(imports: dict[str, set[str]], requirements: set[str]) -> list[str]:
    """Imports whose distribution is not among ``requirements``, one line each."""
    owners = importlib.metadata.packages_distributions()
    problems = []
    for module, files in sorted(imports.items()):
        dists = {canonicalize_name(d) for d in owners.get(module, [])}
        if not dists & requirements:
            problems.append(f"'{module}' (distribution {sorted(dists) or 'not installed'}), "
                            f"imported by {sorted(files)}")
    return problems


def test_every_package_the_code_imports_is_a_core_dependency():
    imports = _third_party(_imported_modules())
    assert {"jax", "flax", "optax", "numpy", "tqdm"} <= set(imports)  # the walk sees them
    problems = undeclared(imports, _core_requirements())
    assert not problems, (
        "braintrace imports packages that `pip install -e .` does not install; add them to "
        "pyproject `dependencies` (or make the import optional with a clear message):\n"
        + "\n".join(problems))


def test_the_check_fails_when_a_lazily_imported_package_is_only_in_dev():
    # Negative control: the bug of issue 13, tqdm imported inside a training loop but
    # declared only in the dev extra.
    imports = _third_party(_imported_modules())
    dev_only = _core_requirements() - {"tqdm"}
    problems = undeclared(imports, dev_only)
    assert len(problems) == 1 and problems[0].startswith("'tqdm'"), problems
    assert "braintrace/__main__.py" in problems[0]


def _core_closure() -> set[str]:
    """Distributions a core install brings in: the project, its dependencies and theirs."""
    seen: set[str] = {canonicalize_name(_project()["name"])}
    todo = list(_project()["dependencies"])
    while todo:
        requirement = Requirement(todo.pop())
        name = canonicalize_name(requirement.name)
        if name in seen or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        try:
            todo.extend(importlib.metadata.requires(name) or [])
        except importlib.metadata.PackageNotFoundError:
            continue
        seen.add(name)
    return seen


_BLOCKED_RUN = """
import importlib, importlib.abc, runpy, sys
blocked = set(sys.argv[1].split(','))

class NotInCoreInstall(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInCoreInstall())
try:
    import pytest
except ModuleNotFoundError:
    print('dev packages blocked')
for module in sys.argv[2].split(','):
    importlib.import_module(module)
sys.argv = ['python -m braintrace', '--help']
runpy.run_module('braintrace', run_name='__main__')
"""


def test_package_imports_and_main_help_without_dev_packages():
    closure = _core_closure()
    assert {"jax", "flax", "optax", "numpy", "tqdm"} <= closure
    owners = importlib.metadata.packages_distributions()
    blocked = sorted(module for module, dists in owners.items()
                     if module.isidentifier()
                     and not {canonicalize_name(d) for d in dists} & closure)
    assert "pytest" in blocked and "hypothesis" in blocked
    modules = sorted(m for m in _imported_modules()
                     if m.partition(".")[0] not in sys.stdlib_module_names
                     and m != "__future__")
    modules += ["braintrace", "braintrace.layers", "braintrace.tasks"]
    result = subprocess.run(
        [sys.executable, "-c", _BLOCKED_RUN, ",".join(blocked), ",".join(modules)],
        capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("dev packages blocked")
    assert "--quick" in result.stdout


def test_ci_runs_the_main_job_on_the_readme_core_install_before_the_tests():
    readme = (ROOT / "README.md").read_text()
    core = re.search(r"^python3 -m venv \.venv && \.venv/bin/pip install -e \. && "
                     r"\.venv/bin/python -m braintrace$", readme, flags=re.MULTILINE)
    assert core, "README's main-job command changed: update .ci/run and this test"
    expected = core.group(0).replace(".venv", ".venv-core") + " --quick"
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert expected in lines, f".ci/run must run `{expected}`"
    tests = next(i for i, line in enumerate(lines) if "-m pytest" in line)
    assert lines.index(expected) < tests
    assert ".venv/bin/pip install -e \".[dev]\"" in lines[tests]
    # pytest must not collect the core venv: it lies outside testpaths and is ignored by git.
    testpaths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["testpaths"]
    assert all(not (ROOT / p).resolve().is_relative_to(ROOT / ".venv-core") and p != "."
               for p in testpaths)
    assert ".venv-core/" in (ROOT / ".gitignore").read_text().splitlines()
