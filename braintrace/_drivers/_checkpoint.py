"""Checkpoints: named arrays in an orbax checkpoint directory, with SHA-256 digests.

A checkpoint is an orbax directory of two items: ``arrays``, the leaves under
zero-padded indices (written by orbax, sharded arrays included, from every
process), and ``meta``, a JSON record of each leaf's name, shape, dtype and
PRNG implementation. Typed PRNG keys (``jax.random.key``, e.g. inside
``nnx.Rngs``) are stored as their ``jax.random.key_data``, with the name of
their implementation. Once orbax has finished, :data:`MANIFEST` lists the
SHA-256 digest of every file of the directory.

Restoring checks every file against its digest (an error names the damaged
file), then checks the record's names, shapes and dtypes against a template,
then lets orbax read the arrays straight onto the template's shardings (so a
checkpoint restores onto another mesh or another number of devices), all
before returning anything: a failed restore changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FORMAT", "MANIFEST", "leaf_names", "restore_arrays", "save_arrays"]

FORMAT = "braintrace-ckpt/2"
MANIFEST = "braintrace.sha256.json"
_SHOWN = 3


def leaf_names(prefix: str, tree: Any) -> list[str]:
    """``prefix`` followed by each leaf's key path (``'traces[0].eps'``), in leaf order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [prefix + jax.tree_util.keystr(path) for path, _ in flat]


def save_arrays(path: str | os.PathLike, arrays: dict[str, Any]) -> None:
    """Writes named arrays as an orbax checkpoint directory at ``path`` (replacing one there).

    On several processes every process calls this with the same global arrays;
    the first writes the manifest of digests once every process has written.

    Raises:
        ValueError: ``path`` exists and is not a braintrace checkpoint (it is
            never replaced then).

    Example:
        >>> import os, tempfile, jax, jax.numpy as jnp
        >>> path = os.path.join(tempfile.mkdtemp(), 'arrays.ckpt')
        >>> save_arrays(path, {'w': jnp.ones(2), 'key': jax.random.key(0)})
        >>> restored = restore_arrays(path, {'w': jnp.zeros(2), 'key': jax.random.key(1)})
        >>> restored[0].tolist(), bool(restored[1] == jax.random.key(0))
        ([1.0, 1.0], True)
    """
    import orbax.checkpoint as ocp

    where = os.path.abspath(path)
    if os.path.lexists(where) and not os.path.isfile(os.path.join(where, MANIFEST)):
        raise ValueError(
            f"{where} exists and is not a braintrace checkpoint (it has no {MANIFEST}); save "
            "replaces only a checkpoint. Choose another path, or delete it first.")
    entries = [(name, _impl(leaf), _data(leaf)) for name, leaf in arrays.items()]
    meta = {"format": FORMAT,
            "leaves": [{"name": name, "impl": impl, "shape": list(data.shape),
                        "dtype": str(data.dtype)} for name, impl, data in entries]}
    tree = {f"{i:06d}": data for i, (_, _, data) in enumerate(entries)}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(where, force=True, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)))
    if jax.process_index() == 0:
        files = {os.path.relpath(f, where): _file_digest(f) for f in _files(where)}
        with open(os.path.join(where, MANIFEST), "w") as f:
            json.dump(files, f, indent=0, sort_keys=True)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"braintrace checkpoint {where}")


def restore_arrays(path: str | os.PathLike, template: dict[str, Any]) -> list[jax.Array]:
    """Reads arrays written by :func:`save_arrays`, checked against ``template``.

    Args:
        path: The checkpoint directory.
        template: The expected names, in order, with arrays of the expected
            shapes and dtypes (typed PRNG keys of the expected implementation);
            each array's sharding is where its stored value is put.

    Returns:
        The stored arrays in the order of ``template``.

    Raises:
        ValueError: ``path`` is not a checkpoint, is damaged (a file's digest
            does not match, or an array cannot be read), or does not match
            ``template`` (a name, shape or dtype); the message names the path
            and the first offending leaf.
    """
    import orbax.checkpoint as ocp

    where = os.fspath(path)
    _check_files(where)
    stored = _read_meta(where)
    missing = [name for name in template if name not in stored]
    extra = [name for name in stored if name not in template]
    if missing or extra:
        raise ValueError(
            f"The checkpoint {where} does not match: it lacks {_few(missing)}, "
            f"expected here, and holds {_few(extra)}, unknown here. Was it saved by another "
            "model, algorithm or optimiser?")
    for name, expected in template.items():
        _check(where, name, stored[name], expected)
    order = list(stored)
    abstract = {f"{order.index(name):06d}": _abstract(leaf) for name, leaf in template.items()}
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(os.path.abspath(where), args=ocp.args.Composite(
                arrays=ocp.args.StandardRestore(abstract)))["arrays"]
    except Exception as err:  # any failure to read the arrays means the same thing
        raise ValueError(
            f"The checkpoint {where} is damaged: orbax could not read its arrays "
            f"({type(err).__name__}: {err}). Restore from another copy.") from err
    return [_wrapped(stored[name]["impl"], restored[f"{order.index(name):06d}"])
            for name in template]


def _files(path: str) -> list[str]:
    return sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                  if name != MANIFEST)


def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _check_files(path: str) -> None:
    """Checks every file of the checkpoint against the manifest's digest."""
    manifest = os.path.join(path, MANIFEST)
    try:
        with open(manifest) as f:
            digests = json.load(f)
        listed = {os.path.join(path, name): str(digest) for name, digest in digests.items()}
    except Exception as err:  # a missing, unreadable or foreign manifest means the same thing
        raise ValueError(
            f"{path} is not a braintrace checkpoint: its manifest {manifest} is missing or "
            f"unreadable ({type(err).__name__}: {err}); another kind of file, a damaged "
            "checkpoint, or a save that was interrupted. Write checkpoints with "
            "learner.save(path) or trainer.save(path).") from err
    for name, digest in listed.items():
        if not os.path.isfile(name) or _file_digest(name) != digest:
            what = ("is missing" if not os.path.isfile(name) else
                    "has another SHA-256 digest than when it was saved (truncated or altered)")
            raise ValueError(f"The checkpoint {path} is damaged: its file {name} {what}. "
                             "Restore from another copy.")


def _read_meta(path: str) -> dict[str, dict[str, Any]]:
    """The stored leaves by name, in order."""
    meta_file = os.path.join(path, "meta", "metadata")
    try:
        with open(meta_file) as f:
            meta = json.load(f)
        if meta["format"] != FORMAT:
            raise ValueError(f"format {meta['format']!r}")
        return {e["name"]: {"impl": e["impl"], "shape": tuple(e["shape"]),
                            "dtype": np.dtype(e["dtype"])} for e in meta["leaves"]}
    except Exception as err:  # a missing, unreadable or foreign record means the same thing
        raise ValueError(
            f"{path} is not a braintrace checkpoint: its record {meta_file} is missing or "
            f"unreadable ({type(err).__name__}: {err}). Write checkpoints with "
            "learner.save(path) or trainer.save(path).") from err


def _check(path: str, name: str, entry: dict[str, Any], expected: Any) -> None:
    stored = _describe(entry["impl"], entry["shape"], entry["dtype"])
    if _is_key(expected):
        impl, want = str(jax.random.key_impl(expected)), jax.random.key_data(expected)
        if entry["impl"] != impl or entry["shape"] != want.shape:
            raise ValueError(_mismatch(path, name, stored, _describe(impl, want.shape, "")))
        return
    shape, dtype = tuple(np.shape(expected)), np.dtype(jnp.result_type(expected))
    if entry["impl"] or entry["shape"] != shape or entry["dtype"] != dtype:
        raise ValueError(_mismatch(path, name, stored, _describe("", shape, dtype)))


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    """Where and as what a stored leaf is restored: the template leaf's shape and sharding."""
    data = _data(leaf)
    sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
        jax.devices()[0])
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


def _impl(leaf: Any) -> str:
    return str(jax.random.key_impl(leaf)) if _is_key(leaf) else ""


def _data(leaf: Any) -> Any:
    return jax.random.key_data(leaf) if _is_key(leaf) else (
        leaf if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) else jnp.asarray(leaf))


def _wrapped(impl: str, data: jax.Array) -> jax.Array:
    return jax.random.wrap_key_data(data, impl=impl) if impl else data


def _describe(impl: str, shape: tuple[int, ...], dtype: Any) -> str:
    return f"a {impl} PRNG key with key data {shape}" if impl else f"{shape} {dtype}"


def _mismatch(path: str, name: str, stored: str, expected: str) -> str:
    return (f"The checkpoint {path} does not match at '{name}': it stores {stored}, but "
            f"{expected} is expected here. Was it saved with another model, batch size or "
            "algorithm? (learner.reset(batch_size=...) changes the batch size.)")


def _is_key(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _few(names: Sequence[str]) -> str:
    if not names:
        return "nothing"
    shown = ", ".join(f"'{n}'" for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
