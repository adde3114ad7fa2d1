"""The README's quick example and its "Inside your own train step" run as written."""

import pathlib
import re

import jax
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_quick_example_and_the_train_step_section_run(capsys):
    blocks = python_blocks()
    quick = next(b for b in blocks if "class Net" in b)
    inside = next(b for b in blocks if "def train_step(model, optimizer, state" in b)
    namespace: dict = {}
    exec(compile(quick + "\n" + inside, str(README), "exec"), namespace)  # noqa: S102
    capsys.readouterr()
    assert namespace["losses"].shape == (4, 25)
    assert bool(namespace["stats"].finite)
    assert np.all(np.isfinite(np.asarray(namespace["outputs"])))
    assert jax.tree.leaves(namespace["state"].traces)  # the traces carried across chunks
