r"""The field's event data sets read from files the user has: SHD, SSC and N-MNIST.

Each is a frozen dataclass that reads its files when it is made (every sample
checked first: a damaged file is an error naming it and the sample, and nothing
is kept), holds the events compactly, and bins a batch's events into
``(T, B, channels)`` spikes and a ``(T, B)`` padding mask when it is drawn
(``braintrace.tasks._events`` describes the binning). Nothing is downloaded.

A :class:`~braintrace.tasks.Batch` of these sets has labels at every step and a
per-sample mask that is 1 on each sample's steps and 0 on its padding, so the
per-step loss is scored at every real step (a rate-coded loss). To score a
readout where each sample ends instead, ``batch._replace(mask=last_step_mask(
batch.mask.sum(0).astype(int), T))`` (:func:`~braintrace.tasks.last_step_mask`).
"""

from __future__ import annotations

import abc
import dataclasses
import math
import os
import pathlib
from collections.abc import Iterator
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from braintrace.tasks._batch import Batch
from braintrace.tasks._datasets import SPLITS, stratified
from braintrace.tasks._events import Events, bin_events
from braintrace.tasks._hdf5 import read_spikes
from braintrace.tasks._nmnist import SENSOR, read_folder

__all__ = ["NMNIST", "SHD", "SSC", "AbstractEventDataset"]


class AbstractEventDataset(abc.ABC):
    """Labelled event recordings split into train, validation and test, binned per batch.

    A final subclass (:class:`SHD`, :class:`SSC`, :class:`NMNIST`, a
    :func:`from_tonic` data set) is a frozen dataclass with the binning fields
    ``num_steps``, ``max_time`` and ``binary`` that says its frame shape and
    classes and keeps its splits' events (read when it is made). Its batches are
    drawn here: :meth:`sample`, :meth:`batches`, :meth:`split`.

    Example:
        >>> import numpy as np, tempfile, pathlib
        >>> from braintrace.tasks import NMNIST
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> for split in ("Train", "Test"):
        ...     (root / split / "5").mkdir(parents=True)
        ...     for i in range(3):  # two events at x=i, y=0: at 0 and 1 ms
        ...         _ = (root / split / "5" / f"{i}.bin").write_bytes(bytes([i, 0, 0, 0, 0])
        ...                                                           + bytes([i, 0, 0, 3, 0xE8]))
        >>> task = NMNIST(root, num_steps=4, max_time=0.004, validation_fraction=0.4)
        >>> [b.mask.sum(0).tolist() for b in task.batches("test", 2)]  # last batch filled up
        [[2.0, 2.0], [2.0, 0.0]]
    """

    num_steps: int
    max_time: float | None
    binary: bool
    flatten: bool
    _splits: dict[str, Events]

    @property
    @abc.abstractmethod
    def frame_shape(self) -> tuple[int, ...]:
        """The shape of one step's input per sample, channels last (``(700,)``, ``(34, 34, 2)``)."""

    @property
    @abc.abstractmethod
    def num_classes(self) -> int:
        """Number of classes."""

    @property
    def seq_len(self) -> int:
        """Steps ``T`` of every batch."""
        return self.num_steps

    @property
    def num_inputs(self) -> int:
        """Input channels: the frame's size."""
        return math.prod(self.frame_shape)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One step's input per sample: ``(num_inputs,)``, or the frame with ``flatten=False``."""
        return (self.num_inputs,) if self.flatten else self.frame_shape

    def _check_binning(self) -> None:
        name = type(self).__name__
        if not (isinstance(self.num_steps, int) and self.num_steps > 0):
            raise ValueError(f"{name}: num_steps must be a positive int, got {self.num_steps!r}.")
        if self.max_time is not None and not (math.isfinite(self.max_time)
                                              and self.max_time > 0):
            raise ValueError(f"{name}: max_time must be a positive number of seconds or None "
                             f"(each sample stretched over num_steps), got {self.max_time!r}.")

    def _keep(self, splits: dict[str, Events]) -> None:
        object.__setattr__(self, "_splits", splits)

    def _events(self, name: str) -> Events:
        if name not in SPLITS:
            raise ValueError(f"{type(self).__name__}: the split must be one of {SPLITS}, got "
                             f"{name!r}.")
        return self._splits[name]

    def size(self, name: str) -> int:
        """Number of samples in split ``name``."""
        return len(self._events(name))

    def batch_of(self, name: str, index: np.ndarray, size: int | None = None) -> Batch:
        """The samples ``index`` of split ``name`` binned into one :class:`Batch`.

        With ``size``, the batch is filled up to ``size`` samples with empty ones its
        mask weighs 0.
        """
        events = self._events(name).take(np.asarray(index, np.int64))
        xs, mask = bin_events(events, self.num_inputs, self.num_steps, self.max_time,
                              self.binary)
        ys = np.broadcast_to(events.labels, mask.shape)
        fill = ((0, 0), (0, 0 if size is None else size - len(events)))
        xs, ys, mask = (np.pad(a, fill + ((0, 0),) * (a.ndim - 2)) for a in (xs, ys, mask))
        xs = xs.reshape(*mask.shape, *self.input_shape)
        return Batch(jnp.asarray(xs), jnp.asarray(ys, jnp.int32), jnp.asarray(mask))

    def split(self, name: str) -> Batch:
        """The whole split ``name`` as one Batch (for a large split, see :meth:`batches`)."""
        return self.batch_of(name, np.arange(self.size(name)))

    def sample(self, key: jax.Array, batch_size: int) -> Batch:
        """Draws ``batch_size`` training samples uniformly, with replacement, by ``key``."""
        return self.batch_of("train", _rng(key).integers(0, self.size("train"), batch_size))

    def batches(self, name: str, batch_size: int, *, key: jax.Array | None = None
                ) -> Iterator[Batch]:
        """The split ``name`` once, in batches of ``batch_size`` (shuffled by ``key`` if given).

        Every batch has ``batch_size`` samples, so one compiled step serves them all:
        the last is filled up with empty samples that its mask weighs 0 (they add
        nothing to a loss, a gradient or :func:`~braintrace.tasks.accuracy`).
        """
        size = self.size(name)
        order = np.arange(size) if key is None else _rng(key).permutation(size)
        for start in range(0, size, batch_size):
            yield self.batch_of(name, order[start:start + batch_size], batch_size)


def _rng(key: jax.Array) -> np.random.Generator:
    """A NumPy generator seeded by a JAX key: the data are drawn on the host."""
    return np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())


def validation_split(name: str, train: Events, fraction: float, seed: int
                      ) -> tuple[Events, Events]:
    if not 0 < fraction < 1:
        raise ValueError(f"{name}: validation_fraction must be in (0, 1), got {fraction}.")
    rest, held = stratified(train.labels, fraction, np.random.default_rng(seed))
    return train.take(rest), train.take(held)


def _folder(path: str | os.PathLike, name: str) -> pathlib.Path:
    folder = pathlib.Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{name}: no folder '{folder}'. Nothing is downloaded: give the "
                                f"folder that holds the published files.")
    return folder


@dataclasses.dataclass(frozen=True)
class SHD(AbstractEventDataset):
    r"""Spiking Heidelberg Digits (Cramer et al. 2020): spoken digits as spikes on 700 channels.

    Reads ``shd_train.h5`` and ``shd_test.h5`` (decompressed) from the folder
    ``path``; 20 classes (ten digits in English and German). A stratified
    ``validation_fraction`` of the training file, chosen by ``seed``, is held out
    as the validation split (the published set has none). The default binning is
    Zenke's: ``T = 100`` steps over ``1.4 s`` (14 ms per step), 0/1 spikes.

    Attributes:
        path: Folder holding the files.
        num_steps: Steps ``T``.
        max_time: Window in seconds (``None``: each sample stretched over ``T``).
        binary: Whether a step is a spike (else a count of events).
        validation_fraction: Share of each class of the training file held out.
        seed: Seed of the validation split.

    Example:
        >>> import jax, numpy as np, h5py, tempfile, pathlib
        >>> from braintrace.tasks import SHD
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> for split, n in (("train", 40), ("test", 4)):  # a tiny SHD-format file per split
        ...     with h5py.File(folder / f"shd_{split}.h5", "w") as f:
        ...         times = f.create_dataset("spikes/times", (n,), h5py.vlen_dtype(np.float16))
        ...         units = f.create_dataset("spikes/units", (n,), h5py.vlen_dtype(np.uint16))
        ...         for i in range(n):
        ...             times[i] = np.array([0.01, 0.5 + i / 100], np.float16)
        ...             units[i] = np.array([i, 699], np.uint16)
        ...         f["labels"] = np.arange(n, dtype=np.uint8) % 20
        >>> task = SHD(folder, validation_fraction=0.5)  # T = 100 steps over 1.4 s
        >>> [task.size(s) for s in ("train", "validation", "test")]
        [20, 20, 4]
        >>> batch = task.sample(jax.random.key(0), batch_size=8)
        >>> batch.xs.shape, batch.ys.shape, batch.mask.shape
        ((100, 8, 700), (100, 8), (100, 8))
        >>> test = task.split("test")
        >>> test.mask.sum(0).tolist()  # steps up to each one's last spike (0.5 s: step 35)
        [36.0, 37.0, 38.0, 38.0]
    """

    path: str | os.PathLike
    num_steps: int = 100
    max_time: float | None = 1.4
    binary: bool = True
    validation_fraction: float = 0.1
    seed: int = 0
    flatten: ClassVar[bool] = True
    _splits: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self._check_binning()
        folder = _folder(self.path, "SHD")
        train, test = (read_spikes(folder / f"shd_{s}.h5", 700, 20, "SHD")
                       for s in ("train", "test"))
        train, validation = validation_split("SHD", train, self.validation_fraction, self.seed)
        self._keep({"train": train, "validation": validation, "test": test})

    @property
    def frame_shape(self) -> tuple[int, ...]:
        return (700,)

    @property
    def num_classes(self) -> int:
        return 20


@dataclasses.dataclass(frozen=True)
class SSC(AbstractEventDataset):
    r"""Spiking Speech Commands (Cramer et al. 2020): 35 spoken words as spikes on 700 channels.

    Reads ``ssc_train.h5``, ``ssc_valid.h5`` and ``ssc_test.h5`` (decompressed)
    from the folder ``path``, the published train / validation / test splits.
    Binning as :class:`SHD` (speech commands last up to 1 s).

    Attributes:
        path: Folder holding the files.
        num_steps: Steps ``T``.
        max_time: Window in seconds (``None``: each sample stretched over ``T``).
        binary: Whether a step is a spike (else a count of events).

    Example:
        >>> import numpy as np, h5py, tempfile, pathlib
        >>> from braintrace.tasks import SSC
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> for split in ("train", "valid", "test"):
        ...     with h5py.File(folder / f"ssc_{split}.h5", "w") as f:
        ...         times = f.create_dataset("spikes/times", (2,), h5py.vlen_dtype(np.float16))
        ...         units = f.create_dataset("spikes/units", (2,), h5py.vlen_dtype(np.uint16))
        ...         times[0], units[0] = np.array([0.15], np.float16), np.array([3], np.uint16)
        ...         times[1], units[1] = np.array([0.95], np.float16), np.array([5], np.uint16)
        ...         f["labels"] = np.array([0, 34], np.uint8)
        >>> task = SSC(folder, num_steps=10, max_time=1.0)
        >>> test = task.split("test")
        >>> test.xs.shape, test.ys[0].tolist(), test.mask.sum(0).tolist()
        ((10, 2, 700), [0, 34], [2.0, 10.0])
    """

    path: str | os.PathLike
    num_steps: int = 100
    max_time: float | None = 1.4
    binary: bool = True
    flatten: ClassVar[bool] = True
    _splits: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self._check_binning()
        folder = _folder(self.path, "SSC")
        self._keep({split: read_spikes(folder / f"ssc_{name}.h5", 700, 35, "SSC")
                    for split, name in zip(SPLITS, ("train", "valid", "test"), strict=True)})

    @property
    def frame_shape(self) -> tuple[int, ...]:
        return (700,)

    @property
    def num_classes(self) -> int:
        return 35


@dataclasses.dataclass(frozen=True)
class NMNIST(AbstractEventDataset):
    r"""N-MNIST (Orchard et al. 2015): MNIST digits seen by an event camera in three saccades.

    Reads the folder ``path`` holding ``Train/`` and ``Test/`` (one folder per
    digit of ``.bin`` files, as the published zips unpack;
    ``braintrace.tasks._nmnist`` has the 40-bit record format). Events of a
    34 × 34 sensor with two polarities: 2312 input channels, or frames
    ``(34, 34, 2)`` (channels last, for a :class:`~braintrace.layers.ConvLIF`)
    with ``flatten=False``. The default binning is one step per millisecond over
    the 300 ms of the saccades. A stratified ``validation_fraction`` of ``Train``,
    chosen by ``seed``, is the validation split.

    Attributes:
        path: Folder holding ``Train/`` and ``Test/``.
        num_steps: Steps ``T``.
        max_time: Window in seconds (``None``: each sample stretched over ``T``).
        binary: Whether a step is a spike (else a count of events).
        flatten: Whether a step's input is a vector of 2312 channels (else a frame).
        validation_fraction: Share of each class of ``Train`` held out.
        seed: Seed of the validation split.

    Example:
        >>> import numpy as np, tempfile, pathlib
        >>> from braintrace.tasks import NMNIST
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> for split, digits in (("Train", range(10)), ("Test", (3,))):
        ...     for d in digits:
        ...         (root / split / str(d)).mkdir(parents=True)
        ...         for i in range(2):  # an ON event at x=d, y=i at 1 ms, an OFF at 2.5 ms
        ...             _ = (root / split / str(d) / f"{i:05d}.bin").write_bytes(bytes(
        ...                 [d, i, 0x80, 0x03, 0xE8, d, i, 0x00, 0x09, 0xC4]))
        >>> task = NMNIST(root, num_steps=5, max_time=0.005, flatten=False)
        >>> test = task.split("test")
        >>> test.xs.shape, test.ys[0].tolist(), test.mask.sum(0).tolist()
        ((5, 2, 34, 34, 2), [3, 3], [3.0, 3.0])
        >>> [float(test.xs[step, 1, 1, 3, p]) for step, p in ((1, 1), (2, 0))]  # y=1, x=3
        [1.0, 1.0]
    """

    path: str | os.PathLike
    num_steps: int = 300
    max_time: float | None = 0.3
    binary: bool = True
    flatten: bool = True
    validation_fraction: float = 0.1
    seed: int = 0
    _splits: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self._check_binning()
        folder = _folder(self.path, "NMNIST")
        train, test = (read_folder(folder / s, "NMNIST") for s in ("Train", "Test"))
        train, validation = validation_split("NMNIST", train, self.validation_fraction,
                                              self.seed)
        self._keep({"train": train, "validation": validation, "test": test})

    @property
    def frame_shape(self) -> tuple[int, ...]:
        return SENSOR

    @property
    def num_classes(self) -> int:
        return 10
