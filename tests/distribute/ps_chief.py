"""The chief of a ParameterServerStrategy cluster (tests/distribute/test_ps.py).

``ps_chief.py train CKPT_DIR OUT STEPS``: a de_store Variable spread over every PS task,
trained by steps that ``ClusterCoordinator.schedule`` runs on the workers (Adagrad through
``apply_row_gradients``), saved by ``CheckpointManager`` from this process.
``ps_chief.py restore CKPT_DIR OUT``: the latest checkpoint restored into a Variable spread
over every PS task of this cluster. Both write the Variable's and its slot's content (and
the losses, the rows per PS task) to OUT as JSON.
"""

from __future__ import annotations

import json
import sys

import tensorflow as tf

import de_store as ds
from de_store.optimizers import Adagrad

FIELDS, BATCH, ID_SPACE, DIM = 4, 64, 300, 4
LEARNING_RATE = 0.2
FAR = 10_000
FAR_STEPS = 48  # their new keys outnumber the room the tables have after the training


def batch(step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """The ids and targets of step ``step``: the same on every run."""
    seed = tf.stack([tf.cast(step, tf.int64), tf.constant(7, tf.int64)])
    # steps from FAR on draw new ids from a wide range (the growth test)
    maxval = tf.where(step >= FAR, tf.constant(10**9, tf.int64), ID_SPACE)
    ids = tf.random.stateless_uniform([BATCH, FIELDS], seed=seed, maxval=maxval, dtype=tf.int64)
    target = tf.reduce_sum(tf.sin(tf.cast(ids, tf.float32)), axis=1)
    return ids, target


def make_step(emb: ds.Variable, optimizer: Adagrad) -> tf.types.experimental.PolymorphicFunction:
    """One training step: the loss of batch ``number`` before its update."""

    @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
    def step(number: tf.Tensor) -> tf.Tensor:
        ids, target = batch(number)
        with tf.GradientTape() as tape:
            rows = emb.lookup(ids)
            tape.watch(rows)
            loss = tf.reduce_mean(tf.square(tf.reduce_sum(rows, [1, 2]) - target))
        optimizer.apply_row_gradients([(tape.gradient(loss, rows), ids, emb)])
        return loss

    return step


def build(strategy: tf.distribute.Strategy) -> ds.Variable:
    devices = [f"/job:ps/task:{i}" for i in range(strategy.extended._num_ps)]
    with strategy.scope():
        return ds.get_variable(
            "emb",
            dim=DIM,
            devices=devices,
            initializer=0.0,
            init_size=ID_SPACE,  # every id of the training steps fits, no more
            bp_v2=True,  # workers' updates of one key add up (an overwrite would lose some)
            kv_creator=ds.HashTableCreator(saver=ds.FileSystemSaver()),
        )


def content(variable: ds.Variable) -> dict[str, list[float]]:
    keys, values = variable.export()
    return {str(k): v for k, v in zip(keys.numpy().tolist(), values.numpy().tolist(), strict=True)}


def report(variable: ds.Variable, **extra: object) -> dict[str, object]:
    slots = {name: content(c) for name, c in variable.companions().items()}
    per_task = [int(shard.size()) for shard in variable.shards]
    devices = [shard.index.device for shard in variable.shards]
    return {
        "values": content(variable),
        "slots": slots,
        "per_task": per_task,
        "devices": devices,
        **extra,
    }


def room(shard: object) -> int:
    """The new keys a PS table shard has room for as it is (no key removed)."""
    held = int(shard.size())
    rows = int(shard.values.shape[0])
    return min(int(shard.capacity() * shard.max_load_factor), rows) - held


def grow_between_steps(coordinator: object, emb: ds.Variable, step: object) -> dict:
    """Steps whose new keys outnumber the room the PS tables have all run, with no call
    from here: de_store's hook on ``coordinator.schedule`` grows the tables between them.
    ``reserve`` still makes room ahead of time."""
    numbers = [tf.constant(FAR + i, tf.int64) for i in range(FAR_STEPS)]
    new = {int(k) for number in numbers for k in batch(number)[0].numpy().ravel()}
    before = {"size": int(emb.size()), "room": sum(room(s) for s in emb.shards)}
    before["rows"] = sum(int(s.values.shape[0]) for s in emb.shards)
    losses = [coordinator.schedule(step, args=(number,)) for number in numbers]
    coordinator.join()
    rows = sum(int(s.values.shape[0]) for s in emb.shards)
    emb.reserve(2 * rows)  # room for that many more keys, before the steps that bring them
    return {
        "far_new_keys": len(new),
        "far_losses": [float(loss.fetch()) for loss in losses],
        "before_far": before,
        "size_after_far": int(emb.size()),
        "rows_after_far": rows,
        "rows_after_reserve": sum(int(s.values.shape[0]) for s in emb.shards),
    }


def tfra_idiom(strategy: tf.distribute.Strategy, coordinator: object) -> dict:
    """TFRA's training idiom under Keras 3 on every worker: ``embedding_lookup(...,
    return_trainable=True)``, ``tape.gradient`` on the wrapper,
    ``DynamicEmbeddingOptimizer(keras.optimizers.Adam)``; and the error the step of a
    ``tf.compat.v1`` optimizer raises (tests/distribute/ps_tfra_chief.py)."""
    import ps_tfra_chief as tfra

    devices = [f"/job:ps/task:{i}" for i in range(strategy.extended._num_ps)]
    with strategy.scope():
        emb = tfra.variables(["adam"], devices, "tfra_")[0]
        optimizer = ds.DynamicEmbeddingOptimizer(tfra.optimizers()["adam"]())
    step = tfra.make_step([(emb, optimizer)])
    losses = [coordinator.schedule(step, args=(tf.constant(i, tf.int64),)) for i in range(12)]
    coordinator.join()
    return {
        "losses": [float(loss.fetch()[0]) for loss in losses],
        "size": int(emb.size()),
        "slots": sorted(emb.companions()),
        "refused": tfra.refusals(strategy, coordinator, devices),
    }


def main() -> None:
    mode, directory, out = sys.argv[1:4]
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    emb = build(strategy)
    if mode == "train":
        with strategy.scope():
            optimizer = Adagrad(learning_rate=LEARNING_RATE)

        step = make_step(emb, optimizer)
        losses = [
            coordinator.schedule(step, args=(tf.constant(i, tf.int64),))
            for i in range(int(sys.argv[4]))
        ]
        coordinator.join()
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(emb=emb), directory, max_to_keep=2)
        saved = manager.save()
        result = report(emb, losses=[float(x.fetch()) for x in losses], saved=saved)
        result.update(grow_between_steps(coordinator, emb, step))
        result["tfra"] = tfra_idiom(strategy, coordinator)
    else:
        checkpoint = tf.train.Checkpoint(emb=emb)
        checkpoint.restore(tf.train.latest_checkpoint(directory)).expect_partial()
        result = report(emb)
    with open(out, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
