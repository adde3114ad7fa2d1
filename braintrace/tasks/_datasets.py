r"""Real sequence-classification data sets, behind the optional ``tasks`` extra.

Each data set is a frozen dataclass with a train / validation / test split,
fixed by its ``seed``. :meth:`AbstractDataset.sample` draws a training batch
from a PRNG key, like the synthetic tasks; :meth:`AbstractDataset.split`
returns a whole split as one :class:`~braintrace.tasks.Batch`. Every sequence
has one label, scored at the last step (the mask is 1 there only).

Nothing is downloaded: MNIST-1D is generated from the ``mnist1d`` package's
own templates and seed (``make_dataset``, not ``get_dataset``), and the 8×8
digits ship inside scikit-learn. The arrays are built once per process and
data set, and kept.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import importlib
import random
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from braintrace.tasks._batch import Batch

__all__ = ["MNIST1D", "AbstractDataset", "SequentialDigits", "SpikingDigits"]

SPLITS = ("train", "validation", "test")
_INSTALL = 'pip install -e ".[tasks]"  (or: pip install "braintrace-nnx[tasks]")'

# (x (N, T, I) float32, y (N,) int32) per split name
Arrays = dict[str, tuple[np.ndarray, np.ndarray]]


def _require(module: str, package: str, user: str) -> ModuleType:
    """Imports an optional dependency, or says which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"braintrace.tasks.{user} needs the optional package '{package}', which is not "
            f"installed. Install the tasks extra: {_INSTALL}") from err


def stratified(labels: np.ndarray, fraction: float, rng: np.random.Generator
                ) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(rest, held_out)``: ``fraction`` of each class held out, both sorted."""
    held = []
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        held.append(members[:round(fraction * len(members))])
    held = np.sort(np.concatenate(held))
    return np.setdiff1d(np.arange(len(labels)), held), held


def _frozen(arrays: Arrays) -> Arrays:
    for x, y in arrays.values():
        x.setflags(write=False)
        y.setflags(write=False)
    return arrays


@functools.cache
def _mnist1d_arrays(seed: int, validation_fraction: float) -> Arrays:
    data_module = _require("mnist1d.data", "mnist1d", "MNIST1D")
    args = data_module.get_dataset_args()
    args.seed = seed
    # make_dataset seeds NumPy's and Python's global generators: leave them as they were.
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        data = data_module.make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    x = data["x"].astype(np.float32)[..., None]
    y = data["y"].astype(np.int32)
    rest, held = stratified(y, validation_fraction, np.random.default_rng(seed))
    return _frozen({
        "train": (x[rest], y[rest]),
        "validation": (x[held], y[held]),
        "test": (data["x_test"].astype(np.float32)[..., None], data["y_test"].astype(np.int32)),
    })


@functools.cache
def _digits_images(seed: int, test_fraction: float, validation_fraction: float
                   ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The 8×8 digits scaled to [0, 1], ``(N, 64)`` row by row, split per class."""
    datasets = _require("sklearn.datasets", "scikit-learn", "SequentialDigits / SpikingDigits")
    digits = datasets.load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    rng = np.random.default_rng(seed)
    rest, test = stratified(y, test_fraction, rng)
    train, validation = stratified(y[rest], validation_fraction / (1 - test_fraction), rng)
    return {"train": (x[rest][train], y[rest][train]),
            "validation": (x[rest][validation], y[rest][validation]), "test": (x[test], y[test])}


class AbstractDataset(abc.ABC):
    """A labelled data set of sequences, split into train, validation and test.

    A final subclass is a frozen dataclass that says how many steps, channels
    and classes it has and builds its arrays in :meth:`arrays`.
    """

    @property
    @abc.abstractmethod
    def seq_len(self) -> int:
        """The sequence length ``T``."""

    @property
    @abc.abstractmethod
    def num_inputs(self) -> int:
        """Input channels ``I``."""

    @abc.abstractmethod
    def arrays(self) -> Arrays:
        """``{split: (x (N, T, I) float32, y (N,) int32)}``, read-only NumPy arrays."""

    num_classes: int = 10

    def _batch(self, x: jax.Array, y: jax.Array) -> Batch:
        xs = jnp.moveaxis(x, 0, 1)
        ys = jnp.broadcast_to(y, (self.seq_len, y.shape[0]))
        mask = (jnp.arange(self.seq_len) == self.seq_len - 1).astype(jnp.float32)
        return Batch(xs, ys, mask)

    def split(self, name: str) -> Batch:
        """The whole split ``name`` (``'train'``, ``'validation'`` or ``'test'``) as one Batch."""
        if name not in SPLITS:
            raise ValueError(f"{type(self).__name__}.split: name must be one of {SPLITS}, "
                             f"got {name!r}.")
        x, y = self.arrays()[name]
        return self._batch(jnp.asarray(x), jnp.asarray(y))

    def size(self, name: str) -> int:
        """Number of sequences in split ``name``."""
        return len(self.arrays()[name][1])

    def sample(self, key: jax.Array, batch_size: int) -> Batch:
        """Draws ``batch_size`` training sequences uniformly, with replacement."""
        x, y = self.arrays()["train"]
        index = jax.random.randint(key, (batch_size,), 0, len(y))
        return self._batch(jnp.asarray(x)[index], jnp.asarray(y)[index])


@dataclasses.dataclass(frozen=True)
class MNIST1D(AbstractDataset):
    r"""MNIST-1D (Greydanus 2020): ten 1-D digit templates, shifted, scaled, sheared, noised.

    Generated offline with ``mnist1d.data.make_dataset`` and the package's
    default arguments (5000 sequences of 40 steps, the authors' 4000 / 1000
    train / test split), with ``seed`` as its generation seed (the authors'
    published set uses 42). A ``validation_fraction`` of each class of the
    training set, chosen by ``seed``, is held out for validation. One input
    channel, standardised by the generator. The authors report test
    accuracies of 32% (logistic regression), 68% (MLP), 91% (GRU), 94% (CNN).

    Attributes:
        seed: Generation seed of the data set and of the validation split.
        validation_fraction: Share of each class of the training set held out.

    Example:
        >>> import jax
        >>> from braintrace.tasks import MNIST1D
        >>> task = MNIST1D()
        >>> batch = task.sample(jax.random.key(0), batch_size=4)
        >>> batch.xs.shape, batch.ys.shape, batch.mask.shape
        ((40, 4, 1), (40, 4), (40,))
        >>> [task.size(s) for s in ("train", "validation", "test")]
        [3601, 399, 1000]
    """

    seed: int = 42
    validation_fraction: float = 0.1

    def __post_init__(self):
        _require("mnist1d.data", "mnist1d", "MNIST1D")
        if not 0 < self.validation_fraction < 1:
            raise ValueError(f"MNIST1D: validation_fraction must be in (0, 1), got "
                             f"{self.validation_fraction}.")

    @property
    def seq_len(self) -> int:
        return 40

    @property
    def num_inputs(self) -> int:
        return 1

    def arrays(self) -> Arrays:
        return _mnist1d_arrays(self.seed, self.validation_fraction)


@dataclasses.dataclass(frozen=True)
class _Digits(AbstractDataset):
    seed: int = 0
    test_fraction: float = 0.2
    validation_fraction: float = 0.1

    def __post_init__(self):
        _require("sklearn.datasets", "scikit-learn", type(self).__name__)
        if not (0 < self.test_fraction and 0 < self.validation_fraction
                and self.test_fraction + self.validation_fraction < 1):
            raise ValueError(
                f"{type(self).__name__}: test_fraction and validation_fraction must be positive "
                f"with a sum below 1, got {self.test_fraction} and {self.validation_fraction}.")


@dataclasses.dataclass(frozen=True)
class SequentialDigits(_Digits):
    r"""scikit-learn's 8×8 handwritten digits, read one pixel per step.

    The 1797 images of ``sklearn.datasets.load_digits`` (shipped with
    scikit-learn), intensities scaled to ``[0, 1]``, are read row by row:
    ``T = 64`` steps of one channel, ten classes, the class scored at the last
    step. The splits are stratified per class and fixed by ``seed``:
    ``test_fraction`` for test, ``validation_fraction`` of the whole set for
    validation, the rest for training.

    Attributes:
        seed: Seed of the split.
        test_fraction: Share of each class in the test split.
        validation_fraction: Share of each class in the validation split.

    Example:
        >>> import jax
        >>> from braintrace.tasks import SequentialDigits
        >>> task = SequentialDigits()
        >>> test = task.split("test")
        >>> test.xs.shape, test.ys.shape, float(test.mask.sum())
        ((64, 359, 1), (64, 359), 1.0)
        >>> sum(task.size(s) for s in ("train", "validation", "test"))
        1797
    """

    @property
    def seq_len(self) -> int:
        return 64

    @property
    def num_inputs(self) -> int:
        return 1

    def arrays(self) -> Arrays:
        return _sequential_arrays(self.seed, self.test_fraction, self.validation_fraction)


@dataclasses.dataclass(frozen=True)
class SpikingDigits(_Digits):
    r"""The 8×8 digits latency-coded as spikes: brighter pixels fire earlier.

    Each of the 64 pixels is an input channel that fires once, at step

    .. math::

        t = \operatorname{round}\big((1 - v)\,(T_c - 1)\big), \qquad T_c = T - \text{silent},

    for intensity ``v ∈ (0, 1]`` (a blank pixel never fires); the last
    ``silent_steps`` steps carry no spikes, and the class is scored at the last
    step. Same images and splits as :class:`SequentialDigits` for the same
    seed and fractions. The code is deterministic: a training batch differs
    from another only in which images it holds.

    Attributes:
        seq_len: Sequence length ``T``.
        silent_steps: Spike-free steps at the end, before the answer.

    Example:
        >>> import jax
        >>> from braintrace.tasks import SpikingDigits
        >>> task = SpikingDigits()
        >>> batch = task.sample(jax.random.key(0), batch_size=8)
        >>> batch.xs.shape, sorted(set(batch.xs.ravel().tolist()))
        ((32, 8, 64), [0.0, 1.0])
        >>> bool((batch.xs.sum(0) <= 1).all())  # at most one spike per pixel
        True
    """

    seq_len: int = 32
    silent_steps: int = 4

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.silent_steps <= self.seq_len - 2:
            raise ValueError(f"SpikingDigits: silent_steps must be in [0, seq_len - 2 = "
                             f"{self.seq_len - 2}], got {self.silent_steps}.")

    @property
    def num_inputs(self) -> int:
        return 64

    def arrays(self) -> Arrays:
        return _spike_arrays(self.seed, self.test_fraction, self.validation_fraction,
                             self.seq_len, self.silent_steps)


@functools.cache
def _sequential_arrays(seed: int, test_fraction: float, validation_fraction: float) -> Arrays:
    images = _digits_images(seed, test_fraction, validation_fraction)
    return _frozen({name: (x[..., None], y) for name, (x, y) in images.items()})


@functools.cache
def _spike_arrays(seed: int, test_fraction: float, validation_fraction: float, seq_len: int,
                  silent_steps: int) -> Arrays:
    coded = seq_len - silent_steps
    out = {}
    for name, (x, y) in _digits_images(seed, test_fraction, validation_fraction).items():
        when = np.rint((1.0 - x) * (coded - 1)).astype(np.int32)
        spikes = (np.arange(seq_len)[None, :, None] == when[:, None, :]) & (x[:, None, :] > 0)
        out[name] = (spikes.astype(np.float32), y)
    return _frozen(out)
