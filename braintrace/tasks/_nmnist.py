"""Reading N-MNIST's binary event files (Orchard et al. 2015) into :class:`Events`.

One file per sample, in a folder per class: ``Train/<digit>/<id>.bin`` and
``Test/<digit>/<id>.bin`` as the published ``Train.zip`` and ``Test.zip``
unpack. A file is a sequence of 40-bit records, five bytes each::

    byte 0: x (8 bits)   byte 1: y (8 bits)
    byte 2: polarity (bit 7), timestamp bits 22-16 (bits 6-0)
    bytes 3, 4: timestamp bits 15-8 and 7-0 (microseconds)

on a 34 × 34 sensor with two polarities. An event is input channel
``(y·34 + x)·2 + p``: the spikes of a step reshape to a channels-last frame
``(34, 34, 2)`` (rows ``y``, columns ``x``, polarity last). Every file is checked
before any is kept: a size that is not a whole number of records (a truncated
file) or a record outside the sensor (a malformed one; the format's overflow
marker ``y = 240`` included, which N-MNIST's 0.3 s recordings never need) is a
``ValueError`` naming the file and the record. Plain NumPy, no extra.
"""

from __future__ import annotations

import pathlib

import numpy as np

from braintrace.tasks._events import Events, concatenate

SENSOR = (34, 34, 2)  # rows (y), columns (x), polarities: a channels-last frame
RECORD = 5


def decode(raw: np.ndarray, file: pathlib.Path, user: str) -> tuple[np.ndarray, np.ndarray]:
    """``(times µs uint32, channels int32)`` of one file's bytes, or a ValueError naming it.

    Example:
        >>> import pathlib, numpy as np
        >>> from braintrace.tasks._nmnist import decode
        >>> record = np.array([3, 1, 0x80 | 0x01, 0x02, 0x03], np.uint8)  # x 3, y 1, on, t
        >>> decode(record, pathlib.Path("one.bin"), "NMNIST")
        (array([66051], dtype=uint32), array([75], dtype=int32))
    """
    if raw.size % RECORD:
        raise ValueError(
            f"{user}: '{file}' has {raw.size} bytes, not a whole number of {RECORD}-byte event "
            f"records (it ends {raw.size % RECORD} bytes into record {raw.size // RECORD}): the "
            f"file is truncated (nothing was loaded). Replace it with the published file.")
    records = raw.reshape(-1, RECORD).astype(np.uint32)
    x, y = records[:, 0], records[:, 1]
    outside = (x >= SENSOR[1]) | (y >= SENSOR[0])
    if outside.any():
        index = int(np.argmax(outside))
        raise ValueError(
            f"{user}: record {index} of '{file}' is at x={x[index]}, y={y[index]}, outside the "
            f"{SENSOR[1]}x{SENSOR[0]} sensor: the file is malformed (nothing was loaded).")
    polarity = records[:, 2] >> 7
    times = ((records[:, 2] & 0x7F) << 16) | (records[:, 3] << 8) | records[:, 4]
    channels = ((y * SENSOR[1] + x) * SENSOR[2] + polarity).astype(np.int32)
    return times.astype(np.uint32), channels


def _class_folders(root: pathlib.Path, user: str) -> list[tuple[int, pathlib.Path]]:
    if not root.is_dir():
        raise FileNotFoundError(
            f"{user}: no folder '{root}'. Nothing is downloaded: give the folder that holds "
            f"N-MNIST's Train/ and Test/ folders (unpacked from Train.zip and Test.zip).")
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    odd = [p.name for p in folders if p.name not in {str(d) for d in range(10)}]
    if odd or not folders:
        raise ValueError(f"{user}: '{root}' must hold one folder per class, named 0 to 9; "
                         f"found {[p.name for p in folders]}.")
    return [(int(p.name), p) for p in folders]


def read_folder(root: pathlib.Path, user: str) -> Events:
    """Every ``<class>/<id>.bin`` below ``root``, classes in order, files sorted by name."""
    samples, labels = [], []
    for label, folder in _class_folders(root, user):
        for file in sorted(folder.glob("*.bin")):
            samples.append(decode(np.fromfile(file, dtype=np.uint8), file, user))
            labels.append(label)
    if not samples:
        raise ValueError(f"{user}: the class folders of '{root}' hold no .bin files.")
    return concatenate(samples, np.array(labels), time_unit=1e-6)
