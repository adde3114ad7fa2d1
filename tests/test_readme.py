"""The README's quick example, and its "Inside your own train step" after it, run as written."""

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
