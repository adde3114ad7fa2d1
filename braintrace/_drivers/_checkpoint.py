"""Checkpoints: named orbax items, the Params under their Flax paths, with SHA-256 digests.

A checkpoint is an orbax directory of named items (written by orbax from every
process, sharded arrays included):

* ``params``: ``nnx.state(model, nnx.Param)`` as it is, under its Flax paths,
  so that plain orbax and Flax restore it without braintrace
  (``ocp.StandardCheckpointer().restore(path / 'params', nnx.state(abstract_model,
  nnx.Param))``);
* ``hidden`` and ``other``: the model's hidden states and other Variables (RNG
  keys, counters), also under their Flax paths;
* ``traces``, ``opt_state`` (an :class:`~braintrace.OnlineTrainer`'s optax state):
  their leaves under zero-padded indices (arbitrary pytrees);
* ``optimizer``: ``nnx.state(optimizer)`` of a user's ``nnx.Optimizer``, under its
  Flax paths, when one is saved;
* ``state_hidden``, ``state_other``, ``state_traces``: the fields of the
  :class:`~braintrace.OnlineState` of a user's own train step, when one is
  saved (``CheckpointManager.save(step, model=..., state=...)``; the model's
  own Variables are then ``params``, ``hidden`` and ``other`` as above);
* ``fit`` and ``fit_arrays``: the progress of an ``OnlineTrainer.fit`` that
  was running (its History and its callbacks' states: JSON values, the arrays
  among them under indices), when one was (``_fit_run.py``);
* ``braintrace``: a JSON record of every item's leaves (name, shape, dtype and
  PRNG implementation), and of the JSON items.

Typed PRNG keys (``jax.random.key``, e.g. inside ``nnx.Rngs``) are stored as
their ``jax.random.key_data``, with the name of their implementation in the
record. An item without leaves is not written. Once orbax has finished,
:data:`MANIFEST` lists the SHA-256 digest of every file of the directory.

Restoring checks every file against its digest (an error names the damaged
file), then checks the record's names, shapes and dtypes against a template,
then lets orbax read the arrays straight onto the template's shardings (so a
checkpoint restores onto another mesh or another number of devices), all
before returning anything: a failed restore changes nothing. Checkpoints of the
previous format (``braintrace-ckpt/2``: every leaf under an index in one item
``arrays``, the record in ``meta``) still restore.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from braintrace._compiler import leaf_paths

__all__ = [
    "FORMAT",
    "MANIFEST",
    "RECORD",
    "Item",
    "JsonItem",
    "check_files",
    "damaged",
    "leaf_names",
    "optimizer_item",
    "restore_args",
    "restore_checkpoint",
    "save_args",
    "save_checkpoint",
    "stored_items",
    "unpack",
    "write_manifest",
]

FORMAT = "braintrace-ckpt/3"
MANIFEST = "braintrace.sha256.json"
RECORD = "braintrace"
_PREVIOUS = "braintrace-ckpt/2"  # every leaf under an index in one item 'arrays'; 'meta'
_SHOWN = 3


class Item(NamedTuple):
    """One named item of a checkpoint.

    Attributes:
        tree: A pytree of arrays (typed PRNG keys allowed), e.g. an ``nnx.State``.
        names: One name per leaf, in leaf order (for the record and error messages).
        flax: Store the tree as it is, under its own paths (an ``nnx.State``);
            ``False`` stores its leaves under zero-padded indices (any pytree).
    """

    tree: Any
    names: Sequence[str]
    flax: bool = True


class JsonItem(NamedTuple):
    """One named item of JSON values (numbers, strings, lists, dicts), stored as orbax's
    ``JsonSave``; a template for restoring it holds ``value=None``.

    Attributes:
        value: The JSON value.
    """

    value: Any = None


def leaf_names(prefix: str, tree: Any) -> list[str]:
    """``prefix`` followed by each leaf's key path (``'traces[0].eps'``), in leaf order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [prefix + jax.tree_util.keystr(path) for path, _ in flat]


def save_args(items: dict[str, Item | JsonItem]) -> dict[str, Any]:
    """The orbax ``Composite`` items that store ``items`` and their record.

    Example:
        >>> import jax.numpy as jnp
        >>> sorted(save_args({'w': Item({'a': jnp.ones(2)}, ['w/a'])}))
        ['braintrace', 'w']
    """
    import orbax.checkpoint as ocp

    record: dict[str, Any] = {"format": FORMAT, "items": {}}
    args: dict[str, Any] = {}
    for name, item in items.items():
        if isinstance(item, JsonItem):
            record["items"][name] = {"layout": "json", "leaves": []}
            args[name] = ocp.args.JsonSave(item.value)
            continue
        leaves = jax.tree.leaves(item.tree)
        if len(leaves) != len(item.names):
            raise ValueError(f"item {name!r}: {len(leaves)} leaves but {len(item.names)} names")
        record["items"][name] = {
            "layout": "flax" if item.flax else "indexed",
            "leaves": [{"name": n, "impl": _impl(leaf), "shape": list(_data(leaf).shape),
                        "dtype": str(_data(leaf).dtype)} for n, leaf in zip(item.names, leaves)]}
        if leaves:
            tree = (jax.tree.map(_data, item.tree) if item.flax else
                    {f"{i:06d}": _data(leaf) for i, leaf in enumerate(leaves)})
            args[name] = ocp.args.StandardSave(tree)
    args[RECORD] = ocp.args.JsonSave(record)
    return args


def save_checkpoint(path: str | os.PathLike, items: dict[str, Item]) -> None:
    """Writes ``items`` as an orbax checkpoint directory at ``path`` (replacing one there).

    On several processes every process calls this with the same global arrays;
    the first writes the manifest of digests once every process has written.

    Raises:
        ValueError: ``path`` exists and is not a braintrace checkpoint (it is
            never replaced then).

    Example:
        >>> import os, tempfile, jax, jax.numpy as jnp
        >>> path = os.path.join(tempfile.mkdtemp(), 'arrays.ckpt')
        >>> items = {'w': Item({'a': jnp.ones(2)}, ['w/a']),
        ...          'keys': Item([jax.random.key(0)], ['keys[0]'], flax=False)}
        >>> save_checkpoint(path, items)
        >>> template = {'w': Item({'a': jnp.zeros(2)}, ['w/a']),
        ...             'keys': Item([jax.random.key(1)], ['keys[0]'], flax=False)}
        >>> restored = restore_checkpoint(path, template)
        >>> restored['w']['a'].tolist(), bool(restored['keys'][0] == jax.random.key(0))
        ([1.0, 1.0], True)
    """
    import orbax.checkpoint as ocp

    where = os.path.abspath(path)
    if os.path.lexists(where) and not os.path.isfile(os.path.join(where, MANIFEST)):
        raise ValueError(
            f"{where} exists and is not a braintrace checkpoint (it has no {MANIFEST}); save "
            "replaces only a checkpoint. Choose another path, or delete it first.")
    args = save_args(items)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(where, force=True, args=ocp.args.Composite(**args))
    write_manifest(where)


def write_manifest(where: str | os.PathLike) -> None:
    """Writes the SHA-256 digest of every file under ``where`` (process 0), then syncs."""
    where = os.fspath(where)
    if jax.process_index() == 0:
        files = {os.path.relpath(f, where): _file_digest(f) for f in _files(where)}
        partial = os.path.join(where, MANIFEST + ".partial")
        with open(partial, "w") as f:
            json.dump(files, f, indent=0, sort_keys=True)
        os.replace(partial, os.path.join(where, MANIFEST))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"braintrace checkpoint {where}")


def restore_args(path: str | os.PathLike, template: dict[str, Item | JsonItem]) -> dict[str, Any]:
    """The orbax ``Composite`` restore items for ``template``, after every check.

    Checks the files against the manifest's digests, then the record's names,
    shapes and dtypes against ``template`` (each leaf's sharding is where its
    stored value is put).

    Raises:
        ValueError: ``path`` is not a checkpoint, is damaged (a file's digest
            does not match), or does not match ``template`` (a name, shape or
            dtype); the message names the path and the first offending leaf.
    """
    import orbax.checkpoint as ocp

    where = os.fspath(path)
    check_files(where)
    stored = _read_record(where)
    json_items = {name for name, item in template.items() if isinstance(item, JsonItem)}
    if json_items - set(stored_items(where)):
        raise ValueError(f"The checkpoint {where} does not match: it lacks the item(s) "
                         f"{_few(sorted(json_items - set(stored_items(where))))}, expected here.")
    template = {name: item for name, item in template.items() if name not in json_items}
    expected = {name: (item_name, leaf) for item_name, item in template.items()
                for name, leaf in zip(item.names, jax.tree.leaves(item.tree), strict=True)}
    missing = [name for name in expected if name not in stored]
    extra = [name for name in stored if name not in expected]
    if missing or extra:
        raise ValueError(
            f"The checkpoint {where} does not match: it lacks {_few(missing)}, "
            f"expected here, and holds {_few(extra)}, unknown here. Was it saved by another "
            "model, algorithm or optimiser?")
    for name, (item_name, leaf) in expected.items():
        entry = stored[name]
        if entry["item"] not in (None, item_name):
            raise ValueError(f"The checkpoint {where} stores '{name}' in its item "
                             f"'{entry['item']}', but '{item_name}' is expected here.")
        _check(where, name, entry, leaf)
    if any(entry["item"] is None for entry in stored.values()):  # the previous format
        return {"arrays": ocp.args.StandardRestore(
            {f"{stored[name]['index']:06d}": _abstract(leaf)
             for name, (_, leaf) in expected.items()})}
    args = {}
    for item_name, item in template.items():
        leaves = jax.tree.leaves(item.tree)
        if not leaves:
            continue
        if item.flax:
            if [stored[n]["index"] for n in item.names] != list(range(len(leaves))):
                raise ValueError(
                    f"The checkpoint {where} stores the leaves of its item '{item_name}' in "
                    "another order than expected here. Was it saved by another model?")
            abstract = jax.tree.map(_abstract, item.tree)
        else:
            abstract = {f"{stored[n]['index']:06d}": _abstract(leaf)
                        for n, leaf in zip(item.names, leaves)}
        args[item_name] = ocp.args.StandardRestore(abstract)
    args.update({name: ocp.args.JsonRestore() for name in json_items})
    return args


def unpack(path: str | os.PathLike, template: dict[str, Item | JsonItem],
           restored: Any) -> dict[str, Any]:
    """The trees of ``template`` with the values orbax ``restored`` (PRNG keys re-wrapped)."""
    stored = _read_record(os.fspath(path))
    out = {}
    for item_name, item in template.items():
        if isinstance(item, JsonItem):
            out[item_name] = restored[item_name]
            continue
        leaves = jax.tree.leaves(item.tree)
        if not leaves:
            out[item_name] = item.tree
            continue
        legacy = stored[item.names[0]]["item"] is None
        got = restored["arrays" if legacy else item_name]
        values = (jax.tree.leaves(got) if item.flax and not legacy else
                  [got[f"{stored[n]['index']:06d}"] for n in item.names])
        if len(values) != len(leaves):
            raise ValueError(f"The checkpoint {os.fspath(path)} is damaged: its item "
                             f"'{item_name}' holds {len(values)} arrays, {len(leaves)} expected.")
        out[item_name] = jax.tree.unflatten(jax.tree.structure(item.tree), [
            _wrapped(stored[n]["impl"], v) for n, v in zip(item.names, values)])
    return out


def restore_checkpoint(path: str | os.PathLike,
                       template: dict[str, Item | JsonItem]) -> dict[str, Any]:
    """Reads the items written by :func:`save_checkpoint`, checked against ``template``.

    Args:
        path: The checkpoint directory.
        template: The expected items: trees of arrays of the expected shapes and
            dtypes (typed PRNG keys of the expected implementation), each leaf
            named; each array's sharding is where its stored value is put.

    Returns:
        Each item's tree (the structure of ``template``) with the stored values.

    Raises:
        ValueError: ``path`` is not a checkpoint, is damaged (a file's digest
            does not match, or an array cannot be read), or does not match
            ``template`` (a name, shape or dtype); the message names the path
            and the first offending leaf.
    """
    import orbax.checkpoint as ocp

    where = os.fspath(path)
    args = restore_args(where, template)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(os.path.abspath(where),
                                            args=ocp.args.Composite(**args))
    except Exception as err:  # any failure to read the arrays means the same thing
        raise damaged(where, err) from err
    return unpack(where, template, restored)


def damaged(path: str, err: BaseException) -> ValueError:
    """The error of a checkpoint whose arrays orbax could not read."""
    return ValueError(
        f"The checkpoint {path} is damaged: orbax could not read its arrays "
        f"({type(err).__name__}: {err}). Restore from another copy.")


def _files(path: str) -> list[str]:
    return sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                  if name != MANIFEST)


def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def check_files(path: str) -> None:
    """Checks every file of the checkpoint against the manifest's digest.

    Raises:
        ValueError: The manifest is missing or unreadable, or a file is missing
            or has another digest (the message names it).
    """
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
            "learner.save(path), trainer.save(path) or braintrace.CheckpointManager.") from err
    for name, digest in listed.items():
        if not os.path.isfile(name) or _file_digest(name) != digest:
            what = ("is missing" if not os.path.isfile(name) else
                    "has another SHA-256 digest than when it was saved (truncated or altered)")
            raise ValueError(f"The checkpoint {path} is damaged: its file {name} {what}. "
                             "Restore from another copy.")


def stored_items(path: str | os.PathLike) -> dict[str, list[dict[str, Any]]]:
    """The items of the checkpoint at ``path`` as its record lists them: per item, each
    leaf's ``name``, ``shape``, ``dtype`` and ``impl`` (none for a JSON item); ``{}`` for a
    checkpoint of the previous format or a directory without a record."""
    try:
        with open(os.path.join(os.fspath(path), RECORD, "metadata")) as f:
            record = json.load(f)
        return {name: item["leaves"] for name, item in record["items"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _read_record(path: str) -> dict[str, dict[str, Any]]:
    """The stored leaves by name: their item, index in it, impl, shape and dtype.

    A checkpoint of the previous format (its record in ``meta``, every leaf in
    the one item ``arrays``) has item ``None`` and its index in ``arrays``.
    """
    record_file = os.path.join(path, RECORD, "metadata")
    previous = os.path.join(path, "meta", "metadata")
    if not os.path.exists(record_file) and os.path.exists(previous):
        record_file = previous
    try:
        with open(record_file) as f:
            record = json.load(f)
        if record["format"] == _PREVIOUS and record_file == previous:
            items = {None: {"leaves": record["leaves"]}}
        elif record["format"] == FORMAT:
            items = record["items"]
        else:
            raise ValueError(f"format {record['format']!r}, this braintrace reads {FORMAT!r} "
                             f"and {_PREVIOUS!r}")
        return {e["name"]: {"item": item_name, "index": i, "impl": e["impl"],
                            "shape": tuple(e["shape"]), "dtype": np.dtype(e["dtype"])}
                for item_name, item in items.items()
                for i, e in enumerate(item["leaves"])}
    except Exception as err:  # a missing, unreadable or foreign record means the same thing
        raise ValueError(
            f"{path} is not a braintrace checkpoint of this version: its record {record_file} "
            f"is missing or unreadable ({type(err).__name__}: {err}). Write checkpoints with "
            "learner.save(path), trainer.save(path) or braintrace.CheckpointManager.") from err


def _check(path: str, name: str, entry: dict[str, Any], expected: Any) -> None:
    stored = _describe(entry["impl"], entry["shape"], entry["dtype"])
    if _is_key(expected):
        impl, want = _key_parts(expected)
        if entry["impl"] != impl or entry["shape"] != want.shape:
            raise ValueError(_mismatch(path, name, stored, _describe(impl, want.shape, "")))
        return
    shape, dtype = tuple(np.shape(expected)), np.dtype(jnp.result_type(expected))
    if entry["impl"] or entry["shape"] != shape or entry["dtype"] != dtype:
        raise ValueError(_mismatch(path, name, stored, _describe("", shape, dtype)))


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    """Where and as what a stored leaf is restored: the template leaf's shape and sharding."""
    data = _key_parts(leaf)[1] if _is_key(leaf) else _data(leaf)
    sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
        jax.devices()[0])
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


def _key_parts(key: Any) -> tuple[str, jax.ShapeDtypeStruct]:
    """The implementation's name and the key data's shape and dtype of typed PRNG keys.

    For key arrays and abstract ones (``jax.ShapeDtypeStruct``, e.g. from
    ``jax.eval_shape``), which ``jax.random.key_impl`` does not take: the name is
    read while tracing.

    Example:
        >>> name, data = _key_parts(jax.eval_shape(lambda: jax.random.key(0)))
        >>> name, data.shape
        ('threefry2x32', (2,))
    """
    names = []

    def key_data(keys: jax.Array) -> jax.Array:
        names.append(str(jax.random.key_impl(keys)))
        return jax.random.key_data(keys)

    data = jax.eval_shape(key_data, key)
    return names[0], data


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
            f"{expected} is expected here. Was it saved with another model, batch size, "
            "algorithm or trace_dtype? (learner.reset(batch_size=...) changes the batch size.)")


def _is_key(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _few(names: Sequence[str]) -> str:
    if not names:
        return "nothing"
    shown = ", ".join(f"'{n}'" for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def optimizer_item(optimizer: nnx.Optimizer) -> Item:
    """The checkpoint item of a user's ``nnx.Optimizer``: ``nnx.state(optimizer)``."""
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}.")
    state = nnx.state(optimizer)
    return Item(state, [f"optimizer/{p}" for p in leaf_paths(state)])
