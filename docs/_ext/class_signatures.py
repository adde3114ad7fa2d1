"""Shows a Flax NNX class's constructor arguments in its API page.

``nnx.Module`` and ``nnx.Variable`` classes are built by a metaclass whose ``__call__`` takes
``(*args, **kwargs)``, and autodoc reads the signature of that ``__call__``. For such classes
this hook replaces it with the signature of the class's own ``__init__``, which is what a user
calls (``ETPLinear(in_features, out_features, *, rngs, ...)``).
"""

from __future__ import annotations

import inspect

from sphinx.util.inspect import signature, stringify_signature

METACLASS_SIGNATURES = ("(*args: Any, **kwargs: Any)", "(*args, **kwargs)")


class _Shown:
    """A default value shown by name: its repr is the text given."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _shown_default(value: object) -> object:
    """A class or function default by its name (``float32``, ``zeros``), not its repr.

    ``<class 'jax.numpy.float32'>`` is no Python expression, and a signature that does not
    parse is shown as raw text; a local function (``variance_scaling.<locals>.init``) has no
    importable name and is shown as ``...``.
    """
    if value is inspect.Parameter.empty:
        return value
    if inspect.isclass(value) or inspect.isroutine(value):
        name = getattr(value, "__qualname__", "")
        return _Shown(name if name and "<" not in name else "...")
    return value


def init_signature(cls: type) -> str:
    """The signature of ``cls.__init__`` without ``self``, as autodoc writes signatures."""
    sig = signature(cls.__init__, bound_method=True)
    params = [p.replace(default=_shown_default(p.default)) for p in sig.parameters.values()]
    return stringify_signature(sig.replace(parameters=params), show_return_annotation=False,
                               unqualified_typehints=True)


def _on_process_signature(app, what, name, obj, options, sig, return_annotation):
    if what == "class" and sig in METACLASS_SIGNATURES and inspect.isclass(obj):
        return init_signature(obj), return_annotation
    return None


def setup(app):
    app.connect("autodoc-process-signature", _on_process_signature)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
