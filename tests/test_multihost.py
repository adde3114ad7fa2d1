"""Two processes under ``jax.distributed`` (CPU, localhost coordinator) train like one.

``benchmarks/multihost_example.py`` runs in two processes of two devices each,
on a ``('data', 'neuron')`` mesh of 2 x 2: each process feeds half of the batch
and splits the hidden units over its two devices; they must end with the Params of a single process fed the whole
batch, and their orbax checkpoint must restore in this (one-device) process.
"""

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import subprocess_env

import braintrace

EXAMPLE = Path(__file__).resolve().parents[1] / "benchmarks" / "multihost_example.py"


def _example():
    spec = importlib.util.spec_from_file_location("multihost_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_train_to_the_params_of_one(tmp_path):
    env = subprocess_env()
    port, out, checkpoint = _free_port(), tmp_path / "params.npz", tmp_path / "ckpt"
    command = [sys.executable, str(EXAMPLE), "--num-processes", "2", "--port", str(port),
               "--checkpoint", str(checkpoint), "--local-devices", "2", "--neuron-devices", "2"]
    workers = [subprocess.Popen([*command, "--process-id", str(i),
                                 *(["--out", str(out)] if i == 0 else [])],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env) for i in range(2)]
    try:
        logs = [w.communicate(timeout=240)[0] for w in workers]
    finally:
        for w in workers:
            w.kill()
    assert all(w.returncode == 0 for w in workers), "\n".join(logs)[-4000:]
    assert "process 0/2: 4 devices" in logs[0] and "process 1/2: 4 devices" in logs[1]

    example = _example()
    one = example.train(None, slice(None))
    two = np.load(out)
    single = one.learner.leaves().params
    assert len(two.files) == len(single)
    for i, p in enumerate(single):
        np.testing.assert_allclose(two[f"arr_{i}"], p, rtol=1e-5, atol=1e-6)

    learner = braintrace.compile(example.make_model(), "d_rtrl",
                                 jnp.ones((example.BATCH, example.INPUTS)),
                                 batch_size=example.BATCH)
    fresh = braintrace.OnlineTrainer(learner, optax.adam(1e-2), loss_fn=example.mse)
    fresh.restore(str(checkpoint))
    assert jax.device_count() == 1
    for i, p in enumerate(fresh.learner.leaves().params):
        np.testing.assert_array_equal(two[f"arr_{i}"], p)
