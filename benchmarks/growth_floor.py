"""What TensorFlow's CPU allocator keeps of a growing table, by the layout of its rows.

One fresh process per layout takes the benchmark's rows (``harness.rows``: ``--keys``
int64 keys and float32 rows of ``--dim``, in batches of 2**20) into an empty table, then
reports its RSS over its data and the runtime: the RSS after the fill, less the RSS right
after ``import tensorflow`` (and de_store, where it runs) and one small op, less the
data's bytes (the index and the rows in use). Layouts:

* ``de_store``: a ``de_store.get_variable`` table with no ``init_size``, as
  ``scale_curve.py`` fills it; its data is its index and its rows in use
  (``scale_curve.table_bytes``).
* ``one_buffer``: the plainest table that keeps its rows in one buffer, as de_store does
  on a CPU: an index of 16 bytes a slot (key and row) rebuilt at twice its capacity when
  a batch would take it past a load of 0.75, every slot written (a rehash writes them
  all) and one entry a key; one variable of values and one of keys, grown when a batch
  does not fit into a new store left unwritten (``Empty``) for every key the index holds
  before it grows again, the rows in use copied into it, the old store dropped.
* ``blocks``: the same index, the rows in blocks of ``--block-rows`` rows (a variable of
  values and one of keys each), each allocated once, unwritten, when the rows reach it:
  nothing of the rows is ever copied or freed.
* ``geometric``: the same, block ``k`` holding ``--block-rows * 2**k`` rows.

The plain tables place their index entries by a multiplicative hash of the key, one
write each, without probing (a colliding key overwrites): they move a table's bytes, they
do not answer lookups. Their rows are the same bytes de_store holds.

``bfc_region`` measures what the allocator itself touches for a buffer it hands out: the
RSS a 4 GiB store left unwritten adds. TensorFlow's BFC allocator (oneDNN's default CPU
allocator on x86 Linux) keeps an 8-byte handle for every 256 bytes of each region it
reserves, written when the region is made: 1/32 of the region, written or not.

``foreign_store`` measures the one way to keep a store out of that allocator from Python:
memory TensorFlow did not allocate (numpy's, aligned, taken without a copy through
DLPack: ``aliased_without_copy``), assigned to a variable as de_store assigns a grown
store, then one row written into it by a scatter. TensorFlow writes into a variable's
buffer in place only when the variable holds it alone and TensorFlow owns it; a tensor
over foreign memory never counts as owned, so the write first copies the whole store into
the allocator (``write_reached_store`` False; ``allocator_in_use_added_by_write_bytes``
and ``rss_added_by_write_bytes`` the store's size).

``allocator_in_use_bytes``: what TensorFlow's CPU allocator counts in use after the fill
(``tf.config.experimental.get_memory_info``; ``None`` where it keeps no count). The RSS
over it is what the allocator holds free, and malloc's. ``address_space_added_by_fill_mib``:
the address space the fill added (``VmSize``): under BFC, the regions it reserved and their
handles (1/32 of them, all resident), which it never gives back.

``--release`` then hands back the pages of the chunks BFC holds free, as a growth's
release does (:func:`release_all`: every size from ``--release-from`` down by halves to
16 MiB, chunks taken until one has no page resident), and reports the RSS over the data
and the runtime after it (``over_after_release_mib``): what any release of free chunks
leaves of each layout, BFC's handles above all. ``address_space_added_mib`` is the address
space the release itself made BFC reserve (a request no free chunk fitted), whose handles
count in the RSS after it.

``--allocator system`` runs every process with ``TF_ONEDNN_USE_SYSTEM_ALLOCATOR=1`` (malloc
and free). Figures: ``over_data_and_runtime_mib`` per layout; the last line is the JSON.

```bash
python benchmarks/growth_floor.py --keys 50000000 --dim 16
```
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import _harness as harness
import scale_curve
from scale_curve import current_rss

MIB = 1 << 20
LAYOUTS = ("de_store", "one_buffer", "blocks", "geometric")
INDEX_SLOT_BYTES = 16
MAX_LOAD = 0.75
FIRST_SLOTS = 1 << 17
#: An odd 64-bit multiplier (two's complement): the plain tables' hash of a key.
HASH_MULTIPLIER = -7046029254386353131
REGION_PROBE_BYTES = 4 << 30
FOREIGN_STORE_BYTES = 1 << 30


def import_tf(with_de_store: bool) -> tuple[Any, int]:
    """TensorFlow (and de_store) imported and one small op run: the runtime's RSS."""
    import tensorflow as tf

    if with_de_store:
        import de_store  # noqa: F401

    tf.zeros([16]).numpy()
    return tf, current_rss()


def unwritten_store(tf: Any, rows: int, dim: int | None, dtype: Any) -> Any:
    """A variable holding ``rows`` rows left unwritten: no page of it is touched."""
    shape = [rows, dim] if dim else [rows]
    store = tf.Variable(tf.zeros([0, *shape[1:]], dtype), shape=tf.TensorShape([None, *shape[1:]]))
    tf.raw_ops.DisableCopyOnRead(resource=store.handle)
    store.assign(tf.raw_ops.Empty(shape=shape, dtype=dtype))
    return store


class PlainTable:
    """The plainest growing table of one layout (see the module's docstring)."""

    def __init__(self, tf: Any, layout: str, dim: int, block_rows: int) -> None:
        self.tf, self.layout, self.dim, self.block_rows = tf, layout, dim, block_rows
        self.capacity = FIRST_SLOTS
        self.index = tf.Variable(
            tf.fill([FIRST_SLOTS, 2], tf.constant(-1, tf.int64)), shape=tf.TensorShape([None, 2])
        )
        self.used = 0
        # (first row, values, keys) of each block; one block of every row for one_buffer
        self.blocks: list[tuple[int, Any, Any]] = []
        self.multiplier = tf.constant(HASH_MULTIPLIER, tf.int64)

    def insert(self, keys: Any, values: Any) -> None:
        tf = self.tf
        n = int(keys.shape[0])
        if self.used + n > MAX_LOAD * self.capacity:
            while self.used + n > MAX_LOAD * self.capacity:
                self.capacity *= 2
            self._rehash()
        self._make_room(self.used + n)
        rows = tf.range(self.used, self.used + n, dtype=tf.int64)
        for first, block_values, block_keys in self.blocks:
            lo, hi = max(first, self.used), min(first + self._length(block_keys), self.used + n)
            if lo < hi:
                at = tf.range(lo - first, hi - first, dtype=tf.int64)
                part = slice(lo - self.used, hi - self.used)
                block_values.scatter_update(tf.IndexedSlices(values[part], at))
                block_keys.scatter_update(tf.IndexedSlices(keys[part], at))
        self._place(tf.stack([keys, rows], 1))
        self.used += n

    def data_bytes(self) -> int:
        return self.capacity * INDEX_SLOT_BYTES + self.used * (self.dim * 4 + 8)

    def _length(self, store: Any) -> int:
        return int(self.tf.raw_ops.VariableShape(input=store.handle).numpy()[0])

    def _place(self, entries: Any) -> None:
        tf = self.tf
        slots = tf.math.floormod(entries[:, 0] * self.multiplier, self.capacity)
        tf.raw_ops.DisableCopyOnRead(resource=self.index.handle)
        self.index.scatter_update(tf.IndexedSlices(entries, slots))

    def _rehash(self) -> None:
        """A new index of every slot written, the old one's entries placed in it."""
        tf = self.tf
        tf.raw_ops.DisableCopyOnRead(resource=self.index.handle)
        old = self.index.read_value()
        live = tf.gather(old, tf.where(old[:, 0] != -1)[:, 0])
        del old
        self.index.assign(tf.fill([self.capacity, 2], tf.constant(-1, tf.int64)))
        self._place(live)

    def _make_room(self, needed: int) -> None:
        held = self.blocks[-1][0] + self._length(self.blocks[-1][2]) if self.blocks else 0
        if needed <= held:
            return
        if self.layout == "one_buffer":
            self._regrow(max(needed, int(MAX_LOAD * self.capacity)))
            return
        while held < needed:
            size = self.block_rows
            if self.layout == "geometric":
                size <<= len(self.blocks)
            values = unwritten_store(self.tf, size, self.dim, self.tf.float32)
            self.blocks.append((held, values, unwritten_store(self.tf, size, None, self.tf.int64)))
            held += size

    def _regrow(self, rows: int) -> None:
        """One store of ``rows`` rows left unwritten, the rows in use copied into it."""
        tf = self.tf
        values = unwritten_store(tf, rows, self.dim, tf.float32)
        keys = unwritten_store(tf, rows, None, tf.int64)
        if self.blocks:
            _, old_values, old_keys = self.blocks.pop()
            at = tf.range(self.used, dtype=tf.int64)
            for old, new in ((old_values, values), (old_keys, keys)):
                tf.raw_ops.DisableCopyOnRead(resource=old.handle)
                new.scatter_update(tf.IndexedSlices(old.read_value()[: self.used], at))
        self.blocks.append((0, values, keys))


def phase_fill(args: argparse.Namespace) -> None:
    """Fill one layout's table in this process; emit its seconds, RSS and data bytes."""
    tf, runtime = import_tf(args.phase == "de_store")
    space = address_space()
    if args.phase == "de_store":
        import de_store

        variable = scale_curve.make_variable(tf, de_store, args.dim)
        insert, data = variable.upsert, lambda: scale_curve.table_bytes(variable)
    else:
        table = PlainTable(tf, args.phase, args.dim, args.block_rows)
        insert, data = table.insert, table.data_bytes
    seconds = 0.0
    for batch_keys, batch_values in harness.rows(args.keys, args.dim):
        batch = tf.constant(batch_keys), tf.constant(batch_values)
        start = time.perf_counter()
        insert(*batch)
        seconds += time.perf_counter() - start
    del batch, batch_keys, batch_values  # the last batch's copies: not the table's
    rss, data_bytes = current_rss(), data()
    over = (rss - runtime - data_bytes) / MIB
    out = {"fill_s": seconds, "rss_after_import_bytes": runtime, "rss_after_fill_bytes": rss,
           "data_bytes": data_bytes, "over_data_and_runtime_mib": over,
           "allocator_in_use_bytes": allocator_in_use(),
           "address_space_added_by_fill_mib": (address_space() - space) / MIB}  # fmt: skip
    if args.release:
        space = address_space()
        out["released_chunk_bytes"] = release_all(args.release_from)
        out["address_space_added_mib"] = (address_space() - space) / MIB
        out["over_after_release_mib"] = (current_rss() - runtime - data_bytes) / MIB
    harness.emit(out)


def release_all(largest: int) -> int:
    """Hand back the resident pages of every chunk of 16 MiB or more that BFC holds free:
    at each size from ``largest`` down by halves, chunks are taken (and held, so that the
    next request gets another) until one has no page resident; return the bytes of the
    chunks that had some (the RSS falls by their resident pages only)."""
    from de_store._memory import MIN_RELEASE_BYTES, _hand_back, _page_calls, _take

    calls = _page_calls()
    if calls is None:
        return 0
    held, released, size = [], 0, largest
    while size >= MIN_RELEASE_BYTES:
        while True:
            chunk, start = _take(size)
            held.append(chunk)
            pages = _hand_back(calls[0], start, size)
            released += pages
            if not pages:
                break
        size //= 2
    return released


def address_space() -> int:
    """Bytes of this process's address space (``VmSize``; 0 where not reported)."""
    return harness.proc_status("VmSize").get("VmSize", 0)


def allocator_in_use() -> int | None:
    """Bytes TensorFlow's CPU allocator counts in use (None where it keeps no count: the
    system allocator answers 0, or raises, with a table filled). Imported here, after the
    RSS is read: the plain layouts' runtime holds no de_store."""
    from de_store._memory import cpu_bytes_in_use

    return cpu_bytes_in_use()


def phase_bfc_region(args: argparse.Namespace) -> None:
    tf, runtime = import_tf(False)
    store = unwritten_store(tf, REGION_PROBE_BYTES // 64, 16, tf.float32)
    added = current_rss() - runtime
    harness.emit({"store_bytes": REGION_PROBE_BYTES, "rss_added_bytes": added})
    del store


def phase_foreign_store(args: argparse.Namespace) -> None:
    import numpy as np

    tf, _ = import_tf(False)
    rows = FOREIGN_STORE_BYTES // (4 * args.dim)
    raw = np.empty(FOREIGN_STORE_BYTES + 64, np.uint8)  # aligned as TensorFlow needs
    start = -raw.ctypes.data % 64
    values = raw[start : start + FOREIGN_STORE_BYTES].view(np.float32).reshape(rows, args.dim)
    values.fill(0)  # resident, as a store's rows are
    tensor = tf.experimental.dlpack.from_dlpack(values.__dlpack__())
    values[0, 0] = 1
    aliased = float(tensor[0, 0]) == 1
    variable = tf.Variable(tf.zeros([1, args.dim]), shape=tf.TensorShape([None, args.dim]))
    tf.raw_ops.DisableCopyOnRead(resource=variable.handle)  # as de_store assigns a store
    variable.assign(tensor)
    del tensor
    memory_info = tf.config.experimental.get_memory_info  # 0 in use under malloc
    in_use, rss = memory_info("CPU:0")["current"], current_rss()
    variable.scatter_update(tf.IndexedSlices(tf.fill([1, args.dim], 2.0), [1]))
    harness.emit({
        "store_bytes": FOREIGN_STORE_BYTES,
        "aliased_without_copy": aliased,
        "write_reached_store": bool(values[1, 0] == 2),
        "allocator_in_use_added_by_write_bytes": memory_info("CPU:0")["current"] - in_use,
        "rss_added_by_write_bytes": current_rss() - rss,
    })  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=50_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--block-rows", type=int, default=1 << 20)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--release", action="store_true")
    parser.add_argument("--release-from", type=int, default=1 << 30)
    parser.add_argument("--allocator", choices=("default", "system"), default="default")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.phase == "bfc_region":
        phase_bfc_region(args)
        return
    if args.phase == "foreign_store":
        phase_foreign_store(args)
        return
    if args.phase:
        phase_fill(args)
        return
    env = {"TF_ONEDNN_USE_SYSTEM_ALLOCATOR": "1"} if args.allocator == "system" else {}
    options = ["--keys", str(args.keys), "--dim", str(args.dim)]
    options += ["--block-rows", str(args.block_rows), "--release-from", str(args.release_from)]
    options += ["--release"] if args.release else []
    result: dict[str, Any] = {"keys": args.keys, "dim": args.dim, "block_rows": args.block_rows,
                              "allocator": args.allocator, "layouts": {}}  # fmt: skip
    print(f"{args.keys:,} x {args.dim}, allocator {args.allocator}: RSS over data + runtime")
    for layout in args.layouts.split(","):
        if layout not in LAYOUTS:
            raise SystemExit(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
        figures = harness.run_phase(__file__, layout, options, env=env)
        result["layouts"][layout] = figures
        in_use = figures["allocator_in_use_bytes"]
        print(f"  {layout:<11} fill {figures['fill_s']:6.1f} s  data "
              f"{figures['data_bytes'] / MIB:8,.0f} MiB  over "
              f"{figures['over_data_and_runtime_mib']:7,.0f} MiB  allocator in use "
              f"{'-' if in_use is None else f'{in_use / MIB:,.0f} MiB'}", flush=True)  # fmt: skip
        if args.release:
            chunks, added = figures["released_chunk_bytes"], figures["address_space_added_mib"]
            print(f"  {'':<11} after the release ({chunks / MIB:,.0f} MiB of free chunks "
                  f"had pages): over {figures['over_after_release_mib']:7,.0f} MiB, address "
                  f"space added {added:,.0f} MiB", flush=True)  # fmt: skip
    region = harness.run_phase(__file__, "bfc_region", options, env=env)
    result["unwritten_store"] = region
    print(f"  a {region['store_bytes'] / MIB:,.0f} MiB store left unwritten adds "
          f"{region['rss_added_bytes'] / MIB:,.0f} MiB of RSS")  # fmt: skip
    foreign = harness.run_phase(__file__, "foreign_store", options, env=env)
    result["foreign_store"] = foreign
    added = foreign["allocator_in_use_added_by_write_bytes"] / MIB
    print(f"  a {foreign['store_bytes'] / MIB:,.0f} MiB store of numpy's memory, taken without "
          f"a copy ({foreign['aliased_without_copy']}): one row written "
          f"{'reached it' if foreign['write_reached_store'] else 'copied it'}, adding "
          f"{added:,.0f} MiB in use by TensorFlow's "
          f"allocator and {foreign['rss_added_by_write_bytes'] / MIB:,.0f} MiB of RSS")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
