"""The dynamic embedding ``Variable``: one table core per device, keys spread by a partitioner.

``get_variable`` gets or creates a :class:`Variable` by (name-scoped) name, with the
semantics of TFRA's ``dynamic_embedding.get_variable``. A Variable owns its shards (table
cores) and its *companions*: optimizer slots and restrict-policy status, kept as dynamic
tables with the same keys, devices and partitioner, so every key's state sits on one shard.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from de_store._variable_args import (
    Initializer,
    after,
    check_dim,
    check_dtypes,
    checked_keys,
    checked_rows,
    grouped,
    holding_lock,
    module_name,
    own_order,
    resolve_devices,
    tfra_order,
)
from de_store._variable_registry import existing_variable, register, scoped_name
from de_store.checkpoint.variable_rows import ChangeBase
from de_store.errors import VariableError
from de_store.partition import Partitioner, default_partition_fn, split_by_shard, stitch_shards
from de_store.saver import tf_hook  # registers the TF checkpoint saver of Variables
from de_store.saver.rows import reserve_shards
from de_store.table_creators import CuckooHashTableCreator as CuckooHashTableCreator
from de_store.table_creators import HashTableCreator
from de_store.tables._locking import on_device

if TYPE_CHECKING:  # importing de_store.tables creates TF constants, which fixes the devices
    from de_store.backends import Backend
    from de_store.tables.base import TableCore


class Variable(tf.Module):
    """A sharded, growable key -> embedding-row table (see :func:`get_variable`).

    Every method works eagerly and inside ``tf.function``. ``remove`` and ``clear`` act
    on the companions (optimizer slots, restrict status) too, so a key's state goes with it.

    Threads: every method may be called from any number of threads, and from
    ``tf.function`` s running at the same time. Each call on one shard is atomic (its table
    core holds its mutex while the call's ops run). Eager calls also hold the Variable's
    lock (a Python lock shared with its companions), so an eager call is atomic over all
    shards and companions; :meth:`exclusive` holds it over several calls (a restore, a
    snapshot). Inside a running graph only the table mutexes apply.
    """

    change_base: ChangeBase | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Arguments as :func:`get_variable`'s: ``Variable(name, key_dtype, value_dtype,
        dim, ...)``, or TFRA's order ``Variable(key_dtype, value_dtype, dim, devices,
        partitioner, shared_name, name, initializer, ...)`` when the first positional
        argument is not a name."""
        in_tfra_order = bool(args) and not isinstance(args[0], str)
        options = (tfra_order if in_tfra_order else own_order)(*args, **kwargs)
        self._setup(**options)

    def _setup(
        self,
        name: str,
        key_dtype: tf.DType,
        value_dtype: tf.DType,
        dim: int,
        devices: str | Sequence[str] | None,
        partitioner: Partitioner,
        shared_name: str | None,
        initializer: Any,
        trainable: bool,
        checkpoint: bool,
        init_size: int,
        kv_creator: HashTableCreator | None,
        restrict_policy: Callable[[Variable], Any] | None,
        bp_v2: bool,
        short_file_name: bool,
    ) -> None:
        super().__init__(name=module_name(name))
        self._full_name = name
        self.key_dtype, self.value_dtype = check_dtypes(name, key_dtype, value_dtype)
        self.dim = check_dim(name, dim)
        self.devices = resolve_devices(name, devices)
        self.partitioner, self.shared_name = partitioner, shared_name or "get_variable"
        self.trainable, self.checkpoint, self.bp_v2 = trainable, checkpoint, bp_v2
        self.short_file_name = bool(short_file_name)
        self.init_size = int(init_size)
        self.kv_creator = kv_creator or HashTableCreator()
        self._initializer = Initializer(name, initializer, self.value_dtype, self.dim)
        self._shards = self._create_shards()
        self._companions: dict[str, Variable] = {}
        object.__setattr__(self, "_wrappers", {})  # per-batch rows: never checkpointed
        object.__setattr__(self, "_lock", threading.RLock())  # shared with the companions
        #: What the last committed checkpoint of this variable was (owned by the saver;
        #: None: the next save is a full one).
        object.__setattr__(self, "change_base", None)
        self.restrict_policy = restrict_policy(self) if restrict_policy is not None else None

    @property
    def name(self) -> str:
        """The full (name-scoped) name given to :func:`get_variable`."""
        return self._full_name

    @property
    def shards(self) -> list[TableCore]:
        """The table cores, one per entry of ``devices``."""
        return list(self._shards)

    def save_to_file_system(
        self,
        dirpath: str | Backend,
        proc_size: int = 1,
        proc_rank: int = 0,
        file_name_list: Any = None,
        dirpath_env: str = "TFRA_SAVED_KV",
        append_to_file: bool = False,
        buffer_size: int = 4194304,
    ) -> list[str]:
        """Write the tables in TFRA 0.8's file layout under ``dirpath`` (any fsspec URL or
        a Backend; the environment variable ``dirpath_env`` overrides it, as in TFRA); the
        paths written. TFRA's own ``load_from_file_system`` reads them back. The save
        replaces the previous one of this rank as a whole: killed at any point, it leaves
        the previous save or the new one (see :mod:`de_store.formats.tfra`)."""
        del file_name_list, append_to_file, buffer_size
        from de_store import _tfra_files

        return _tfra_files.save(
            self, _tfra_files.folder(dirpath, dirpath_env), proc_size, proc_rank
        )

    def load_from_file_system(
        self,
        dirpath: str | Backend,
        proc_size: int = 1,
        proc_rank: int = 0,
        file_name_list: Any = None,
        dirpath_env: str = "TFRA_SAVED_KV",
        load_entire_dir: bool = False,
        buffer_size: int = 4194304,
    ) -> None:
        """Upsert the keys of this variable's TFRA files under ``dirpath``: every table and
        rank (TFRA's ``load_entire_dir``), into this variable's own sharding."""
        del proc_size, proc_rank, file_name_list, load_entire_dir, buffer_size
        from de_store import _tfra_files

        _tfra_files.load(self, _tfra_files.folder(dirpath, dirpath_env))

    @property
    def trainable_store(self) -> dict[str, Any]:
        """The trainable wrappers of this variable's lookups, by lookup name (TFRA's)."""
        return dict(self._wrappers)

    def get_trainable_by_name(self, name: str) -> Any:
        """The trainable wrapper of the lookups called ``name``, or ``None`` (TFRA's)."""
        return self._wrappers.get(name)

    def get_slot_variables(self, optimizer: Any) -> list[Variable]:
        """The companion Variables holding ``optimizer``'s slots for this variable, by
        column name: columns are named ``{optimizer class}_{slot}`` (``adam_m``,
        ``rmsprop_velocity``); empty if ``optimizer`` has not trained it."""
        prefix = type(optimizer).__name__.removesuffix("Optimizer").lower() + "_"
        return [c for column, c in sorted(self._companions.items()) if column.startswith(prefix)]

    @property
    def trainable_variables(self) -> tuple[tf.Variable, ...]:
        """The dense per-batch rows of every ``embedding_lookup`` on this variable."""
        if not self.trainable:
            return ()
        return tuple(wrapper.rows for wrapper in self._wrappers.values())

    def _create_shards(self) -> list[TableCore]:
        shards = []
        count = len(self.devices)
        for index, device in enumerate(self.devices):
            with tf.init_scope(), tf.device(device):
                shards.append(
                    self.kv_creator.create(
                        self.key_dtype,
                        self.value_dtype,
                        self.dim,
                        name=f"{self.name}/shard_{index}_of_{count}",
                        init_size=self.init_size // count,
                    )
                )
        return shards

    # ---- key handling -------------------------------------------------------------------
    def _flat_keys(self, keys: Any) -> tf.Tensor:
        return tf.reshape(self._keys(keys), [-1])

    def _keys(self, keys: Any) -> tf.Tensor:
        return checked_keys(self.name, self.key_dtype, keys)

    def _rows(self, values: Any, what: str = "values") -> tf.Tensor:
        return checked_rows(self.name, self.value_dtype, self.dim, values, what)

    def partition(self, keys: Any) -> list[tuple[tf.Tensor, tf.Tensor]]:
        """Split ``keys`` by shard: one ``(shard_keys, positions_in_keys)`` per shard."""
        flat = self._flat_keys(keys)
        if len(self._shards) == 1:
            return [(flat, tf.range(tf.size(flat, out_type=tf.int32)))]
        shard_ids = self.partitioner(flat, len(self._shards))
        return split_by_shard(flat, shard_ids, len(self._shards))

    def _for_shard(self, rows: tf.Tensor, positions: tf.Tensor) -> tf.Tensor:
        """The rows of one shard's keys (all of them, uncopied, with a single shard)."""
        return rows if len(self._shards) == 1 else tf.gather(rows, positions)

    def _stitch(self, positions: list[tf.Tensor], parts: list[tf.Tensor]) -> tf.Tensor:
        return parts[0] if len(parts) == 1 else stitch_shards(positions, parts)

    # ---- table operations ---------------------------------------------------------------
    def lookup(self, keys: Any, return_exists: bool = False) -> Any:
        """Return the rows of ``keys`` (shape ``keys.shape + [dim]``).

        Missing keys get the initializer's rows; with ``return_exists`` the result is
        ``(values, exists)`` where ``exists`` has the shape of ``keys``.
        """
        keys = self._keys(keys)
        flat = tf.reshape(keys, [-1])
        values, exists = self._lookup_flat(flat)
        out_shape = tf.concat([tf.shape(keys), [self.dim]], axis=0)
        values = tf.reshape(values, out_shape)
        if return_exists:
            return values, tf.reshape(exists, tf.shape(keys))
        return values

    @holding_lock
    def _lookup_flat(self, flat: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        default = self._initializer.constant_default()
        positions, values, exists = [], [], []
        for shard, device, (shard_keys, shard_pos) in zip(
            self._shards, self.devices, self.partition(flat), strict=True
        ):
            with on_device(device):
                shard_values, shard_exists = shard.lookup(shard_keys, default)
            positions.append(shard_pos)
            values.append(shard_values)
            exists.append(shard_exists)
        merged = self._stitch(positions, values)
        found = self._stitch(positions, exists)
        if default is None:
            fresh = self._initializer.rows(tf.size(flat))
            merged = tf.where(found[:, None], merged, fresh)
        return merged, found

    @holding_lock
    def upsert(self, keys: Any, values: Any) -> Any:
        """Insert or overwrite the rows of ``keys`` (in a graph: returns the op)."""
        values = self._rows(values)
        ops: list[Any] = []
        for shard, device, (shard_keys, shard_pos) in zip(
            self._shards, self.devices, self.partition(keys), strict=True
        ):
            with on_device(device):
                ops.append(shard.insert(shard_keys, self._for_shard(values, shard_pos)))
        return grouped(ops)

    @holding_lock
    def load_distinct(self, keys: Any, values: Any, shard: int | None = None) -> None:
        """Bulk-insert keys absent from every shard and distinct (a restore's rows); see
        ``TableCore.load_distinct``. On ``RepeatedKeysError`` clear the variable.

        With ``shard``, every key belongs to that table shard (the caller computed where
        the partitioner sends them) and the rows go there unsplit.
        """
        values = self._rows(values)
        if shard is not None:
            with tf.device(self.devices[shard]):
                self._shards[shard].load_distinct(self._flat_keys(keys), values)
            return
        for shard, device, (shard_keys, shard_pos) in zip(
            self._shards, self.devices, self.partition(keys), strict=True
        ):
            with on_device(device):
                shard.load_distinct(shard_keys, self._for_shard(values, shard_pos))

    def accum(
        self,
        keys: Any,
        deltas: Any = None,
        insert_missing: Any = True,
        *tfra_exists: Any,
        old_values: Any = None,
        new_values: Any = None,
        exists: Any = None,
        name: str | None = None,
    ) -> Any:
        """Add ``deltas`` to the rows of ``keys`` (duplicates sum); see ``TableCore.accum``.

        TFRA's form ``accum(keys, old_values, new_values, exists)`` (positional or by
        keyword) adds ``new_values - old_values`` to the keys that ``exists`` says were
        present (if they still are), and inserts ``new_values`` for the others that are
        still absent: the update of ``bp_v2`` training, as TFRA's kernel does it.
        """
        del name
        if tfra_exists or new_values is not None or exists is not None:
            old = deltas if old_values is None else old_values
            new = insert_missing if new_values is None else new_values
            existed = tfra_exists[0] if tfra_exists else exists
            return self._accum_trained(keys, old, new, existed)
        return self._accum_deltas(keys, deltas, bool(insert_missing))

    @holding_lock
    def _accum_deltas(self, keys: Any, deltas: Any, insert_missing: bool) -> Any:
        deltas = self._rows(deltas, what="deltas")
        ops: list[Any] = []
        for shard, device, (shard_keys, shard_pos) in zip(
            self._shards, self.devices, self.partition(keys), strict=True
        ):
            with on_device(device):
                ops.append(
                    shard.accum(shard_keys, self._for_shard(deltas, shard_pos), insert_missing)
                )
        return grouped(ops)

    @holding_lock
    def _accum_trained(self, keys: Any, old: Any, new: Any, existed: Any) -> Any:
        keys = self._flat_keys(keys)
        old, new = self._rows(old, "old_values"), self._rows(new, "new_values")
        existed = tf.reshape(tf.convert_to_tensor(existed, tf.bool), [-1])
        inserted = self._insert_absent(keys, new, tf.logical_not(existed))
        with tf.control_dependencies(after(inserted)):
            return self._accum_deltas(
                tf.boolean_mask(keys, existed), tf.boolean_mask(new - old, existed), False
            )

    @holding_lock
    def write_back(
        self, keys: tf.Tensor, old: tf.Tensor, new: tf.Tensor, existed: tf.Tensor
    ) -> Any:
        """Store trained rows: overwrite them, or with ``bp_v2`` add ``new - old``.

        With ``bp_v2`` concurrent updates of existing keys all land. A key that was missing
        when ``old`` was read is first inserted with ``old`` unless another writer inserted
        it meanwhile (two writers inserting the same new key at once can still race).
        """
        if not self.bp_v2:
            return self.upsert(keys, new)
        inserted = self._insert_absent(keys, old, tf.logical_not(existed))
        with tf.control_dependencies(after(inserted)):
            return self.accum(keys, new - old, True)

    def _insert_absent(self, keys: tf.Tensor, rows: tf.Tensor, candidates: tf.Tensor) -> Any:
        """Insert the ``rows`` of the ``candidates`` among ``keys`` that are absent now (not
        inserted by another writer since they were read); the op, in a graph."""
        keys, rows = tf.boolean_mask(keys, candidates), tf.boolean_mask(rows, candidates)
        _, present = self._lookup_flat(keys)
        absent = tf.logical_not(present)
        return self.upsert(tf.boolean_mask(keys, absent), tf.boolean_mask(rows, absent))

    @holding_lock
    def remove(self, keys: Any) -> Any:
        """Remove ``keys`` from the values and from every companion; missing keys are ignored."""
        ops: list[Any] = []
        for shard, device, (shard_keys, _) in zip(
            self._shards, self.devices, self.partition(keys), strict=True
        ):
            with on_device(device):
                ops.append(shard.remove(shard_keys))
        ops += [companion.remove(keys) for companion in self._companions.values()]
        return grouped(ops)

    def reserve(self, count: int) -> None:
        """Make room for ``count`` more keys, eagerly: every shard, and every companion's
        (optimizer slots), grows once for its share.

        Tables on parameter servers keep fixed shapes and grow only outside steps (see
        ``HashTable`` *Fixed shapes*). Under a ``ClusterCoordinator`` the chief grows them
        between the steps it schedules (``de_store.tables._ps_growth``); ``reserve``
        sizes them ahead, for keys that are known to come (with no step in flight: call
        it before scheduling, or after the coordinator's ``join``).
        """
        if not tf.executing_eagerly():
            raise VariableError(
                f"variable {self.name!r}: reserve grows tables eagerly; it was called "
                "inside a tf.function or a graph"
            )
        for variable in (self, *self._companions.values()):
            reserve_shards(variable, count)

    @holding_lock
    def size(self, index: int | None = None, name: str | None = None) -> tf.Tensor:
        """Number of keys over all shards, or in shard ``index`` (int64 scalar)."""
        del name
        pairs = list(zip(self._shards, self.devices, strict=True))
        if index is not None:
            if not 0 <= index < len(pairs):
                raise VariableError(
                    f"variable '{self.name}': expected a table index in [0, {len(pairs)}), "
                    f"got {index}"
                )
            pairs = [pairs[index]]
        sizes = []
        for shard, device in pairs:
            with on_device(device):
                sizes.append(tf.cast(shard.size(), tf.int64))
        return tf.add_n(sizes)

    @holding_lock
    def clear(self) -> Any:
        """Remove every key from the values and from every companion."""
        ops: list[Any] = []
        for shard, device in zip(self._shards, self.devices, strict=True):
            with on_device(device):
                ops.append(shard.clear())
        ops += [companion.clear() for companion in self._companions.values()]
        object.__setattr__(self, "change_base", None)  # no history: the next save is full
        return grouped(ops)

    @holding_lock
    def export(self) -> tuple[tf.Tensor, tf.Tensor]:
        """Return ``(keys [n], values [n, dim])`` over all shards."""
        keys, values = [], []
        for shard, device in zip(self._shards, self.devices, strict=True):
            with on_device(device):
                shard_keys, shard_values = shard.export_all()
            keys.append(shard_keys)
            values.append(shard_values)
        return tf.concat(keys, axis=0), tf.concat(values, axis=0)

    def exclusive(self) -> threading.RLock:
        """The Variable's lock, to hold over several calls: ``with var.exclusive(): ...``.

        Shared with the companions and reentrant; eager calls of every method take it. It
        is taken before any table mutex and never while one is held, so holding it cannot
        deadlock with running graphs. A graph does not take it: a ``tf.function`` running
        meanwhile still changes the tables, one whole call at a time.
        """
        return self._lock  # type: ignore[no-any-return]

    # ---- companions and restriction -----------------------------------------------------
    def companions(self) -> dict[str, Variable]:
        """Companion tables by column name (``"adam_m"``, ``"timestamp"``, ...)."""
        return dict(self._companions)

    @holding_lock
    def companion(
        self, column: str, dim: int, value_dtype: tf.DType, initializer: Any = None
    ) -> Variable:
        """Get or create the companion table ``column`` (same keys, devices, partitioner)."""
        existing = self._companions.get(column)
        if existing is not None:
            if initializer is not None:  # e.g. a slot restored before its optimizer asked
                existing._initializer = Initializer(
                    existing.name, initializer, existing.value_dtype, existing.dim
                )
            return existing
        with tf.init_scope():
            created = Variable(
                f"{self.name}/{column}",
                key_dtype=self.key_dtype,
                value_dtype=value_dtype,
                dim=dim,
                devices=self.devices,
                partitioner=self.partitioner,
                initializer=initializer,
                trainable=False,
                checkpoint=self.checkpoint,
                init_size=self.init_size,
                kv_creator=self.kv_creator,
                bp_v2=self.bp_v2,
            )
            if self._tracks_changes() and tf.executing_eagerly():  # rows changed from now
                epoch = max(table.change_epoch() for table in self._shards)
                for table in created.all_tables():
                    table.set_change_epoch(epoch)
        object.__setattr__(created, "_lock", self._lock)
        self._companions[column] = created
        return created

    # ---- change tracking ----------------------------------------------------------------
    @property
    def tables(self) -> list[TableCore]:
        """TFRA's name for :attr:`shards`."""
        return self.shards

    def all_tables(self) -> list[TableCore]:
        """Every table core of this variable and of its companions."""
        tables = list(self._shards)
        for companion in self._companions.values():
            tables += companion.all_tables()
        return tables

    def _tracks_changes(self) -> bool:
        return all(table.track_changes for table in self._shards)

    @holding_lock
    def next_change_epoch(self) -> int:
        """Take a snapshot mark: return the current change epoch (the newest stamp of every
        row written so far) and move every table of the variable to the next one, so that
        later writes are told apart (see ``TableCore.export_changes``). Eager only."""
        tables = self.all_tables()
        if not all(table.track_changes for table in tables):
            raise VariableError(
                f"variable '{self.name}': its tables do not track changes "
                "(HashTableCreator(track_changes=False))"
            )
        mark = max(table.change_epoch() for table in tables)
        for table in tables:
            table.set_change_epoch(mark + 1)
        return mark

    @holding_lock
    def restrict(self, num_reserved: int, trigger: int | None = None) -> None:
        """Keep the ``num_reserved`` keys the restrict policy ranks first when the size
        exceeds ``trigger`` (default ``num_reserved``); see ``de_store.restrict``."""
        if self.restrict_policy is None:
            raise VariableError(
                f"variable '{self.name}': restrict() needs a restrict_policy, got None"
            )
        self.restrict_policy.apply_restriction(num_reserved, trigger)

    @property
    def saver(self) -> Any:
        """The saver given through ``kv_creator`` (None: TF's own bundle holds the tables)."""
        return self.kv_creator.saver

    def _trackable_children(self, save_type: Any = "checkpoint", **kwargs: Any) -> Any:
        # With a saver the tables go through it (de_store.saver.tf_hook), not TF's bundle.
        if not self.checkpoint or (self.saver is not None and save_type == "checkpoint"):
            return {}
        children = super()._trackable_children(save_type, **kwargs)
        if save_type == "savedmodel":  # a served function may look up through a wrapper
            children.update({f"lookup_{n}": w for n, w in self._wrappers.items()})
        return children

    @tf.autograph.experimental.do_not_convert
    def _copy_trackable_to_cpu(self, object_map: Any) -> None:
        tf_hook.copy_to_cpu(self, object_map)


# tf.train.Checkpoint saves the Variables that have a FileSystemSaver through tf_hook.
tf_hook.CheckpointedVariable.register(Variable)


def get_variable(
    name: str,
    key_dtype: tf.DType = tf.int64,
    value_dtype: tf.DType = tf.float32,
    dim: int = 1,
    devices: str | Sequence[str] | None = None,
    partitioner: Partitioner = default_partition_fn,
    shared_name: str = "get_variable",
    initializer: Any = None,
    trainable: bool = True,
    checkpoint: bool = True,
    init_size: int = 0,
    kv_creator: HashTableCreator | None = None,
    restrict_policy: Callable[[Variable], Any] | None = None,
    bp_v2: bool = False,
    short_file_name: bool = False,
) -> Variable:
    """Get the :class:`Variable` called ``name`` in the current variable scope, or create it.

    As TFRA's ``dynamic_embedding.get_variable``: the name is prefixed by the enclosing
    ``tf.compat.v1.variable_scope`` names (not by ``tf.name_scope``; not at all with
    ``short_file_name``), and variables are kept per graph, so a new ``tf.Graph`` starts
    without any. A second call with the same name returns the same Variable while it is
    alive, unless the variable scope says ``reuse=False`` (in a graph, the default), which
    raises ``ValueError``; eager code always reuses. A call that disagrees on ``dim``,
    ``key_dtype`` or ``value_dtype`` raises ``VariableError``. Arguments follow TFRA: one
    table shard per entry of ``devices``, ``partitioner(keys, shard_num)`` picks the shard,
    ``initializer`` (number, ``[1]`` or ``[dim]`` array, or callable ``(shape, dtype)``)
    fills missing keys, ``init_size`` is split across shards, ``checkpoint=False`` leaves
    the Variable out of checkpoints, ``restrict_policy`` is a policy class instantiated with
    the Variable, and ``bp_v2`` makes optimizers add deltas instead of writing values.
    """
    full_name = scoped_name(name, short_file_name)
    existing: Variable | None = existing_variable(full_name, key_dtype, value_dtype, dim)
    if existing is not None:
        return existing
    with tf.init_scope():
        created = Variable(
            full_name, key_dtype, value_dtype, dim, devices, partitioner, shared_name,
            initializer, trainable, checkpoint, init_size, kv_creator, restrict_policy, bp_v2,
            short_file_name,
        )  # fmt: skip
    register(full_name, created)
    return created
