"""SHD, SSC and N-MNIST read from files in their published formats, written here; tonic's shape.

The files are written by these tests in the real formats (HDF5 with variable-length
``spikes/times`` float16 and ``spikes/units`` uint16 per sample; N-MNIST's 40-bit
records packed as one 40-bit integer per event, a formulation independent of the
reader's byte masks). Binned batches are compared with a per-event loop written
from the binning's formula; damaged files must fail with an error naming the file
and the sample, before anything is kept.
"""

from __future__ import annotations

import importlib
import math

import h5py
import jax
import numpy as np
import pytest

from braintrace import tasks
from braintrace.tasks import _hdf5

RNG = np.random.default_rng(0)


def _shd_samples(n, num_classes=20, max_events=40, duration=1.3):
    """``[(times float16 s, units uint16)]`` and labels; sample 3 empty, 5 ends at 1.5 s,
    0 has two events at one time on one unit."""
    samples = []
    for i in range(n):
        count = 0 if i == 3 else int(RNG.integers(2, max_events))
        times = np.sort(RNG.uniform(0, duration, count))
        units = RNG.integers(0, 24, count) * 30 + 9  # 24 channels, up to 699
        if i == 5:
            times[-1] = 1.5
        if i == 0:
            times[1], units[1] = times[0], units[0]
        samples.append((times.astype(np.float16), units.astype(np.uint16)))
    return samples, np.arange(n) % num_classes


def _write_h5(path, samples, labels, *, times_key="spikes/times"):
    with h5py.File(path, "w") as f:
        times = f.create_dataset(times_key, (len(samples),), h5py.vlen_dtype(np.float16))
        units = f.create_dataset("spikes/units", (len(samples),), h5py.vlen_dtype(np.uint16))
        for i, (t, u) in enumerate(samples):
            times[i], units[i] = t, u
        f["labels"] = np.asarray(labels, np.uint8)
        f["extra/speaker"] = np.zeros(len(samples), np.uint8)  # present in the real files


def _reference(samples, num_steps, max_time, channels, binary=True):
    """The binning, event by event: step floor(T t / t_max), or each sample stretched."""
    xs = np.zeros((num_steps, len(samples), channels))
    mask = np.zeros((num_steps, len(samples)))
    for b, (times, units) in enumerate(samples):
        length = 1 if max_time is not None else num_steps
        for t, u in zip(times.tolist(), units.tolist(), strict=True):
            if max_time is None:
                span = max(times.tolist()) - min(times.tolist())
                k = min(num_steps - 1, math.floor((t - min(times.tolist())) * num_steps / span)
                        if span else 0)
            else:
                k = math.floor(t * num_steps / max_time)
                length = max(length, min(k + 1, num_steps))
            if k < num_steps:
                xs[k, b, u] = 1 if binary else xs[k, b, u] + 1
        mask[:length, b] = 1
    return xs, mask


@pytest.fixture(scope="module")
def shd_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shd")
    train, test = _shd_samples(60), _shd_samples(12)
    _write_h5(folder / "shd_train.h5", *train)
    _write_h5(folder / "shd_test.h5", *test)
    return folder, train, test


@pytest.mark.parametrize("max_time, binary", [(1.4, True), (0.9, False), (None, True)],
                         ids=["window", "window-counts", "stretched"])
def test_shd_batches_are_the_binned_events_of_the_file(shd_folder, max_time, binary):
    folder, _, (samples, labels) = shd_folder
    task = tasks.SHD(folder, num_steps=25, max_time=max_time, binary=binary)
    assert (task.num_inputs, task.num_classes, task.seq_len) == (700, 20, 25)
    test = task.split("test")
    xs, mask = _reference(samples, 25, max_time, 700, binary)
    assert xs.sum() > len(samples) and (binary or xs.max() > 1)  # the counts are live
    np.testing.assert_array_equal(test.xs, xs)
    np.testing.assert_array_equal(test.mask, mask)
    np.testing.assert_array_equal(test.ys, np.broadcast_to(labels, (25, len(labels))))
    if max_time == 1.4:  # a short sample is padded, one with events past the window is not
        assert 0 < mask[:, 0].sum() < 25 and mask[:, 5].sum() == 25 and mask[:, 3].sum() == 1


def test_shd_splits_sampling_and_padded_batches(shd_folder):
    folder, (_train_samples, _), _ = shd_folder
    task = tasks.SHD(folder, num_steps=10, validation_fraction=0.2, seed=1)
    assert [task.size(s) for s in ("train", "validation", "test")] == [40, 20, 12]
    validation = task.split("validation")  # one of the three samples of each class
    assert sorted(np.asarray(validation.ys[0]).tolist()) == list(range(20))
    a, b = task.sample(jax.random.key(2), 4), task.sample(jax.random.key(2), 4)
    np.testing.assert_array_equal(a.xs, b.xs)
    batches = list(task.batches("test", 5))
    assert [x.xs.shape for x in batches] == [(10, 5, 700)] * 3  # the last filled up
    last = batches[-1]
    assert np.all(np.asarray(last.mask)[:, 2:] == 0) and np.all(np.asarray(last.xs)[:, 2:] == 0)
    whole = task.split("test")
    np.testing.assert_array_equal(np.concatenate([x.xs for x in batches], 1)[:, :12], whole.xs)
    # the filling weighs nothing: the accuracy of the filled batch is that of its two samples
    logits = np.random.default_rng(0).normal(size=(10, 5, 20))
    logits[:, 2:, 0] = 9.0  # the filling "answers" class 0, the label it holds
    kept = tasks.Batch(last.xs[:, :2], last.ys[:, :2], last.mask[:, :2])
    accuracy = jax.jit(tasks.accuracy)
    assert float(accuracy(logits, last)) == float(accuracy(logits[:, :2], kept))
    shuffled = list(task.batches("train", 16, key=jax.random.key(0)))
    labels = np.concatenate([np.asarray(x.ys[0])[np.asarray(x.mask).any(0)] for x in shuffled])
    assert labels.tolist() != sorted(labels) and sorted(labels) == sorted(
        np.asarray(task.split("train").ys[0]).tolist())
    with pytest.raises(ValueError, match=r"split must be one of \('train', 'validation'"):
        task.size("valid")


def test_ssc_reads_its_three_published_splits(tmp_path):
    for name, n in (("train", 8), ("valid", 5), ("test", 3)):
        _write_h5(tmp_path / f"ssc_{name}.h5", *_shd_samples(n, num_classes=35))
    task = tasks.SSC(tmp_path, num_steps=20)
    assert [task.size(s) for s in ("train", "validation", "test")] == [8, 5, 3]
    assert task.num_classes == 35 and task.split("validation").xs.shape == (20, 5, 700)


def _damage(folder, kind):
    samples, labels = _shd_samples(6)
    samples = list(samples)
    if kind == "lengths":
        samples[4] = (samples[4][0], samples[4][1][:-1])
    elif kind == "nan":
        samples[4] = (np.concatenate([samples[4][0], [np.nan]]).astype(np.float16),
                      np.concatenate([samples[4][1], [1]]).astype(np.uint16))
    elif kind == "unit":
        samples[4][1][0] = 700
    elif kind == "label":
        labels = labels.copy()
        labels[4] = 20
    _write_h5(folder / "shd_train.h5", samples, labels)


@pytest.mark.parametrize("kind, message", [
    ("lengths", r"sample 4 of '.*shd_train\.h5' has \(\d+,\) spike times but \(\d+,\) units"),
    ("nan", r"sample 4 of '.*shd_train\.h5' has spike time nan at event \d+"),
    ("unit", r"sample 4 of '.*shd_train\.h5' has unit 700 at event 0, outside the 700 channels"),
    ("label", r"sample 4 of '.*shd_train\.h5' has label 20, outside the 20 classes"),
])
def test_a_malformed_shd_sample_is_an_error_naming_the_file_and_sample(tmp_path, kind, message):
    _write_h5(tmp_path / "shd_test.h5", *_shd_samples(2))
    _damage(tmp_path, kind)
    with pytest.raises(ValueError, match="SHD: " + message + r".*nothing was loaded"):
        tasks.SHD(tmp_path)


def test_a_truncated_or_incomplete_shd_file_is_an_error_naming_it(tmp_path):
    _write_h5(tmp_path / "shd_test.h5", *_shd_samples(2))
    _write_h5(tmp_path / "shd_train.h5", *_shd_samples(30))
    data = (tmp_path / "shd_train.h5").read_bytes()
    (tmp_path / "shd_train.h5").write_bytes(data[:len(data) * 2 // 3])
    with pytest.raises(ValueError, match=r"SHD: '.*shd_train\.h5' is not a readable HDF5 file "
                                         r"\(.*\); it may be truncated"):
        tasks.SHD(tmp_path)
    _write_h5(tmp_path / "shd_train.h5", *_shd_samples(3), times_key="spikes/time")
    with pytest.raises(ValueError, match=r"has no dataset \['spikes/times'\]"):
        tasks.SHD(tmp_path)
    (tmp_path / "shd_train.h5").rename(tmp_path / "shd_train.h5.gz")
    with pytest.raises(FileNotFoundError, match=r"no file '.*shd_train\.h5' \(a compressed "
                                                r"download: decompress it"):
        tasks.SHD(tmp_path)


def test_without_h5py_the_error_names_the_extra(monkeypatch, tmp_path):
    real = importlib.import_module

    def blocked(name, *args):
        if name == "h5py":
            raise ImportError("No module named 'h5py'")
        return real(name, *args)

    monkeypatch.setattr(_hdf5.importlib, "import_module", blocked)
    with pytest.raises(ImportError, match=r"tasks\.SHD reads HDF5 files with the optional "
                                          r"package 'h5py'.*pip install -e \"\.\[shd\]\""):
        tasks.SHD(tmp_path)


def _nmnist_bytes(events):
    """40-bit records, each ``x << 32 | y << 24 | p << 23 | t`` written big-endian."""
    return b"".join(((x << 32) | (y << 24) | (p << 23) | t).to_bytes(5, "big")
                    for x, y, p, t in events)


def _nmnist_events(count):
    t = np.sort(RNG.integers(0, 320_000, count))
    return list(zip(RNG.integers(0, 34, count).tolist(), RNG.integers(0, 34, count).tolist(),
                    RNG.integers(0, 2, count).tolist(), t.tolist(), strict=True))


@pytest.fixture(scope="module")
def nmnist_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("nmnist")
    written = {"Train": [], "Test": []}
    for split, per_class in (("Train", 3), ("Test", 1)):
        for digit in range(10):
            (root / split / str(digit)).mkdir(parents=True)
            for i in range(per_class):
                events = _nmnist_events(int(RNG.integers(1, 30)))
                (root / split / str(digit) / f"{i:05d}.bin").write_bytes(_nmnist_bytes(events))
                written[split].append((events, digit))
    return root, written


def _as_samples(written):
    """``(times µs, channels (y·34 + x)·2 + p)`` per sample, as the reference reads them."""
    return [(np.array([t for *_, t in events]),
             np.array([(y * 34 + x) * 2 + p for x, y, p, _ in events])) for events, _ in written]


def test_nmnist_batches_are_the_binned_records_of_the_files(nmnist_folder):
    root, written = nmnist_folder
    task = tasks.NMNIST(root, num_steps=30, validation_fraction=1 / 3)
    assert [task.size(s) for s in ("train", "validation", "test")] == [20, 10, 10]
    test = task.split("test")
    xs, mask = _reference(_as_samples(written["Test"]), 30, 300_000, 2312)  # in µs
    np.testing.assert_array_equal(test.xs, xs)
    np.testing.assert_array_equal(test.mask, mask)
    np.testing.assert_array_equal(test.ys[0], [digit for _, digit in written["Test"]])
    frames = tasks.NMNIST(root, num_steps=30, flatten=False).split("test").xs
    x, y, p, t = written["Test"][4][0][0]
    assert frames.shape == (30, 10, 34, 34, 2) and frames[t * 30 // 300_000, 4, y, x, p] == 1
    np.testing.assert_array_equal(frames.reshape(30, 10, -1), test.xs)


@pytest.mark.parametrize("kind, message", [
    ("truncated", (r"'.*00000\.bin' has 13 bytes, not a whole number of 5-byte event records "
                  r"\(it ends 3 bytes into record 2\): the file is truncated")),
    ("outside", r"record 1 of '.*00000\.bin' is at x=40, y=2, outside the 34x34 sensor"),
    ("overflow", r"record 0 of '.*00000\.bin' is at x=0, y=240"),
])
def test_a_damaged_nmnist_file_is_an_error_naming_it_and_the_record(tmp_path, kind, message):
    events = {"truncated": [(1, 2, 0, 5), (3, 4, 1, 9)], "outside": [(1, 2, 0, 5), (40, 2, 1, 9)],
              "overflow": [(0, 240, 0, 0)]}[kind]
    data = _nmnist_bytes(events) + (b"\x01\x02\x03" if kind == "truncated" else b"")
    for split in ("Train", "Test"):
        (tmp_path / split / "7").mkdir(parents=True)
        (tmp_path / split / "7" / "00001.bin").write_bytes(_nmnist_bytes([(1, 1, 1, 1)]))
    (tmp_path / "Test" / "7" / "00000.bin").write_bytes(data)
    with pytest.raises(ValueError, match=r"NMNIST: " + message + r".*nothing was loaded"):
        tasks.NMNIST(tmp_path)
    with pytest.raises(ValueError, match=r"one folder per class, named 0 to 9; found \['x'\]"):
        (tmp_path / "Test" / "7").rename(tmp_path / "Test" / "x")
        tasks.NMNIST(tmp_path)


class _TonicLike:
    """Shaped like a tonic dataset built without a transform: ``events, label = ds[i]``."""

    def __init__(self, samples, labels, sensor_size, fields, classes=None):
        self.samples, self.labels, self.sensor_size = samples, labels, sensor_size
        self.dtype = np.dtype([(f, np.int64) for f in fields])
        if classes is not None:
            self.classes = classes

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        events = np.zeros(len(self.samples[index][0]), self.dtype)
        for field, values in self.samples[index][1].items():
            events[field] = values
        events["t"] = self.samples[index][0]
        return events, self.labels[index]


def _tonic_nmnist(written):
    samples = [(np.array([t for *_, t in ev]), {"x": [e[0] for e in ev], "y": [e[1] for e in ev],
                                               "p": [e[2] for e in ev]}) for ev, _ in written]
    return _TonicLike(samples, [d for _, d in written], (34, 34, 2), "xytp")


def test_from_tonic_gives_the_batches_of_the_file_loaders(nmnist_folder, shd_folder):
    root, written = nmnist_folder
    ours = tasks.NMNIST(root, num_steps=30, validation_fraction=1 / 3, flatten=False)
    theirs = tasks.from_tonic(_tonic_nmnist(written["Train"]), _tonic_nmnist(written["Test"]),
                              num_steps=30, max_time=0.3, validation_fraction=1 / 3,
                              flatten=False)
    assert theirs.num_classes == 10 and theirs.input_shape == (34, 34, 2)
    for split in ("train", "validation", "test"):
        for mine, other in zip(ours.split(split), theirs.split(split), strict=True):
            np.testing.assert_array_equal(mine, other)
    folder, _, (samples, labels) = shd_folder
    # tonic's SHD: times in whole µs, x the channel, p = 1 on a (700, 1, 1) sensor
    tonic_shd = _TonicLike([(np.round(t.astype(np.float64) * 1e6).astype(np.int64),
                             {"x": u, "p": np.ones_like(u)}) for t, u in samples], labels,
                           (700, 1, 1), "txp", classes=np.array([b"k%d" % i for i in range(20)]))
    shd = tasks.from_tonic(tonic_shd, tonic_shd, num_steps=40, max_time=None)
    assert shd.num_classes == 20  # tonic's SHD names its classes in an array
    np.testing.assert_array_equal(shd.split("test").xs,
                                  tasks.SHD(folder, num_steps=40, max_time=None).split("test").xs)


@pytest.mark.parametrize("change, message", [
    ("frames", (r"sample 0 of the train dataset \(_TonicLike\) is not raw events.*without a "
               r"transform")),
    ("polarity", (r"sample 1 of the test dataset \(_TonicLike\) has p = 2 at event 0, outside "
                 r"the sensor's 2")),
    ("time", r"sample 1 of the test dataset \(_TonicLike\) has time -1 at event 0"),
])
def test_from_tonic_refuses_what_is_not_raw_events(nmnist_folder, change, message):
    _, written = nmnist_folder
    train, test = _tonic_nmnist(written["Train"][:3]), _tonic_nmnist(written["Test"][:2])
    if change == "frames":
        train.__class__ = type("_TonicLike", (_TonicLike,), {
            "__getitem__": lambda self, i: (np.zeros((30, 2, 34, 34)), 0)})
    elif change == "polarity":
        test.samples[1][1]["p"][0] = 2
    else:
        test.samples[1][0][0] = -1
    with pytest.raises(ValueError, match="from_tonic: " + message):
        tasks.from_tonic(train, test, num_steps=10, max_time=0.3)
