r"""Event recordings held compactly, and binned into time steps for a batch.

A recording is a list of events ``(t, unit)``: a spike time and the input
channel it arrived on. :class:`Events` keeps every sample of a split in three
flat arrays (the samples' events one after the other, ``offsets`` marking where
each starts), so that a data set of tens of thousands of recordings costs a few
bytes per event, and :func:`bin_events` makes dense ``(T, B, channels)`` spike
arrays for the samples of one batch only.

**Binning.** With a window ``max_time`` (seconds), step ``k`` of ``T`` holds the
events with

.. math::

    k\,\frac{t_{max}}{T} \le t < (k + 1)\,\frac{t_{max}}{T},

times counted from the recording's start (``t = 0``), as in Zenke's SHD tutorial
(``T = 100`` over ``1.4 s``); events at or after ``max_time`` are dropped. These
are the frames of tonic's ``ToFrame(time_window=max_time/T, start_time=0,
end_time=max_time)`` (compared on SHD-format files through tonic 1.7's own SHD
reader). A sample's *length* is the number of steps up
to the one holding its last event (``T`` when it has events at or after the
window's end, 1 when it has none); the steps after it are padding, weighed 0 by
the mask. With ``max_time=None`` every sample is stretched over the ``T`` steps:
its own span ``[t_first, t_last]`` is cut into ``T`` equal bins, the last event
in the last bin, and every step is scored: tonic's ``ToFrame(n_time_bins=T)``
(which spyx's loaders use), except that tonic's bin width, rounded down to
whole microseconds, drops the events after its ``T`` bins, and these bins keep
every event. A bin holding events is a spike (1.0), or with
``binary=False`` its count of events.

Integer time stamps (N-MNIST's and tonic's microseconds) are binned in integers,
so an event exactly on a bin edge falls in the later bin, as the formula says.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["Events", "bin_events"]


@dataclasses.dataclass(frozen=True, eq=False)
class Events:
    """The event recordings of one split, read-only; sample ``i`` is events ``offsets[i:i+2]``.

    Attributes:
        times: ``(E,)`` event times, in units of ``time_unit`` seconds, each ``>= 0``.
        units: ``(E,)`` input channel of each event, in ``[0, channels)``.
        offsets: ``(N + 1,)`` int64, from 0 to ``E``, non-decreasing.
        labels: ``(N,)`` int32 class of each sample.
        time_unit: Seconds per unit of ``times`` (1.0 for seconds, 1e-6 for microseconds).
    """

    times: np.ndarray
    units: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray
    time_unit: float = 1.0

    def __post_init__(self):
        for array in (self.times, self.units, self.offsets, self.labels):
            array.setflags(write=False)

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: np.ndarray) -> Events:
        """The samples ``index`` (in that order) as their own :class:`Events`."""
        starts, ends = self.offsets[index], self.offsets[index + 1]
        counts = ends - starts
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        picked = _ranges(starts, counts)
        return Events(self.times[picked], self.units[picked], offsets, self.labels[index],
                      self.time_unit)


def concatenate(samples: list[tuple[np.ndarray, np.ndarray]], labels: np.ndarray,
                time_unit: float) -> Events:
    """:class:`Events` of per-sample ``(times, units)`` arrays, all read before any is kept."""
    counts = np.array([len(t) for t, _ in samples], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if not samples:
        return Events(np.zeros(0), np.zeros(0, np.int32), offsets, np.zeros(0, np.int32),
                      time_unit)
    times = np.concatenate([t for t, _ in samples])
    units = np.concatenate([u for _, u in samples])
    return Events(times, units, offsets, np.asarray(labels, np.int32), time_unit)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` without a loop."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + (np.arange(total) - first)


def _window_steps(times: np.ndarray, time_unit: float, num_steps: int,
                  max_time: float) -> np.ndarray:
    """``floor(T t / t_max)`` per event: exact in integers for integer time stamps."""
    window = max_time / time_unit
    if np.issubdtype(times.dtype, np.integer) and math.isclose(window, round(window),
                                                               rel_tol=1e-9):
        return times.astype(np.int64) * num_steps // round(window)
    return np.floor(times.astype(np.float64) * num_steps / window).astype(np.int64)


def _stretched_steps(times: np.ndarray, sample: np.ndarray, num_samples: int,
                     num_steps: int) -> np.ndarray:
    """Each sample's ``[t_first, t_last]`` cut into ``T`` bins, its last event in the last."""
    if times.size == 0:
        return np.zeros(0, np.int64)
    wide = times.astype(np.int64 if np.issubdtype(times.dtype, np.integer) else np.float64)
    first = np.full(num_samples, np.inf)
    last = np.full(num_samples, -np.inf)
    np.minimum.at(first, sample, wide)
    np.maximum.at(last, sample, wide)
    span = (last - first)[sample]
    offset = wide - first[sample]
    steps = np.floor(offset * num_steps / np.where(span > 0, span, 1.0))
    return np.minimum(steps, num_steps - 1).astype(np.int64)


def bin_events(events: Events, num_channels: int, num_steps: int, max_time: float | None,
               binary: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Dense spikes ``(T, B, channels)`` float32 and the padding mask ``(T, B)`` of ``events``.

    See the module docstring for the binning.

    Args:
        events: The ``B`` samples of a batch.
        num_channels: Input channels ``C`` (every unit is below it).
        num_steps: Steps ``T``.
        max_time: Window in seconds, or ``None`` to stretch each sample over the ``T`` steps.
        binary: Whether a bin with events is 1.0 (else its count of events).

    Returns:
        ``(xs, mask)``: float32 arrays ``(T, B, C)`` and ``(T, B)``.

    Example:
        >>> import numpy as np
        >>> from braintrace.tasks._events import Events, bin_events
        >>> events = Events(times=np.array([0.05, 0.05, 0.31, 0.2]), units=np.array([0, 0, 1, 1]),
        ...                 offsets=np.array([0, 3, 4]), labels=np.array([0, 1]))
        >>> xs, mask = bin_events(events, num_channels=2, num_steps=4, max_time=0.4,
        ...                       binary=False)
        >>> xs[:, 0].tolist()  # sample 0: two events in step 0 on unit 0, one in step 3
        [[2.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1.0]]
        >>> mask.T.tolist()  # sample 1 ends at step 2 (its last event, 0.2 s)
        [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
    """
    size = len(events)
    counts = np.diff(events.offsets)
    sample = np.repeat(np.arange(size), counts)
    if max_time is None:
        steps = _stretched_steps(events.times, sample, size, num_steps)
        lengths = np.full(size, num_steps)
    else:
        steps = _window_steps(events.times, events.time_unit, num_steps, max_time)
        lengths = np.ones(size, np.int64)
        np.maximum.at(lengths, sample, np.minimum(steps, num_steps - 1) + 1)
    keep = steps < num_steps
    xs = np.zeros((num_steps, size, num_channels), np.float32)
    where = (steps[keep], sample[keep], events.units[keep].astype(np.int64))
    if binary:
        xs[where] = 1.0
    else:
        np.add.at(xs, where, 1.0)
    mask = (np.arange(num_steps)[:, None] < lengths[None, :]).astype(np.float32)
    return xs, mask
