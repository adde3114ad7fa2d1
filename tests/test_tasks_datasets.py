"""The real data sets of ``braintrace.tasks``: shapes, labels, splits, determinism, the extra."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from braintrace import tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATASETS = [
    pytest.param(tasks.MNIST1D, 40, 1, id="mnist1d"),
    pytest.param(tasks.SequentialDigits, 64, 1, id="sequential_digits"),
    pytest.param(tasks.SpikingDigits, 32, 64, id="spiking_digits"),
]


@pytest.mark.parametrize("cls, seq_len, num_inputs", DATASETS)
def test_dataset_batches_have_the_task_layout(cls, seq_len, num_inputs):
    task = cls()
    assert (task.seq_len, task.num_inputs, task.num_classes) == (seq_len, num_inputs, 10)
    batch = task.sample(jax.random.key(0), 5)
    assert batch.xs.shape == (seq_len, 5, num_inputs) and batch.xs.dtype == np.float32
    assert batch.ys.shape == (seq_len, 5) and batch.ys.dtype == np.int32
    assert bool((batch.ys == batch.ys[-1]).all())  # one label per sequence
    np.testing.assert_array_equal(batch.mask, np.eye(seq_len)[-1])  # scored at the last step
    test = task.split("test")
    assert test.xs.shape == (seq_len, task.size("test"), num_inputs)
    assert set(np.unique(test.ys).tolist()) == set(range(10))


@pytest.mark.parametrize("cls, seq_len, num_inputs", DATASETS)
def test_dataset_splits_are_disjoint_and_class_balanced(cls, seq_len, num_inputs):
    task = cls()
    arrays = task.arrays()
    assert set(arrays) == {"train", "validation", "test"}
    rows = {name: {x.tobytes() for x in arrays[name][0]} for name in arrays}
    assert not rows["validation"] & rows["test"]
    # Identical sequences may occur within a set (blank-ish digits); nearly all are distinct.
    assert len(rows["train"] & rows["test"]) <= 2
    for name, (x, y) in arrays.items():
        counts = np.bincount(y, minlength=10)
        assert counts.min() >= 0.75 * counts.mean(), (name, counts)
        assert not x.flags.writeable
    assert task.size("train") > 4 * task.size("validation")


@pytest.mark.parametrize("cls, seq_len, num_inputs", DATASETS)
def test_dataset_is_deterministic_per_seed_and_key(cls, seq_len, num_inputs):
    a, b = cls(), cls()
    np.testing.assert_array_equal(a.sample(jax.random.key(3), 7).xs,
                                  b.sample(jax.random.key(3), 7).xs)
    assert not np.array_equal(a.sample(jax.random.key(3), 7).ys[-1],
                              a.sample(jax.random.key(4), 7).ys[-1])
    other = cls(seed=1)
    assert not np.array_equal(a.split("validation").ys[-1], other.split("validation").ys[-1])


def test_mnist1d_generation_leaves_numpy_global_state_alone():
    np.random.seed(5)
    expected = np.random.rand()
    np.random.seed(5)
    tasks.MNIST1D(seed=7).arrays()
    assert np.random.rand() == expected


def test_mnist1d_test_split_is_the_authors_last_thousand():
    from mnist1d.data import get_dataset_args, make_dataset

    data = make_dataset(get_dataset_args())
    x, y = tasks.MNIST1D().arrays()["test"]
    np.testing.assert_allclose(x[..., 0], data["x_test"], rtol=1e-6)
    np.testing.assert_array_equal(y, data["y_test"])


def test_sequential_digits_reads_pixels_row_by_row():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = tasks.SequentialDigits().arrays()["train"]
    image = x[0, :, 0] * 16.0
    matches = np.flatnonzero((np.abs(digits.data - image) < 1e-4).all(axis=1))
    assert matches.size and y[0] in digits.target[matches]
    assert 0.0 <= x.min() and x.max() <= 1.0


def test_spiking_digits_latency_code_fires_brighter_pixels_earlier():
    task = tasks.SpikingDigits(seq_len=20, silent_steps=3)
    (spikes, y), (images, y_images) = task.arrays()["test"], tasks.SequentialDigits().arrays()["test"]
    np.testing.assert_array_equal(y, y_images)
    images = images[..., 0]
    assert spikes.shape == (len(y), 20, 64)
    np.testing.assert_array_equal(spikes.sum(1), images > 0)  # one spike per lit pixel
    assert not spikes[:, -3:].any()
    first = spikes.argmax(1)
    brightest = images == 1.0
    assert (first[brightest] == 0).all()
    dim = (images > 0) & (images < 0.2)
    assert (first[dim] >= 13).all()


@pytest.mark.parametrize("blocked, cls, package", [
    ("mnist1d", "MNIST1D", "mnist1d"),
    ("sklearn", "SequentialDigits", "scikit-learn"),
    ("sklearn", "SpikingDigits", "scikit-learn"),
])
def test_missing_extra_names_the_install_command(blocked, cls, package):
    # A fresh process where the package cannot be imported, as without the extra.
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"
            "from braintrace import tasks\n"
            f"try:\n    tasks.{cls}()\nexcept ImportError as e:\n    print(e)\n"
            "else:\n    print('no error')")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"'{package}'" in out.stdout and 'pip install -e ".[tasks]"' in out.stdout, out.stdout
    assert cls in out.stdout


def test_split_rejects_an_unknown_name():
    with pytest.raises(ValueError, match="'valid'"):
        tasks.SequentialDigits().split("valid")
