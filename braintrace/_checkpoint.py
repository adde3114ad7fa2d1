"""Checkpoint files: named arrays, Flax msgpack serialisation, a SHA-256 integrity digest.

A file is ``HEADER``, then the SHA-256 digest of the payload, then the payload:
a msgpack map from a zero-padded index to ``{'name', 'impl', 'data'}`` per leaf.
Typed PRNG keys (``jax.random.key``, e.g. inside ``nnx.Rngs``) are stored as
their ``jax.random.key_data`` with the name of their implementation in ``impl``
(``''`` for an ordinary array). Restoring checks the header, the digest, the
leaf names and every shape and dtype against a template before returning
anything, so a failed restore changes nothing.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

__all__ = ["leaf_names", "restore_arrays", "save_arrays"]

HEADER = b"braintrace-ckpt\x01"
_DIGEST_BYTES = hashlib.sha256().digest_size
_SHOWN = 3


def leaf_names(prefix: str, tree: Any) -> list[str]:
    """``prefix`` followed by each leaf's key path (``'traces[0].eps'``), in leaf order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [prefix + jax.tree_util.keystr(path) for path, _ in flat]


def save_arrays(path: str | os.PathLike, arrays: dict[str, Any]) -> None:
    """Writes named arrays to ``path`` (atomically: a partial file never replaces a good one).

    Example:
        >>> import os, tempfile, jax, jax.numpy as jnp
        >>> path = os.path.join(tempfile.mkdtemp(), 'arrays.ckpt')
        >>> save_arrays(path, {'w': jnp.ones(2), 'key': jax.random.key(0)})
        >>> restored = restore_arrays(path, {'w': jnp.zeros(2), 'key': jax.random.key(1)})
        >>> restored[0].tolist(), bool(restored[1] == jax.random.key(0))
        ([1.0, 1.0], True)
    """
    entries = {f"{i:06d}": _entry(name, leaf) for i, (name, leaf) in enumerate(arrays.items())}
    payload = serialization.msgpack_serialize(entries)
    temporary = f"{os.fspath(path)}.partial"
    with open(temporary, "wb") as f:
        f.write(HEADER + hashlib.sha256(payload).digest() + payload)
    os.replace(temporary, path)


def restore_arrays(path: str | os.PathLike, template: dict[str, Any]) -> list[jax.Array]:
    """Reads arrays written by :func:`save_arrays`, checked against ``template``.

    Args:
        path: The checkpoint file.
        template: The expected names, in order, with arrays of the expected
            shapes and dtypes (typed PRNG keys of the expected implementation).

    Returns:
        The stored arrays in the order of ``template``.

    Raises:
        ValueError: The file is not a checkpoint, is damaged (its digest does not
            match), or does not match ``template`` (a name, shape or dtype);
            the message names the file and the first offending leaf.
    """
    stored = _read(os.fspath(path))
    missing = [name for name in template if name not in stored]
    extra = [name for name in stored if name not in template]
    if missing or extra:
        raise ValueError(
            f"The checkpoint {os.fspath(path)} does not match: it lacks {_few(missing)}, "
            f"expected here, and holds {_few(extra)}, unknown here. Was it saved by another "
            "model, algorithm or optimiser?")
    return [_checked(os.fspath(path), name, stored[name], template[name]) for name in template]


def _entry(name: str, leaf: Any) -> dict[str, Any]:
    if _is_key(leaf):
        return {"name": name, "impl": str(jax.random.key_impl(leaf)),
                "data": np.asarray(jax.random.key_data(leaf))}
    return {"name": name, "impl": "", "data": np.asarray(leaf)}


def _read(path: str) -> dict[str, dict[str, Any]]:
    with open(path, "rb") as f:
        content = f.read()
    head = len(HEADER)
    if content[:head] != HEADER or len(content) < head + _DIGEST_BYTES:
        raise ValueError(
            f"{path} is not a braintrace checkpoint: it does not start with the checkpoint "
            "header (another kind of file, or a damaged one). Write checkpoints with "
            "learner.save(path) or trainer.save(path).")
    digest, payload = content[head:head + _DIGEST_BYTES], content[head + _DIGEST_BYTES:]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError(
            f"The checkpoint {path} is damaged: the SHA-256 digest of its contents does not "
            "match the one stored in it (the file was truncated or altered). Restore from "
            "another copy.")
    try:
        entries = serialization.msgpack_restore(payload)
        return {e["name"]: e for _, e in sorted(entries.items())}
    except Exception as err:  # any decoding failure means the same thing
        raise ValueError(
            f"The checkpoint {path} passed its integrity check but could not be decoded "
            f"({err}); it was written by an incompatible version.") from err


def _checked(path: str, name: str, entry: dict[str, Any], expected: Any) -> jax.Array:
    data = np.asarray(entry["data"])
    stored = _describe(entry["impl"], data.shape, data.dtype)
    if _is_key(expected):
        impl, want = str(jax.random.key_impl(expected)), jax.random.key_data(expected)
        if entry["impl"] != impl or data.shape != want.shape:
            raise ValueError(_mismatch(path, name, stored, _describe(impl, want.shape, "")))
        return jax.random.wrap_key_data(data, impl=impl)
    shape, dtype = tuple(np.shape(expected)), np.dtype(jnp.result_type(expected))
    if entry["impl"] or data.shape != shape or data.dtype != dtype:
        raise ValueError(_mismatch(path, name, stored, _describe("", shape, dtype)))
    return jnp.asarray(data)


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
