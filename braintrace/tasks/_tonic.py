r"""Data sets of the ``tonic`` package (``tonic.datasets.SHD``, ``NMNIST``, ...) as tasks.

tonic (an optional package, never imported here) hands out samples as
``events, label = dataset[i]``: a NumPy structured array with a time field
``t`` (microseconds) and address fields ``x`` (and ``y``, ``p``), and a
``sensor_size = (W, H, P)`` (width, height, polarities; ``(700, 1, 1)`` for
SHD). :func:`from_tonic` reads every sample of the datasets it is given, checks
it, and keeps the events as :class:`~braintrace.tasks.SHD` keeps a file's: an
event is channel ``(y·W + x)·P + p`` (``p`` ignored when ``P = 1``, as tonic's
SHD stores ``p = 1``), so a step is a channels-last frame ``(H, W, P)``. Build
the tonic datasets without a ``transform``: braintrace bins the raw events.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from braintrace.tasks._event_datasets import AbstractEventDataset, validation_split
from braintrace.tasks._events import Events, concatenate

__all__ = ["TonicDataset", "from_tonic"]


def _sensor(dataset: Any, name: str) -> tuple[int, int, int]:
    size = getattr(dataset, "sensor_size", None)
    try:
        width, height, polarities = (int(s) for s in size)
    except (TypeError, ValueError):
        raise ValueError(f"from_tonic: the {name} dataset has sensor_size {size!r}; a tonic "
                         f"dataset gives (width, height, polarities), e.g. (700, 1, 1).") from None
    return width, height, polarities


def _fields(events: Any, where: str) -> tuple[str, ...]:
    """The fields of raw events, or a ValueError naming the sample."""
    names = getattr(getattr(events, "dtype", None), "names", None) or ()
    if "t" not in names or "x" not in names:
        raise ValueError(f"from_tonic: {where} is not raw events (a structured array with "
                         f"fields 't' and 'x', got {type(events).__name__} with fields "
                         f"{list(names)}); build the tonic dataset without a transform.")
    return names


def _channels(events: Any, names: tuple[str, ...], sensor: tuple[int, int, int],
              where: str) -> np.ndarray:
    """Each event's channel ``(y·W + x)·P + p``, or a ValueError naming the sample."""
    width, height, polarities = sensor
    fields = {"x": width, "y": height, "p": polarities}
    address = {}
    for field, size in fields.items():
        values = np.asarray(events[field]) if field in names else np.zeros(len(events), int)
        if field == "p" and size == 1:
            values = np.zeros(len(events), int)
        values = values.astype(np.int64)
        outside = (values < 0) | (values >= size)
        if outside.any():
            raise ValueError(f"from_tonic: {where} has {field} = {values[outside][0]} at event "
                             f"{int(np.argmax(outside))}, outside the sensor's {size}.")
        address[field] = values
    return ((address["y"] * width + address["x"]) * polarities + address["p"]).astype(np.int32)


def _times(events: Any, where: str) -> np.ndarray:
    times = np.asarray(events["t"])
    if not np.issubdtype(times.dtype, np.number) or np.issubdtype(times.dtype, np.complexfloating):
        raise ValueError(f"from_tonic: {where} has times of dtype {times.dtype}.")
    bad = (times < 0) | ~np.isfinite(times)
    if bad.any():
        raise ValueError(f"from_tonic: {where} has time {times[bad][0]} at event "
                         f"{int(np.argmax(bad))} (times are finite and >= 0).")
    return times


def _read(dataset: Any, name: str, sensor: tuple[int, int, int]) -> Events:
    """Every sample of a tonic dataset, each checked before any is kept."""
    samples, labels = [], []
    for index in range(len(dataset)):
        where = f"sample {index} of the {name} dataset ({type(dataset).__name__})"
        events, label = dataset[index]
        names = _fields(events, where)
        samples.append((_times(events, where), _channels(events, names, sensor, where)))
        label = np.asarray(label)
        if label.shape != () or not np.issubdtype(label.dtype, np.integer) or label < 0:
            raise ValueError(f"from_tonic: {where} has label {label!r}; expected one integer "
                             f"class >= 0 (build the dataset without a target_transform).")
        labels.append(int(label))
    return concatenate(samples, np.array(labels, np.int64), time_unit=1e-6)


@dataclasses.dataclass(frozen=True, eq=False)
class TonicDataset(AbstractEventDataset):
    """Event data sets read from ``tonic`` datasets; made by :func:`from_tonic`.

    Attributes:
        sensor_size: tonic's ``(W, H, P)``.
        classes: Number of classes.
        num_steps: Steps ``T``.
        max_time: Window in seconds (``None``: each sample stretched over ``T``).
        binary: Whether a step is a spike (else a count of events).
        flatten: Whether a step's input is a vector (else a frame ``(H, W, P)``).

    Example:
        >>> import numpy as np
        >>> from braintrace.tasks import from_tonic
        >>> class Fake:  # a tonic dataset of N-MNIST's sensor: one ON event per sample
        ...     sensor_size, classes = (34, 34, 2), list(range(10))
        ...     def __len__(self):
        ...         return 10
        ...     def __getitem__(self, i):
        ...         dtype = np.dtype([("x", int), ("y", int), ("t", int), ("p", int)])
        ...         return np.array([(i, 2 * i, 1000 * i, 1)], dtype), i
        >>> task = from_tonic(Fake(), Fake(), num_steps=10, max_time=0.01, flatten=False,
        ...                   validation_fraction=0.5)
        >>> task.input_shape, task.num_classes, task.split("test").xs[3, 3, 6, 3, 1].item()
        ((34, 34, 2), 10, 1.0)
    """

    sensor_size: tuple[int, int, int]
    classes: int
    num_steps: int
    max_time: float | None
    binary: bool
    flatten: bool
    _splits: dict = dataclasses.field(repr=False)

    def __post_init__(self):
        self._check_binning()

    @property
    def frame_shape(self) -> tuple[int, ...]:
        width, height, polarities = self.sensor_size
        return (height, width, polarities)

    @property
    def num_classes(self) -> int:
        return self.classes


def from_tonic(train: Any, test: Any, *, num_steps: int, max_time: float | None,
               validation: Any = None, validation_fraction: float = 0.1, seed: int = 0,
               binary: bool = True, flatten: bool = True) -> TonicDataset:
    """A braintrace task of ``tonic`` datasets: their raw events, binned as SHD's (no transform).

    Reads every sample now (tonic loads them one by one; this may take a while for
    N-MNIST's 60,000 files) and keeps the events; batches are binned as they are
    drawn, like :class:`~braintrace.tasks.SHD`'s (``braintrace.tasks._events``).
    tonic is not a dependency: anything shaped like its datasets works.

    Args:
        train: The training dataset, e.g. ``tonic.datasets.SHD(save_to, train=True)``.
        test: The test dataset (``train=False``).
        num_steps: Steps ``T``.
        max_time: Window in seconds (``None``: each sample stretched over ``T``).
        validation: A validation dataset; default: a stratified ``validation_fraction``
            of ``train``, chosen by ``seed``.
        validation_fraction: Share of each class of ``train`` held out without ``validation``.
        seed: Seed of that split.
        binary: Whether a step is a spike (else a count of events).
        flatten: Whether a step's input is a vector (else a channels-last frame ``(H, W, P)``).

    Returns:
        A :class:`TonicDataset` with ``sample``, ``batches``, ``split`` and ``size``.

    Raises:
        ValueError: A sample is not raw events, has an address outside the sensor, a
            negative or non-finite time or a label that is not a class (the error names
            the dataset and the sample; nothing is kept).

    Example:
        >>> import jax, numpy as np
        >>> from braintrace.tasks import from_tonic
        >>> class FakeSHD:  # shaped like tonic.datasets.SHD: events in µs, sensor (700, 1, 1)
        ...     sensor_size, dtype = (700, 1, 1), np.dtype([("t", int), ("x", int), ("p", int)])
        ...     def __len__(self):
        ...         return 4
        ...     def __getitem__(self, i):
        ...         events = np.array([(10_000 * i, i, 1), (700_000, 699, 1)], self.dtype)
        ...         return events, i % 2
        >>> task = from_tonic(FakeSHD(), FakeSHD(), num_steps=100, max_time=1.4,
        ...                   validation_fraction=0.5)
        >>> test = task.split("test")
        >>> test.xs.shape, test.mask.sum(0).tolist()  # 700 ms is step 50 of 14 ms
        ((100, 4, 700), [51.0, 51.0, 51.0, 51.0])
        >>> [int(test.xs[:, i, i].argmax()) for i in range(4)]  # 0, 10, 20, 30 ms
        [0, 0, 1, 2]
    """
    sensor = _sensor(train, "train")
    splits = {"train": _read(train, "train", sensor), "test": _read(test, "test", sensor)}
    if validation is None:
        splits["train"], splits["validation"] = validation_split(
            "from_tonic", splits["train"], validation_fraction, seed)
    else:
        splits["validation"] = _read(validation, "validation", sensor)
    largest = max((int(s.labels.max()) for s in splits.values() if len(s)), default=0)
    classes = getattr(train, "classes", None)  # tonic's SHD: an array of the class names
    num_classes = largest + 1 if classes is None or len(classes) == 0 else len(classes)
    if largest >= num_classes:
        raise ValueError(f"from_tonic: a sample has label {largest}, but the train dataset has "
                         f"{num_classes} classes.")
    return TonicDataset(sensor, num_classes, num_steps, max_time, binary, flatten, splits)
