"""API reference pages generated from each public module's ``__all__`` at build time.

The reference follows ``__all__`` without hand edits: for every module in :data:`MODULES` this
writes ``api/<module>.rst`` with the module's docstring, one ``autosummary`` table for its
classes and one for its functions (autosummary turns each entry into a page of its own), and
an entry with type and value for every other public object (the ETP primitives,
``__version__``). A name that is itself a public module (``braintrace.tasks``) links to that
module's page.

Used as a Sphinx extension (on ``config-inited``, before Sphinx lists the source files) and
by ``tests/test_docs.py``, which checks that every public name gets an entry.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import types

MODULES = ("braintrace", "braintrace.layers", "braintrace.tasks", "braintrace.nir")
API_DIR = "api"
STUB_DIR = "_generated"
KINDS = ("Classes", "Functions", "Objects")
STUB_KINDS = ("Classes", "Functions")  # one page each; objects are listed on the module page


def kind_of(obj: object) -> str:
    """The table a public name is listed in: ``Classes``, ``Functions`` or ``Objects``."""
    if inspect.isclass(obj):
        return "Classes"
    if inspect.isroutine(obj):
        return "Functions"
    return "Objects"


def public_names(module_name: str) -> dict[str, list[str]]:
    """``__all__`` of a module grouped by kind (plus ``Modules``), each list sorted."""
    module = importlib.import_module(module_name)
    try:
        names = module.__all__
    except AttributeError:
        raise ValueError(f"{module_name} has no __all__; the API reference is built from it, "
                         "so list its public names there") from None
    groups: dict[str, list[str]] = {"Modules": [], **{kind: [] for kind in KINDS}}
    for name in names:
        obj = getattr(module, name)
        kind = "Modules" if isinstance(obj, types.ModuleType) else kind_of(obj)
        groups[kind].append(name)
    return {kind: sorted(group, key=str.lower) for kind, group in groups.items()}


def public_type_name(cls: type) -> str:
    """``cls``'s public dotted name: ``braintrace.ETPPrimitive``, ``str``, ``numpy.ndarray``."""
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            if getattr(module, name) is cls:
                return f"{module_name}.{name}"
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def object_entry(name: str, obj: object) -> list[str]:
    """A ``py:data`` entry for a public object that is not a class, function or module.

    autosummary would show such an object's type's docstring (``str``'s for ``__version__``,
    :class:`braintrace.ETPPrimitive`'s for every primitive); the entry gives the object's type
    and value instead, and its own docstring only when it has one.
    """
    type_name = public_type_name(type(obj))
    value = repr(obj)
    value = value if len(value) <= 80 else value[:77] + "..."
    lines = [f".. py:data:: {name}", f"   :type: {type_name}", f"   :value: {value}", ""]
    doc = getattr(obj, "__doc__", None)
    if doc and doc != type(obj).__doc__:
        lines += ["   " + line for line in inspect.cleandoc(doc).split("\n\n")[0].splitlines()]
    else:
        lines.append(f"   An instance of :class:`{type_name}`.")
    return [*lines, ""]


def module_page(module_name: str) -> str:
    """reStructuredText of one module's reference page."""
    module = importlib.import_module(module_name)
    title = f"``{module_name}``"
    lines = [title, "=" * len(title), "", f".. automodule:: {module_name}", "   :no-members:",
             "", f".. currentmodule:: {module_name}", ""]
    groups = public_names(module_name)
    if groups["Modules"]:
        lines += ["Modules", "-------", ""]
        for name in groups["Modules"]:
            summary = inspect.getdoc(getattr(module, name)) or ""
            first = summary.splitlines()[0] if summary else ""
            full = f"{module_name}.{name}"
            link = f":doc:`{full}`" if full in MODULES else f"``{full}``"
            lines.append(f"* {link}: {first}")
        lines.append("")
    for kind in ("Classes", "Functions"):
        if groups[kind]:
            lines += [kind, "-" * len(kind), "", ".. autosummary::", f"   :toctree: {STUB_DIR}",
                      "   :nosignatures:", "", *(f"   {name}" for name in groups[kind]), ""]
    if groups["Objects"]:
        lines += ["Objects", "-------", ""]
        for name in groups["Objects"]:
            lines += object_entry(name, getattr(module, name))
    return "\n".join(lines)


def write_pages(source_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes ``api/<module>.rst`` for every module; rewrites a file only when it changed.

    Stub pages of names no longer public (left by an earlier build) are removed, so that a
    renamed object does not leave an orphan page behind.
    """
    api_dir = source_dir / API_DIR
    api_dir.mkdir(exist_ok=True)
    written, documented = [], set()
    for module_name in MODULES:
        path = api_dir / f"{module_name}.rst"
        text = module_page(module_name)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        written.append(path)
        groups = public_names(module_name)
        documented |= {f"{module_name}.{name}" for kind in STUB_KINDS for name in groups[kind]}
    for stub in (api_dir / STUB_DIR).glob("*.rst"):
        if stub.stem not in documented:
            stub.unlink()
    return written


def _on_config_inited(app, config) -> None:
    write_pages(pathlib.Path(app.srcdir))


def setup(app):
    # Before Sphinx lists the source files (and autosummary generates its stubs from them).
    app.connect("config-inited", _on_config_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
