"""The cache directory of traced kernels and XLA executables (nothing in it is ever needed).

A new process pays for tracing a table's kernels and for XLA's compiles of their first
probe rounds, before its first insert, many times what the insert itself takes
(docs/benchmarks.md, Costs behind the code); both are kept here so that later processes
load them instead (:mod:`de_store.tables._kernel_cache` for the kernels).
:func:`use_xla_cache` runs when ``de_store`` is imported: it points TensorFlow's
persistent XLA cache (``--tf_xla_persistent_cache_directory``) at ``xla/<TensorFlow
version>-<CPU digest>`` in this directory (XLA compiles for the CPU it runs on), by
adding the flag to ``TF_XLA_FLAGS``, unless that names a cache directory already.
TensorFlow reads the variable when it starts its runtime (the first tensor or op), so a
process that ran TensorFlow ops before importing ``de_store`` keeps its own setting; the
XLA cache then also holds the process's other XLA compiles. TensorFlow logs two lines
about machine features (``+prefer-no-scatter``, ``+prefer-no-gather``) for each
executable it loads from there: tuning flags of the compile, not instruction sets; the
executable runs.

The directory is ``$DE_STORE_CACHE_DIR``, by default ``de_store`` under
``$XDG_CACHE_HOME`` or ``~/.cache``; ``DE_STORE_CACHE_DIR=off`` turns both caches off.
Deleting it costs the next process its traces and compiles, nothing else.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import pathlib
import platform

log = logging.getLogger("de_store")

__all__ = ["cache_root", "use_xla_cache"]

_OFF = ("", "off", "0", "false", "none")
_TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tf-nightly")


def cache_root() -> pathlib.Path | None:
    """The cache directory, or ``None`` when the caches are off."""
    root = os.environ.get("DE_STORE_CACHE_DIR")
    if root is not None:
        return None if root.strip().lower() in _OFF else pathlib.Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "de_store"


def use_xla_cache() -> None:
    """Point TensorFlow's persistent XLA cache into :func:`cache_root` (see the module
    docstring). The entries of one TensorFlow version are kept apart from another's; when
    the installed version cannot be told, the XLA cache is not used."""
    root = cache_root()
    flags = os.environ.get("TF_XLA_FLAGS", "")
    if root is None or "tf_xla_persistent_cache_directory" in flags:
        return
    version = _tensorflow_version()
    if version is None:
        return
    directory = root / "xla" / f"{version}-{_cpu_digest()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        log.debug("XLA cache %s not used: %s", directory, err)
        return
    os.environ["TF_XLA_FLAGS"] = f"{flags} --tf_xla_persistent_cache_directory={directory}".strip()


def _cpu_digest() -> str:
    """A digest of this CPU's architecture and instruction set extensions: XLA compiles
    for the CPU it runs on, and a home directory may be shared by unlike machines."""
    features = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return hashlib.sha256(f"{features}|{flags}".encode()).hexdigest()[:12]


def _tensorflow_version() -> str | None:
    for name in _TENSORFLOW_DISTRIBUTIONS:
        try:
            return f"{name}-{importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
