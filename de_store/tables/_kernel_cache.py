"""Traced kernels kept on disk, so a new process calls them without tracing them again.

Tracing the kernels of one table config builds a few thousand ops in Python, paid again
by every process that fills or restores a table (docs/benchmarks.md, Costs behind the code).
A kernel traced once is written here as its function library (the ``FunctionDef`` s of the
kernel and of every function it calls); a later process with the same TensorFlow, the same
table code and the same config adds those definitions to its context and calls the kernel
by name, eagerly, as TensorFlow calls any traced function. The compiled probe rounds
that eager bulk calls run (:mod:`._xla`) are entries of their own (:func:`as_cached`).
Calls made while tracing a caller's ``tf.function`` are not served from here: they need
the traced function.

An entry's name is a digest of everything its graph depends on: TensorFlow's version, the
source of :mod:`de_store.tables` and the config. Its functions are renamed after their
own content (``de_store_<digest>``), so they cannot collide with the functions a process
traces itself, and a function several kernels call has one name in all of them. An entry that
cannot be read or does not match its checksum is ignored (the kernel is traced, and the
entry written anew). Entries are written to a temporary file and renamed, so a reader
never sees half of one.

The directory is ``$DE_STORE_CACHE_DIR`` (default ``~/.cache/de_store``, under
``$XDG_CACHE_HOME`` when set); ``DE_STORE_CACHE_DIR=off`` turns the cache off. Nothing
in it is ever needed: deleting it costs the next process its traces and compiles.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pathlib
import tempfile
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from google.protobuf.message import DecodeError
from tensorflow.core.framework import function_pb2
from tensorflow.python.eager import context

from de_store._cache import cache_root
from de_store.tables._types import Config

log = logging.getLogger("de_store")

__all__ = ["as_cached", "cache_dir", "load", "store"]

_FORMAT = 3


def cache_dir() -> pathlib.Path | None:
    """The directory of the kernel entries, ``None`` when the cache is off."""
    return _kernel_dir()


def _kernel_dir() -> pathlib.Path | None:
    root = cache_root()
    return None if root is None else root / "kernels"


@functools.cache
def _code_digest() -> str:
    """A digest of TensorFlow's version and the source of :mod:`de_store.tables`."""
    digest = hashlib.sha256()
    digest.update(f"{_FORMAT}|{tf.version.VERSION}|{tf.version.GIT_VERSION}".encode())
    for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _entry_key(config: Config | None, name: str) -> str:
    text = f"{_code_digest()}|{config!r}|{name}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def store(config: Config | None, name: str, concrete: Any) -> Callable[..., Any] | None:
    """Write the traced kernel ``concrete`` (a ``ConcreteFunction``) as the entry of
    ``(config, name)`` (``config`` ``None``: a function of no config, see
    :func:`as_cached`) and return it as :func:`load` would (its functions renamed), or
    ``None`` when the cache is off or the kernel captures tensors. A directory that cannot
    be written is logged at DEBUG; the kernel is returned all the same."""
    root = _kernel_dir()
    if root is None:
        return None
    if concrete.captured_inputs:
        log.debug("kernel %s captures tensors: not cached", name)
        return None
    key = _entry_key(config, name)
    try:
        library, main, count, outputs = _by_content(concrete)
    except (TypeError, StopIteration) as err:
        log.debug("kernel %s not cached: its outputs are not tensors: %s", name, err)
        return None
    payload = library.SerializeToString(deterministic=True)
    header = {
        "main": main,
        "count": count,
        "outputs": outputs,
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    temporary: str | None = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=f".{key}-", delete=False) as out:
            temporary = out.name
            out.write(json.dumps(header).encode() + b"\n" + payload)
        os.replace(temporary, root / f"{key}.kernel")
    except OSError as err:
        log.debug("kernel cache %s not written: %s", root, err)
        if temporary is not None:  # a full disk: leave no half-written entry behind
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    else:
        log.debug("kernel %s traced and written to %s", name, root / f"{key}.kernel")
    return _called_by_name(library, main, count, outputs)


def _by_content(concrete: Any) -> tuple[function_pb2.FunctionDefLibrary, str, int, Any]:
    """``concrete``'s function library with every function renamed after its content
    (:func:`_renamed`): ``(library, main, count, outputs)``, ``main`` the name of the
    function itself, ``count`` its outputs, ``outputs`` their structure (:func:`_numbered`).
    Raises ``TypeError`` when its outputs are not tensors in tuples."""
    library = function_pb2.FunctionDefLibrary()
    library.function.extend(concrete.graph.as_graph_def().library.function)
    library.function.append(concrete.function_def)
    main = _renamed(library)[concrete.function_def.signature.name]
    count = len(concrete.function_def.signature.output_arg)
    numbers = iter(range(count))
    outputs = _numbered(concrete.structured_outputs, numbers)
    if next(numbers, None) is not None:
        raise TypeError(f"fewer tensors than the function's {count} outputs")
    return library, main, count, outputs


def as_cached(function: Any, name: str) -> Callable[..., Any]:
    """``function`` (a ``tf.function`` with an input signature, called eagerly) as the
    kernels of the cache call it: renamed after its content. XLA keys its compiles by
    function name, so a compiled function called this way and from a cached kernel is
    compiled once for both. Its functions are an entry of their own, ``name`` (unique
    among such functions, the same in every process): read from the cache when it holds
    them, else traced and written there. With the cache off, ``function`` itself (the
    kernels call it by its own name then)."""
    if _kernel_dir() is None:
        return function  # type: ignore[no-any-return]
    known = load(None, name)
    if known is not None:
        return known
    concrete = function.get_concrete_function()
    stored = store(None, name, concrete)
    if stored is not None:
        return stored
    return _called_by_name(*_by_content(concrete))  # not storable (see store)


def load(config: Config | None, name: str) -> Callable[..., Any] | None:
    """The cached kernel of ``(config, name)`` as an eager callable taking the kernel's
    flat inputs, or ``None`` when there is no valid entry."""
    root = _kernel_dir()
    if root is None:
        return None
    path = root / f"{_entry_key(config, name)}.kernel"
    try:
        header_line, payload = path.read_bytes().split(b"\n", 1)
        header = json.loads(header_line)
        if hashlib.sha256(payload).hexdigest() != header["sha256"]:
            raise ValueError("the functions do not match their checksum")
        library = function_pb2.FunctionDefLibrary.FromString(payload)
        main, count, outputs = str(header["main"]), int(header["count"]), header["outputs"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, DecodeError) as err:
        log.debug("kernel cache entry %s ignored: %s", path, err)
        return None
    log.debug("kernel %s loaded from %s", name, path)
    return _called_by_name(library, main, count, outputs)


def _called_by_name(
    library: function_pb2.FunctionDefLibrary, main: str, count: int, outputs: Any
) -> Callable[..., Any]:
    """An eager callable running function ``main`` of ``library`` by name, its ``count``
    outputs packed as ``outputs`` numbers them."""

    def call(*inputs: tf.Tensor) -> Any:
        ctx = context.context()
        if not ctx.has_function(main):
            for fdef in library.function:  # callees first, as the trace listed them
                if not ctx.has_function(fdef.signature.name):
                    ctx.add_function_def(fdef)
        flat = ctx.call_function(main.encode(), list(inputs), count)
        return None if outputs is None else _packed(outputs, flat or [])

    return call


def _renamed(library: function_pb2.FunctionDefLibrary) -> dict[str, str]:
    """Rename every function of ``library`` after its content, and every reference to it
    (call ops, ``func`` attributes of calls, conditionals and loops); return the names.

    A function's name is a digest of its definition with its callees renamed first, so a
    function that several kernels call (a compiled probe round) has one name in all of
    their entries, in every process: XLA, which keys its compiles by function name,
    compiles it once for all of them.
    """
    by_name = {f.signature.name: f for f in library.function}
    names: dict[str, str] = {}

    def rename(name: str) -> str:
        if name not in names:
            fdef = by_name[name]
            for callee in _callees(fdef) & by_name.keys():
                rename(callee)
            _rename_references(fdef, names)
            fdef.signature.name = ""
            digest = hashlib.sha256(fdef.SerializeToString(deterministic=True)).hexdigest()
            names[name] = fdef.signature.name = f"de_store_{digest[:24]}"
        return names[name]

    for name in list(by_name):
        rename(name)
    return names


def _callees(fdef: function_pb2.FunctionDef) -> set[str]:
    found = set()
    for node in fdef.node_def:
        found.add(node.op)
        for attr in node.attr.values():
            if attr.HasField("func"):
                found.add(attr.func.name)
            found.update(func.name for func in attr.list.func)
    return found


def _rename_references(fdef: function_pb2.FunctionDef, names: dict[str, str]) -> None:
    for node in fdef.node_def:
        if node.op in names:
            node.op = names[node.op]
        for attr in node.attr.values():
            if attr.HasField("func") and attr.func.name in names:
                attr.func.name = names[attr.func.name]
            for func in attr.list.func:
                if func.name in names:
                    func.name = names[func.name]


def _numbered(structure: Any, counter: Any) -> Any:
    """``structure`` (tensors in tuples, or None for no outputs) with each tensor replaced
    by its flat index."""
    if structure is None:
        return None
    if type(structure) in (tuple, list):
        return [_numbered(x, counter) for x in structure]
    if isinstance(structure, tf.Tensor):
        return next(counter)  # StopIteration: more tensors than the function's outputs
    raise TypeError(f"outputs of type {type(structure).__name__} are not cached")


def _packed(numbered: Any, flat: list[tf.Tensor]) -> Any:
    if isinstance(numbered, list):
        return tuple(_packed(x, flat) for x in numbered)
    return flat[numbered]
