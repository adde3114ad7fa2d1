"""Reading the Heidelberg spiking data sets' HDF5 files (SHD, SSC) into :class:`Events`.

A file holds ``spikes/times`` (seconds, float16 in the published files) and
``spikes/units`` (the channel, uint16) as variable-length arrays, one per
sample, and ``labels``; ``extra/`` (speakers, keys, meta data) is not read.
Every sample is checked before any is kept: a file that cannot be read, or a
sample with times and units of different lengths, a time that is negative or
not finite, a unit outside the channels or a label outside the classes, is a
``ValueError`` naming the file and the sample. ``h5py`` is imported only here,
when a file is read (the ``shd`` extra).
"""

from __future__ import annotations

import importlib
import pathlib
from types import ModuleType
from typing import Any

import numpy as np

from braintrace.tasks._events import Events, concatenate

INSTALL = 'pip install -e ".[shd]"  (or: pip install "braintrace-nnx[shd]")'
DATASETS = ("spikes/times", "spikes/units", "labels")


def h5py_package(user: str) -> ModuleType:
    """The ``h5py`` module, or an ImportError saying which extra installs it."""
    try:
        return importlib.import_module("h5py")
    except ImportError as err:
        raise ImportError(
            f"braintrace.tasks.{user} reads HDF5 files with the optional package 'h5py', which "
            f"is not installed. Install the shd extra: {INSTALL}") from err


def _sample_error(user: str, file: pathlib.Path, index: int, what: str) -> ValueError:
    return ValueError(f"{user}: sample {index} of '{file}' {what}; the file is malformed (nothing "
                      f"was loaded). Replace it with the published file.")


def _read_all(dataset: Any, user: str, file: pathlib.Path) -> np.ndarray:
    """Every row of a dataset; on a read error, the error names the first unreadable sample."""
    try:
        return dataset[...]
    except (OSError, ValueError, RuntimeError) as err:
        for index in range(dataset.shape[0] if dataset.shape else 0):
            try:
                dataset[index]
            except (OSError, ValueError, RuntimeError) as sample_err:
                raise _sample_error(user, file, index, f"in '{dataset.name}' cannot be read "
                                    f"({sample_err})") from sample_err
        raise ValueError(f"{user}: '{dataset.name}' of '{file}' cannot be read ({err}); the "
                         f"file is damaged (nothing was loaded).") from err


def _check_sample(times: Any, units: Any, index: int, num_channels: int, user: str,
                  file: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    times, units = np.asarray(times), np.asarray(units)
    if times.ndim != 1 or units.ndim != 1 or times.shape != units.shape:
        raise _sample_error(user, file, index, f"has {times.shape} spike times but "
                            f"{units.shape} units (one unit per spike time)")
    if not np.issubdtype(times.dtype, np.floating) or not np.issubdtype(units.dtype, np.integer):
        raise _sample_error(user, file, index, f"has times of dtype {times.dtype} and units of "
                            f"dtype {units.dtype} (float seconds and integer channels)")
    bad = ~np.isfinite(times) | (times < 0)
    if bad.any():
        raise _sample_error(user, file, index, f"has spike time {times[bad][0]} at event "
                            f"{int(np.argmax(bad))} (times are finite seconds >= 0)")
    outside = (units < 0) | (units >= num_channels)
    if outside.any():
        raise _sample_error(user, file, index, f"has unit {units[outside][0]} at event "
                            f"{int(np.argmax(outside))}, outside the {num_channels} channels")
    return times, units


def _open(h5py: ModuleType, file: pathlib.Path, user: str) -> Any:
    if not file.is_file():
        hint = (f" (a compressed download: decompress it, gunzip '{file}.gz')"
                if file.with_name(file.name + ".gz").is_file() else "")
        raise FileNotFoundError(f"{user}: no file '{file}'{hint}. Nothing is downloaded: give "
                                f"the folder that holds the published files.")
    try:
        return h5py.File(file, "r")
    except OSError as err:
        raise ValueError(f"{user}: '{file}' is not a readable HDF5 file ({err}); it may be "
                         f"truncated or damaged (nothing was loaded).") from err


def read_spikes(file: pathlib.Path, num_channels: int, num_classes: int, user: str) -> Events:
    """The samples of one SHD/SSC file, every one checked (module docstring)."""
    h5py = h5py_package(user)
    with _open(h5py, file, user) as handle:
        missing = [name for name in DATASETS if name not in handle]
        if missing:
            raise ValueError(f"{user}: '{file}' has no dataset {missing}; an SHD/SSC file holds "
                             f"{list(DATASETS)} (nothing was loaded).")
        times, units, labels = (_read_all(handle[name], user, file) for name in DATASETS)
    if not len(times) == len(units) == len(labels):
        raise ValueError(f"{user}: '{file}' has {len(times)} spike-time rows, {len(units)} unit "
                         f"rows and {len(labels)} labels (one of each per sample; nothing was "
                         f"loaded).")
    labels = np.asarray(labels)
    if not np.issubdtype(labels.dtype, np.integer) or labels.ndim != 1:
        raise ValueError(f"{user}: the labels of '{file}' are {labels.dtype} of shape "
                         f"{labels.shape}, not one integer class per sample.")
    outside = (labels < 0) | (labels >= num_classes)
    if outside.any():
        index = int(np.argmax(outside))
        raise _sample_error(user, file, index, f"has label {labels[index]}, outside the "
                            f"{num_classes} classes")
    samples = [_check_sample(t, u, i, num_channels, user, file)
               for i, (t, u) in enumerate(zip(times, units, strict=True))]
    return concatenate(samples, labels, time_unit=1.0)
