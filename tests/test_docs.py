"""The documentation's sources stay true: executed notebooks, the API list, the runnable example.

The site itself is built by ``.ci/run`` (``sphinx-build -W``); these tests catch, without
Sphinx, what would make it wrong or stale: a notebook committed without outputs or with
outputs of other code, a public name missing from the API reference, an included README
passage that no longer exists, and the "From Flax to braintrace" example no longer doing what
its page says.
"""

import contextlib
import importlib.util
import inspect
import io
import pathlib
import re
import runpy
import sys
import tomllib

import jax
import jax.numpy as jnp
import nbformat
import numpy as np
import pytest
from flax import nnx

import braintrace

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
module_docstrings = _load(DOCS / "_ext" / "module_docstrings.py")
own_inherited_members = _load(DOCS / "_ext" / "own_inherited_members.py")


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


CHECKED = "check-output"
"""Cell tag: the cell's stored text output is what its code prints today (at full size)."""


def _checked_cells(notebook) -> list[int]:
    return [i for i, cell in enumerate(notebook.cells)
            if cell.cell_type == "code" and CHECKED in cell.metadata.get("tags", [])]


def _printed(cell) -> str:
    return "".join(o.text for o in cell.outputs
                   if o.output_type == "stream" and o.name == "stdout")


CHECKED_NOTEBOOKS = [p for p in NOTEBOOKS if _checked_cells(nbformat.read(p, as_version=4))]


def test_notebooks_with_reports_check_them():
    # Every notebook that prints a report (structural text, the same on every machine) stores
    # it in a checked cell; notebooks 03 and 07 stored reports of older code (issue 46).
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        reports = [i for i, cell in enumerate(notebook.cells)
                   if cell.cell_type == "code" and ".report()" in cell.source
                   and "cosine" not in cell.source]
        assert set(reports) <= set(_checked_cells(notebook)), path.name
    assert {p.stem[:2] for p in CHECKED_NOTEBOOKS} >= {"01", "03", "06", "07"}


def _stale_outputs(path: pathlib.Path, notebook, monkeypatch) -> list[str]:
    """Runs ``notebook``'s code at full size up to its last checked cell, in this process;
    one message per checked cell whose stored text is not what it prints."""
    import matplotlib.pyplot as plt

    checked = _checked_cells(notebook)
    monkeypatch.delenv("BRAINTRACE_QUICK", raising=False)  # the stored outputs' sizes
    monkeypatch.chdir(path.parent)
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    namespace: dict = {"__name__": "__main__"}
    stale = []
    try:
        for i, cell in enumerate(notebook.cells[:checked[-1] + 1]):
            if cell.cell_type != "code":
                continue
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(cell.source, f"{path.name}, cell {cell.execution_count}",  # noqa: S102
                             "exec"), namespace)
            if i in checked and printed.getvalue() != _printed(cell):
                stale.append(f"{path.name}, cell {cell.execution_count}: stored\n"
                             f"{_printed(cell)}\nprints today\n{printed.getvalue()}")
    finally:
        plt.close("all")
    return stale


@pytest.mark.parametrize("path", CHECKED_NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_checked_outputs_are_what_its_code_prints_today(path, monkeypatch):
    """Each checked cell prints, at full size, exactly what is stored. These cells only build
    and compile models (seconds); what they print depends on the library (``report()``),
    which the source hash of ``test_notebook_outputs_come_from_its_current_code`` does not
    see."""
    notebook = nbformat.read(path, as_version=4)
    assert notebook.metadata[execute_notebooks.METADATA_KEY]["size"] == "full"
    stale = _stale_outputs(path, notebook, monkeypatch)
    assert not stale, f"{_rerun_hint(path)}; " + "\n\n".join(stale)


def test_output_check_sees_a_stale_output(monkeypatch):
    path = next(p for p in CHECKED_NOTEBOOKS if p.stem.startswith("06"))  # the fastest
    notebook = nbformat.read(path, as_version=4)
    cell = notebook.cells[_checked_cells(notebook)[-1]]
    cell.outputs[0].text += "a line of older code\n"
    stale = _stale_outputs(path, notebook, monkeypatch)
    assert len(stale) == 1 and stale[0].startswith(f"{path.name}, cell {cell.execution_count}")


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
    assert set(api_pages.MODULES) >= {"braintrace", "braintrace.layers", "braintrace.tasks",
                                      "braintrace.nir"}
    assert "tasks" in api_pages.public_names("braintrace")["Modules"]
    assert "api/braintrace.nir" in (DOCS / "api.md").read_text()


def _public_objects():
    for module_name in api_pages.MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isroutine(obj):
                yield f"{module_name}.{name}", obj


def test_api_pages_show_the_private_module_docstrings_their_objects_refer_to():
    import braintrace.nir
    from braintrace import layers

    shown = {name for name, obj in _public_objects() if module_docstrings.appended_lines(obj)}
    assert {"braintrace.online_grad", "braintrace.OnlineGradient",
            "braintrace.layers.LIF"} <= shown
    referring = {name for name, obj in _public_objects()
                 if module_docstrings.refers_to_module_docstring(obj)
                 and module_docstrings.private_module(obj) is not None}
    assert referring == shown  # none refers to a private module without a docstring
    lines = module_docstrings.appended_lines(layers.LIF)
    assert lines[1] == f".. rubric:: {module_docstrings.RUBRIC}"
    assert "\n".join(lines[3:]) == inspect.cleandoc(inspect.getmodule(layers.LIF).__doc__)
    # braintrace.nir is public: its docstring is on its own page, nothing is appended.
    assert module_docstrings.refers_to_module_docstring(braintrace.nir.from_nir)
    assert not module_docstrings.appended_lines(braintrace.nir.from_nir)
    assert not module_docstrings.appended_lines(braintrace.evaluate)  # refers to nothing


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


def _params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _differs(a, b) -> bool:
    return any(not np.allclose(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                     strict=True))


def test_flax_to_braintrace_includes_the_layers_table_alone():
    page = (DOCS / "flax_to_braintrace.md").read_text()
    start, end = re.search(r'```\{include\} \.\./README\.md\n:start-after: "(.*)"\n'
                           r':end-before: "(.*)"\n', page).groups()
    readme = (ROOT / "README.md").read_text()
    passage = readme.split(start, 1)[1].split(end, 1)[0]
    assert "| `ETPLinear`" in passage and "\n#" not in passage  # no NIR (or other) section


def test_flax_to_braintrace_example_does_what_its_page_says():
    """One run of the example (a few seconds), then each section's claims, in the order that
    reads the saved checkpoint's learner before anything steps it on."""
    example = runpy.run_path(str(DOCS / "examples" / "flax_to_braintrace.py"))
    _check_checkpoint(example)
    _check_before_and_after(example)
    _check_own_step_and_evaluate(example)
    _check_classification(example)
    _check_dropout(example)
    trainer_losses = example["trainer_losses"]
    assert trainer_losses.shape == (example["T"],)
    assert bool(jnp.all(jnp.isfinite(trainer_losses)))


def _check_checkpoint(example):
    # The example saves last: the model, optimizer and learner are as they were saved.
    assert example["restored_step"] == example["STEPS"]
    jax.tree.map(np.testing.assert_array_equal, _params(example["resumed_model"]),
                 _params(example["model"]))
    jax.tree.map(np.testing.assert_array_equal,
                 nnx.to_pure_dict(nnx.state(example["resumed_optimizer"])),
                 nnx.to_pure_dict(nnx.state(example["optimizer"])))
    xs, _ = example["time_major"](*example["data"](7))  # hidden states and traces carry on
    np.testing.assert_array_equal(example["resumed_learner"].etrace_evolve(xs),
                                  example["learner"].etrace_evolve(xs))


def _check_before_and_after(example):
    flax_params, online_params = _params(example["flax_model"]), _params(example["model"])
    assert jax.tree.map(jnp.shape, flax_params) == jax.tree.map(jnp.shape, online_params)
    xs_bm, ys_bm = example["data"](0)
    T, batch = example["T"], example["BATCH"]
    assert xs_bm.shape[:2] == (batch, T)  # the pipeline is batch-major, as Flax's
    assert example["flax_model"](xs_bm).shape == ys_bm.shape  # no silent broadcast
    xs, ys = example["time_major"](xs_bm, ys_bm)
    assert xs.shape[:2] == (T, batch)
    # The same initial weights give the same outputs, once the time axis is swapped.
    initial_flax = example["FlaxNet"](2, 32, 2, rngs=nnx.Rngs(0))
    initial = example["Net"](2, 32, 2, rngs=nnx.Rngs(5))
    nnx.update(initial, nnx.state(initial_flax, nnx.Param))
    outputs = braintrace.evaluate(initial, xs, batch_size=batch)
    assert outputs.shape == ys.shape
    np.testing.assert_allclose(np.swapaxes(outputs, 0, 1), initial_flax(xs_bm), rtol=1e-5,
                               atol=1e-6)
    bptt, online = example["bptt_losses"], example["online_losses"]
    # Same initial weights, same first batch: the same model, so the same first loss.
    np.testing.assert_allclose(online[0], bptt[0], rtol=1e-5)
    assert bptt[-1] < 0.5 * bptt[0]
    assert online[-1] < 0.5 * online[0]


def _check_own_step_and_evaluate(example):
    T, batch = example["T"], example["BATCH"]
    own = example["own_losses"]
    assert len(own) == 10 and all(np.isfinite(own))
    assert np.mean(own) < 0.5 * example["online_losses"][0]  # it goes on from the trained model
    # online.grad in one's own step is learner.etrace_grad without the eager checks.
    model = example["model"]
    braintrace.init_states(model, batch)
    xs, ys = example["time_major"](*example["data"](123))
    online = example["online"]
    got, _, stats = online.grad(model, online.init(model), xs, ys)
    learner = example["learner"]
    learner.reset()
    want = learner.etrace_grad(xs, ys, example["mse"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 nnx.to_pure_dict(got), nnx.to_pure_dict(want))
    assert bool(stats.finite) and stats.losses.shape == (T,)
    assert example["predictions"].shape == (T, batch, 2)  # time-major out
    mses = example["test_mse"]
    assert mses["online"] < 0.5 * example["online_losses"][0]
    assert mses["BPTT"] < 0.5 * example["bptt_losses"][0]


def _check_classification(example):
    T, batch = example["T"], example["BATCH"]
    assert example["test_accuracy"] > 1 / 3 + 0.2  # chance is 1/3
    mask = np.asarray(example["per_sample_mask"])
    lengths = np.asarray(example["lengths"])
    assert mask.shape == (T, batch) and (mask.sum(axis=0) == 5).all()
    assert all(mask[length:, b].sum() == 0 for b, length in enumerate(lengths))  # no padding
    assert bool(example["padded_stats"].finite)
    # Unscored steps add nothing: other targets there leave the gradient as it was.
    classifier, classify, test = example["classifier"], example["classify"], example["test"]
    scored = np.asarray(test.mask) > 0
    other = jnp.where(scored[:, None], test.ys, (test.ys + 1) % 3)

    def grads(ys, mask):
        return nnx.to_pure_dict(classify.grad(classifier, classify.init(classifier), test.xs,
                                              ys, mask=mask)[0])

    masked = grads(test.ys, test.mask)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=0), masked,
                 grads(other, test.mask))
    assert _differs(grads(other, None), masked)  # the negative control: unmasked, they count


def _check_dropout(example):
    first, second = (np.asarray(losses) for losses in example["dropout_losses"])
    assert not np.allclose(first, second)  # the RNG stream ran on: other masks
    evaluations = [np.asarray(o) for o in example["eval_outputs"]]
    np.testing.assert_array_equal(*evaluations)
    plain = example["Net"](2, 32, 2, rngs=nnx.Rngs(7))  # the same network without dropout
    nnx.update(plain, nnx.state(example["noisy"], nnx.Param))
    xs, _ = example["time_major"](*example["data"](0))
    np.testing.assert_allclose(evaluations[0],
                               braintrace.evaluate(plain, xs, batch_size=example["BATCH"]),
                               rtol=1e-6, atol=1e-6)


def _run_page(page: pathlib.Path, budget: tuple[str, str] | None = None) -> dict:
    """Runs the page's ``python`` blocks in order, in one namespace, as a reader would;
    ``__blocks__`` holds a copy of the namespace after each block (a later block may reuse
    a name), ``__printed__`` what each block printed. ``budget`` is ``(line, smaller)``: the
    page's line that sets a benchmark's budget, run as ``smaller``."""
    namespace: dict = {"__name__": "__main__"}
    after, printed = [], []
    text = page.read_text()
    if budget is not None:
        assert text.count(f"\n{budget[0]}\n") == 1, f"{page.name} has no line {budget[0]!r}"
        text = text.replace(f"\n{budget[0]}\n", f"\n{budget[1]}\n")
    for block in re.findall(r"^```python\n(.*?)^```$", text, re.DOTALL | re.MULTILINE):
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            exec(compile(block, str(page.relative_to(ROOT)), "exec"), namespace)  # noqa: S102
        after.append(dict(namespace))
        printed.append(output.getvalue())
    namespace["__blocks__"], namespace["__printed__"] = after, printed
    return namespace


def _check_tasks(ns):
    history = ns["history"]
    assert len(history) == 40  # the budget ends the endless stream
    assert list(ns["steps"]) == [10, 20, 30, 40]
    assert all(0.0 <= a <= 1.0 for a in ns["val_accuracy"])
    assert all("val_mean_output" in record for record in history.evaluations)
    # the SHD-format file read, binned and trained on: 2 epochs of 13 batches, the validation
    # split (one sample of each class, its last batch filled up) learned above chance (1/20)
    assert ns["batch"].xs.shape == (20, 16, 700) and ns["batch"].mask.shape == (20, 16)
    assert len(ns["shd_history"]) == 26 and ns["shd"].size("validation") == 20
    assert ns["shd_history"].metric("val_accuracy")[1][-1] >= 0.5


def _check_devices(ns):
    want = nnx.to_pure_dict(nnx.state(ns["model"], nnx.Param))
    got = nnx.to_pure_dict(ns["grads"])  # the neuron-split learner's gradients
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(got))
    assert ns["learner"].mesh.axis_names == ("data", "neuron")


def _check_checkpoints(ns):
    assert ns["restored_step"] == 4
    params = lambda trainer: nnx.to_pure_dict(nnx.state(trainer.learner.model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, params(ns["resumed"]), params(ns["trainer"]))
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(ns["params"]),
                 params(ns["trainer"]))  # plain orbax read the Params without braintrace
    fresh = nnx.to_pure_dict(nnx.state(ns["net"](), nnx.Param))
    assert _differs(fresh, params(ns["trainer"]))  # the negative control: training moved them
    # the fit stopped by Ctrl+C after its 13th batch, resumed by another trainer from there
    interrupted, history = ns["interrupted"], ns["history"]
    assert interrupted.interrupted and len(interrupted) == 13
    assert history.steps[:13] == interrupted.steps  # the checkpoint's History, continued
    assert [r["step"] for r in history.steps] == list(range(1, len(history) + 1))
    assert len(history) == 20 or history.stopped_early


def _check_nir(ns):
    assert ns["y"].shape == (8, 2)
    assert [type(layer).__name__ for layer in ns["restored"].layers] == [
        "ETPLinear", "LIF", "LeakyReadout"]
    assert ns["kinds"] == ["Input", "Conv2d", "IF", "SumPool2d", "Flatten", "Affine", "IF",
                           "Output"]
    assert ns["same"] and [type(layer) for layer in ns["copy"].layers] == [
        type(layer) for layer in ns["cnn"].layers]
    assert np.asarray(ns["spikes"]).any()  # the network is live: equal spikes, not equal silence


def _check_online_rules(ns):
    switching, osttp, fptt = ns["__blocks__"]
    # one string switches a user's own nnx.jit step to OTTT: its traces are input-sized
    assert isinstance(switching["learner"].algorithm, braintrace.OTTT)
    losses = np.asarray(switching["step_losses"])
    assert losses.shape == (switching["T"],) and np.all(np.isfinite(losses))
    B = switching["B"]
    shapes = {leaf.shape for leaf in jax.tree.leaves(switching["state"].traces)}
    assert shapes - {()} == {(B, 3), (B, 16)}  # `B·I`: each operation's input, no weight-sized trace
    fresh = nnx.Sequential(braintrace.layers.ETPLinear(3, 16, rngs=nnx.Rngs(0)))
    assert _differs(_params(fresh)["layers"][0], _params(switching["snn"])["layers"][0])
    # OSTTP: the hidden layer learns from the projected target; strict=True refuses it
    assert osttp["kinds"] == ["target-projection", "fast-signal"]
    assert np.all(np.isfinite(np.asarray(osttp["losses"])))
    with pytest.raises(ValueError, match="target-projection"):
        braintrace.compile(osttp["model"], "osttp", jnp.zeros((8, 3)), batch_size=8,
                           strict=True)
    # FPTT: an update every step under the regulariser, by the trainer and in an nnx.jit step
    assert np.asarray(fptt["losses"]).shape == (20,)
    regulariser = fptt["opt_state"][0]  # fptt_regularizer's FPTTState, first in the chain
    assert bool(regulariser.started)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(_params(fptt["model"])))


def _check_training_spiking(ns):
    page = (DOCS / "training_spiking.md").read_text()
    plain = braintrace.spike_rates(ns["plain"], ns["batch"].xs, batch_size=ns["B"])
    assert set(plain.flagged.values()) == {"silent"} and len(plain.flagged) == 2
    lines = ns["__printed__"][:2]  # the defaults' rates, then the recipe's, before training
    assert lines[0] == plain.line() + "\n" and not {"SILENT", "SATURATED"} & set(lines[1].split())
    assert all(f"```text\n{line}```" in page for line in lines)  # the page shows what they print
    history = ns["history"]
    assert len(history) == ns["steps"] == 2  # the test's budget (PAGE_BUDGETS)
    assert [r["step"] for r in history.spike_rates] == [1, 2]
    assert ns["trainer"].update_every == ns["task"].seq_len
    assert 0.0 <= ns["accuracy"] <= 1.0 and np.all(np.isfinite(history.losses))


def _check_spiking_kit(ns):
    # two CuBaLIF layers trained online: the classes are learned (chance is 1/3) and the
    # regulariser holds the hidden layer near its target (about 0.3 without it)
    assert ns["test_accuracy"] >= 0.8
    assert abs(ns["hidden_rate"] - 0.05) < 0.03
    assert "count.c, n2.i, n2.v  shape=(8, 3)  S=3" in ns["counting"].report(verbose=True)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(ns["grads"]))


PAGE_CHECKS = {"tasks.md": _check_tasks, "devices.md": _check_devices,
               "checkpoints.md": _check_checkpoints, "nir.md": _check_nir,
               "online_rules.md": _check_online_rules, "spiking_kit.md": _check_spiking_kit,
               "training_spiking.md": _check_training_spiking}
"""Each page whose code the reader runs, and what the page says that code does."""

PAGE_BUDGETS = {"training_spiking.md": ("steps = 100", "steps = 2")}
"""A page whose code trains for its benchmark's budget runs here with a smaller one."""


def test_every_page_with_python_code_is_run_by_a_test():
    with_code = {page.name for page in DOCS.glob("*.md") if "```python" in page.read_text()}
    assert with_code == set(PAGE_CHECKS)


@pytest.mark.parametrize("page", sorted(PAGE_CHECKS))
def test_page_code_runs_and_does_what_the_page_says(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    PAGE_CHECKS[page](_run_page(DOCS / page, PAGE_BUDGETS.get(page)))


def test_the_dev_install_opens_and_runs_the_notebooks_as_the_readme_says():
    readme = " ".join((ROOT / "README.md").read_text().split())  # lines joined
    bin_dir = pathlib.Path(sys.executable).parent
    for command in ("lab notebooks/", "nbconvert --execute --to notebook"):
        assert f"`.venv/bin/jupyter {command}" in readme
        assert (bin_dir / f"jupyter-{command.split()[0]}").exists(), (
            f"`jupyter {command.split()[0]}` is not installed: pip install -e '.[dev]'")
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["dev"]
    assert {"jupyterlab", "nbconvert"} <= {re.split(r"[<>=\[ ]", d)[0] for d in dev}


EARLIER_NAMES = ("braintrace.D_RTRL", "braintrace.ES_D_RTRL", "braintrace.pp_prop",
                 ".etrace_evolve(")
"""What the notebooks once called and the README does not: the aliases of ``DRTRL`` and
``ESDRTRL``, and running a test sequence through the learner instead of ``evaluate``."""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_uses_the_readmes_names(path):
    code = "\n".join(cell.source for cell in nbformat.read(path, as_version=4).cells
                     if cell.cell_type == "code")
    for name in EARLIER_NAMES:
        assert name not in code, f"{path.name}: {name}"


def test_api_pages_show_what_a_class_inherits_from_braintrace_only():
    """A class's page lists the members it inherits from braintrace's own bases (the learner's
    and trainer's ``save``/``restore``, written once on a private base), never those of Flax's
    or Python's classes; its own members and data attributes stay."""
    from flax import nnx

    import braintrace
    from braintrace import layers
    from braintrace._primitives._sparse import Connectivity

    skip = lambda obj: own_inherited_members._on_skip_member(None, "class", "m", obj, False, {})
    for cls in (braintrace.OnlineLearner, braintrace.OnlineTrainer):
        assert skip(cls.save) is None and skip(cls.restore) is None
    assert skip(layers.ETPLinear.__call__) is None
    assert skip(vars(Connectivity)["transposed"]) is None  # a cached property of ours
    assert skip(braintrace.OnlineLearner.traces) is None  # a property of ours
    assert skip(nnx.Module.sow) is True and skip(nnx.Module.iter_modules) is True
    assert skip(tuple.count) is True and skip(object.__init_subclass__) is True
    assert own_inherited_members._on_skip_member(None, "class", "m", nnx.Module.sow, True,
                                                 {}) is None  # skipped anyway: left alone
