"""The README's quick example, its "Inside your own train step" and its classification recipe
after it, run as written."""

import pathlib
import re

import jax
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quick_example_and_train_step_section_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102
    assert namespace["losses"].shape == (100,)
    assert set(namespace["grads"].keys()) == {"rnn", "out"}
    inside = next(b for b in blocks if "def train_step(model, optimizer, state" in b)
    exec(compile(inside, str(README), "exec"), namespace)  # noqa: S102
    assert [losses.shape for losses in namespace["losses"]] == [(25,)] * 4
    assert bool(namespace["stats"].finite)
    assert np.all(np.isfinite(np.asarray(namespace["outputs"])))
    assert jax.tree.leaves(namespace["state"].traces)  # the traces carried across chunks


def test_readme_classification_recipe_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    recipe = next(b for b in blocks if "mask=last" in b)
    namespace: dict = {}
    exec(compile(blocks[0].split("model = Net(")[0], str(README), "exec"), namespace)  # noqa: S102
    exec(compile(recipe, str(README), "exec"), namespace)  # noqa: S102
    assert namespace["labels"].shape == (16,) and namespace["ys"].shape == (100, 16)
    assert float(namespace["last"].sum()) == 1.0 and float(namespace["last"][-1]) == 1.0
    assert 0.0 <= float(namespace["accuracy"]) <= 1.0
