"""``de-store demo``: train the CTR example, save an async sharded checkpoint, reshard it back.

0. Checks the destination before anything else: the protocol, a file in the way, a folder
   or bucket that cannot be written (see :mod:`de_store.checkpoint.destination`).
1. Trains ``examples/train_ctr.py`` on a Variable with ``save_shards`` table shards (logical
   CPUs) whose ``kv_creator`` carries a ``FileSystemSaver``.
2. Saves through ``tf.train.CheckpointManager`` with ``CheckpointOptions(enable_async=True,
   experimental_write_callbacks=[...])``: the tables are snapshotted, written in the
   background, and the callback runs once the KV checkpoint is committed.
3. Prints where the checkpoint is and how to inspect it (``de-store``, pyarrow), with the
   storage options it was given.
4. Restores it into a Variable with ``restore_shards`` shards and checks every key, value
   and optimizer slot.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import fsspec

VARIABLE = "ctr_weights"


def configure_cpus(count: int) -> list[str]:
    """Split the CPU into ``count`` logical devices (before TF initializes); their names."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    with contextlib.suppress(RuntimeError):  # TF initialized already: keep its devices
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count
        )
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(names) < count:
        raise RuntimeError(f"need {count} logical CPUs, TensorFlow has {len(names)}")
    return names[:count]


def load_example() -> ModuleType:
    """``examples/train_ctr.py``, shipped as ``de_store.examples.train_ctr``."""
    return importlib.import_module("de_store.examples.train_ctr")


def _is_local(url: str) -> bool:
    return fsspec.core.split_protocol(url)[0] in (None, "file", "local")


def run(
    directory: str,
    *,
    steps: int = 200,
    ids: int = 1_000_000,
    save_shards: int = 2,
    restore_shards: int = 3,
    say: Callable[[str], None] = print,
    progress: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> bool:
    """Run the demo into ``directory`` (any URL); True when every restored key is equal.

    ``storage_options`` go to fsspec for ``directory`` (endpoint, credentials), for the
    save, the restore and the inspection; the destination is checked before training.
    """
    options = dict(storage_options or {})
    local = _is_local(directory)
    directory = str(Path(directory).absolute()) if local else directory.rstrip("/")
    # TF's bundle needs a TF filesystem: beside the KV data when local, else a local folder
    tf_dir = directory if local else str(Path("de_store_demo_tf").absolute())
    _check_destinations(f"{directory}/de_store/ckpt-{steps}", tf_dir, options)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # the demo's output, not TF's logs
    cpus = configure_cpus(max(save_shards, restore_shards))
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    import de_store as ds

    example = load_example()
    saver = ds.FileSystemSaver(
        save_path=None if local else f"{directory}/de_store",
        progress=progress,
        storage_options=options,
    )
    weights = ds.get_variable(
        VARIABLE,
        dim=1,
        initializer=0.0,
        devices=cpus[:save_shards],
        kv_creator=ds.HashTableCreator(saver=saver),
    )
    say(f"1/4 training examples/train_ctr.py: {steps} steps, ids drawn from [0, {ids:,})")
    config = example.CtrConfig(steps=steps, id_space=ids, log_every=max(1, steps // 4))
    result = example.train(config, verbose=True)
    loss = f"{result['first_loss']:.4f} -> {result['last_loss']:.4f}"
    say(f"    loss {loss}, {int(weights.size()):,} distinct ids in the table")

    prefix, kv_url = _save_async(tf, weights, saver, tf_dir, steps, say)
    _print_inspect_help(kv_url, options, say)
    restore_saver = ds.FileSystemSaver(progress=progress, storage_options=options)
    return _restore_and_check(tf, ds, weights, prefix, cpus[:restore_shards], say, restore_saver)


def _check_destinations(kv_url: str, tf_dir: str, options: dict[str, Any]) -> None:
    """Fail before training if the KV checkpoint or the TF bundle cannot be saved."""
    from de_store.backends import open_location
    from de_store.checkpoint.destination import check_destination

    check_destination(*open_location(kv_url, options), probe=True)
    if tf_dir != kv_url.rsplit("/", 2)[0]:  # the TF bundle goes to a local folder apart
        check_destination(*open_location(tf_dir), probe=True)


def _save_async(
    tf: Any, weights: Any, saver: Any, tf_dir: str, step: int, say: Callable[[str], None]
) -> tuple[str, str]:
    committed: list[str] = []
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(weights=weights), tf_dir, 3)
    options = tf.train.CheckpointOptions(
        enable_async=True, experimental_write_callbacks=[committed.append]
    )
    start = time.perf_counter()
    prefix = manager.save(checkpoint_number=step, options=options)
    blocked = time.perf_counter() - start
    manager.checkpoint.sync()
    total = time.perf_counter() - start
    kv_url = saver.kv_url(prefix)
    say(
        f"2/4 saved {len(weights.shards)} shards asynchronously: training was blocked "
        f"{blocked:.2f} s, the save committed after {total:.2f} s "
        f"(write callback got {committed[-1] if committed else 'nothing'})"
    )
    return prefix, kv_url


def _print_inspect_help(kv_url: str, options: dict[str, Any], say: Callable[[str], None]) -> None:
    from de_store.catalog import describe

    info = describe(kv_url, options)
    entry = info["variables"][VARIABLE]
    shard = f"{kv_url}/{entry['files'][0]}"
    flag = f" --storage-options {shlex.quote(json.dumps(options))}" if options else ""
    say(f"3/4 checkpoint: {kv_url}")
    say(f"    {entry['rows']:,} rows in {entry['shards']} {entry['format']} shards")
    say("    inspect it:")
    say(f"      de-store inspect {shlex.quote(kv_url)}{flag}")
    say(f"      de-store verify {shlex.quote(kv_url)}{flag}")
    say(f"      de-store ls {shlex.quote(kv_url.rsplit('/', 1)[0])}{flag}")
    say("    open a shard with pyarrow:")
    say("      import pyarrow.parquet as pq")
    if _is_local(shard):
        say(f"      table = pq.read_table({shard!r})")
    else:
        say("      import fsspec")
        say(f"      fs, path = fsspec.core.url_to_fs({shard!r}, **{options!r})")
        say("      table = pq.read_table(path, filesystem=fs)")
    say("      print(table.schema, table.num_rows, table.slice(0, 3).to_pylist())")


def _restore_and_check(
    tf: Any,
    ds: Any,
    weights: Any,
    prefix: str,
    devices: list[str],
    say: Callable[[str], None],
    saver: Any,
) -> bool:
    restored = ds.Variable(
        VARIABLE, dim=1, devices=devices, kv_creator=ds.HashTableCreator(saver=saver)
    )
    start = time.perf_counter()
    status = tf.train.Checkpoint(weights=restored).read(prefix)
    status.assert_existing_objects_matched().expect_partial()  # not: the save_counter
    seconds = time.perf_counter() - start
    say(f"4/4 restored into {len(devices)} shards in {seconds:.2f} s; checking every key")
    problems = _differences(weights, restored)
    for column in sorted(weights.companions()):
        problems += _differences(
            weights.companions()[column], restored.companions().get(column), column
        )
    for problem in problems:
        say(f"    MISMATCH {problem}")
    if not problems:
        say(f"OK: {int(restored.size()):,} keys and their optimizer slots restored equal")
    return not problems


def _differences(saved: Any, restored: Any, column: str = "value") -> list[str]:
    import numpy as np

    if restored is None:
        return [f"column {column!r} was not restored"]
    keys_a, values_a = (t.numpy() for t in saved.export())
    keys_b, values_b = (t.numpy() for t in restored.export())
    order_a, order_b = np.argsort(keys_a), np.argsort(keys_b)
    if not np.array_equal(keys_a[order_a], keys_b[order_b]):
        return [f"{column}: saved {len(keys_a)} keys, restored {len(keys_b)} (or other keys)"]
    if not np.array_equal(values_a[order_a], values_b[order_b]):
        return [f"{column}: values differ"]
    return []
