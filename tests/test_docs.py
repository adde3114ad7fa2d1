"""The documentation's sources stay true: executed notebooks, the API list, the runnable example.

The site itself is built by ``.ci/run`` (``sphinx-build -W``); these tests catch, without
Sphinx, what would make it wrong or stale: a notebook committed without outputs or with
outputs of other code, a public name missing from the API reference, an included README
passage that no longer exists, and the "From Flax to braintrace" example no longer doing what
its page says.
"""

import importlib.util
import pathlib
import re
import runpy

import jax
import jax.numpy as jnp
import nbformat
import numpy as np
import pytest
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


execute_notebooks = _load(DOCS / "execute_notebooks.py")
api_pages = _load(DOCS / "_ext" / "api_pages.py")


def _rerun_hint(path: pathlib.Path) -> str:
    return f"run `python docs/execute_notebooks.py {path.stem}` and commit the notebook"


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_executed_top_to_bottom(path):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.name}: execution counts {counts} are not 1..{len(code)} in order "
        f"(stripped, or run out of order); {_rerun_hint(path)}")
    outputs = [output for cell in code for output in cell.outputs]
    assert outputs, f"{path.name} has no outputs; {_rerun_hint(path)}"
    errors = [output for output in outputs if output.output_type == "error"]
    assert not errors, f"{path.name} stores an error output; {_rerun_hint(path)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_plots_are_stored(path):
    notebook = nbformat.read(path, as_version=4)
    plotting = [cell for cell in notebook.cells
                if cell.cell_type == "code" and "plt.show()" in cell.source]
    without_image = [cell.execution_count for cell in plotting
                     if not any("image/png" in output.get("data", {}) for output in cell.outputs)]
    assert not without_image, (
        f"{path.name}: cells {without_image} call plt.show() but store no image; "
        f"{_rerun_hint(path)}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_outputs_come_from_its_current_code(path):
    notebook = nbformat.read(path, as_version=4)
    recorded = notebook.metadata.get(execute_notebooks.METADATA_KEY, {}).get("source_sha256")
    assert recorded == execute_notebooks.source_sha256(notebook), (
        f"{path.name}: its code changed since its outputs were stored; {_rerun_hint(path)}")


def test_source_hash_sees_a_changed_code_cell():
    notebook = nbformat.read(NOTEBOOKS[0], as_version=4)
    before = execute_notebooks.source_sha256(notebook)
    next(cell for cell in notebook.cells if cell.cell_type == "code").source += "\n1"
    assert execute_notebooks.source_sha256(notebook) != before


@pytest.mark.parametrize("module_name", api_pages.MODULES)
def test_api_reference_lists_exactly_the_public_names(module_name):
    module = importlib.import_module(module_name)
    groups = api_pages.public_names(module_name)
    listed = [name for group in groups.values() for name in group]
    assert sorted(listed) == sorted(module.__all__)
    page = api_pages.module_page(module_name)
    entries = set(re.findall(r"^   (\w+)$", page, flags=re.MULTILINE))   # autosummary rows
    entries |= set(re.findall(r"^\.\. py:data:: (\w+)$", page, flags=re.MULTILINE))
    entries |= set(re.findall(rf":doc:`{re.escape(module_name)}\.(\w+)`", page))
    entries |= set(re.findall(rf"^\* ``{re.escape(module_name)}\.(\w+)``", page, re.MULTILINE))
    assert entries == set(module.__all__)


def test_api_reference_covers_the_documented_modules():
    assert set(api_pages.MODULES) >= {"braintrace", "braintrace.layers", "braintrace.tasks"}
    assert "tasks" in api_pages.public_names("braintrace")["Modules"]


def _includes():
    """``(page, included file, marker)`` for every start-after / end-before of the pages."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        if "_build" in page.parts:
            continue
        for match in re.finditer(r"```\{(include|literalinclude)\} (\S+)\n((?::.*\n)*)",
                                 page.read_text()):
            target = (page.parent / match.group(2)).resolve()
            for marker in re.findall(r':(?:start-after|end-before): "(.*)"', match.group(3)):
                found.append((page.relative_to(DOCS), target, marker))
    return found


def test_pages_include_passages_that_exist():
    includes = _includes()
    assert len(includes) >= 10
    missing = [(str(page), str(target.relative_to(ROOT)), marker)
               for page, target, marker in includes if marker not in target.read_text()]
    assert not missing, f"included passages whose markers are gone (page, file, marker): {missing}"


def test_flax_to_braintrace_example_does_what_its_page_says():
    example = runpy.run_path(str(DOCS / "examples" / "flax_to_braintrace.py"))
    flax_params = nnx.to_pure_dict(nnx.state(example["flax_model"], nnx.Param))
    online_params = nnx.to_pure_dict(nnx.state(example["model"], nnx.Param))
    assert jax.tree.map(jnp.shape, flax_params) == jax.tree.map(jnp.shape, online_params)
    batch = example["batch"]
    assert example["flax_model"](batch.xs).shape == batch.ys.shape  # no silent broadcast
    example["learner"].reset()
    assert example["learner"].etrace_evolve(batch.xs).shape == batch.ys.shape
    bptt, online = example["bptt_losses"], example["online_losses"]
    # Same initial weights, same first batch: the same model, so the same first loss.
    np.testing.assert_allclose(online[0], bptt[0], rtol=1e-5)
    assert bptt[-1] < 0.5 * bptt[0]
    assert online[-1] < 0.5 * online[0]
    trainer_losses = example["trainer_losses"]
    assert trainer_losses.shape == (example["T"],)
    assert bool(jnp.all(jnp.isfinite(trainer_losses)))

