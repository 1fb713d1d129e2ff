"""What a growth of the PS tables costs the steps a ClusterCoordinator runs.

Starts a local cluster (``--ps`` parameter-server tasks and ``--workers`` workers, each a
``tf.distribute.Server`` process on a free port; this process is the chief) and trains
de_store Variables spread over the PS tasks with Adagrad (``apply_row_gradients``), in a
plain loop of ``coordinator.schedule(step, ...)``. Every step looks up ``--batch`` ids,
``--new`` of them never seen before. A thread fetches each step's loss as it finishes, so
every step's completion time is known.

1. *Steady state*: a Variable created with room for every key it gets (no growth), its
   steps scheduled past de_store's hook (``ClusterCoordinator.schedule`` as TensorFlow
   defines it), then through the hook: steps per second of each, and so what the hook
   costs a step.
2. *Growth*: a Variable created with ``--init-size``, whose tables the hook grows between
   the steps. For each growth (all the tables grown at one ``join``): the keys held, the
   time the chief waited for the steps in flight, the time the growth itself took, and
   the stall: the gap between the last step finished before it and the first one after,
   less the steady time of a step. The first step after a growth runs the step function
   on variables of new shapes, which TensorFlow instantiates again on the worker and the
   PS tasks: most of the stall.
3. The hook's reading of the tables' load (:func:`de_store.tables._fixed_growth.read_loads`,
   one function call per PS task), timed alone.

Usage::

    python benchmarks/ps_growth_bench.py --ps 2 --workers 1 --steps 300

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import threading
import time

from _cluster import chief_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1024, help="ids a step looks up")
    parser.add_argument("--new", type=int, default=256, help="of them, never seen before")
    parser.add_argument("--steps", type=int, default=300, help="steps of each phase")
    parser.add_argument("--init-size", type=int, default=4096)
    args = parser.parse_args()
    with chief_of(args.workers, args.ps):
        print(json.dumps(_measure(args)))


def _measure(args: argparse.Namespace) -> dict[str, object]:
    import tensorflow as tf

    from de_store.tables import _demand, _fixed_growth, _ps_growth

    growths = _GrowthLog()
    logging.getLogger("de_store").addHandler(growths)
    logging.getLogger("de_store").setLevel(logging.INFO)
    strategy = tf.distribute.ParameterServerStrategy(
        tf.distribute.cluster_resolver.TFConfigClusterResolver()
    )
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    # room for every key, and for the hook's window of steps past them: no growth
    window = (_ps_growth.WINDOW_STEPS + 1) * 2 * args.batch  # a step's bound: 2 calls a table
    keys = args.new * (2 * args.steps + 1) + args.ps * window
    steady = _Trainer(strategy, args, "steady", init_size=keys)
    steady.run(coordinator, 0, 1, hooked=True)  # instantiates the step function
    rates: dict[bool, list[float]] = {False: [], True: []}
    block, number = max(args.steps // 4, 2), 1
    for hooked in (False, True) * 4:  # blocks in turn: the machine's load hits both alike
        finished = steady.run(coordinator, number, block, hooked=hooked)
        rates[hooked].append(_rate(finished))
        number += block
    step_s = 1 / statistics.median(rates[True])
    steady_growths = len(growths.events)
    growing = _Trainer(strategy, args, "growing", init_size=args.init_size)
    growing.run(coordinator, 0, 1, hooked=True)
    growths.events.clear()
    times = growing.run(coordinator, 1, args.steps, hooked=True)
    tables = _demand.live()
    _fixed_growth.read_loads(tables)  # traced once
    started = time.perf_counter()
    for _ in range(20):
        _fixed_growth.read_loads(tables)
    read_ms = (time.perf_counter() - started) / 20 * 1000
    result = {
        "ps_tasks": args.ps, "workers": args.workers, "dim": args.dim,
        "batch": args.batch, "new_per_step": args.new, "steps": args.steps,
        "init_size": args.init_size, "window_steps": _ps_growth.WINDOW_STEPS,
        "steady_steps_per_s_past_hook": round(statistics.median(rates[False]), 1),
        "steady_steps_per_s": round(statistics.median(rates[True]), 1),
        "load_read_ms": round(read_ms, 2), "tables_read": len(tables),
        "final_keys": int(growing.emb.size()),
        "steady_growths": steady_growths,
        "steady_blocks_past_hook": [round(r, 1) for r in rates[False]],
        "steady_blocks": [round(r, 1) for r in rates[True]],
        "growths": _growth_figures(growths.events, times, step_s),
    }  # fmt: skip
    _print(result)
    return result


class _Trainer:
    """A Variable on every PS task, trained by one step function."""

    def __init__(self, strategy: object, args: argparse.Namespace, name: str, init_size: int):
        import tensorflow as tf

        import de_store as ds
        from de_store.optimizers import Adagrad

        devices = [f"/job:ps/task:{i}" for i in range(args.ps)]
        with strategy.scope():  # type: ignore[attr-defined]
            self.emb = ds.get_variable(
                name, dim=args.dim, devices=devices, init_size=init_size, bp_v2=True
            )
            optimizer = Adagrad(learning_rate=0.05)
        emb, batch, new = self.emb, args.batch, args.new

        @tf.function(input_signature=[tf.TensorSpec([], tf.int64)])
        def step(number: tf.Tensor) -> tf.Tensor:
            fresh = number * new + tf.range(new, dtype=tf.int64)
            seed = tf.stack([number, tf.constant(7, tf.int64)])
            limit = tf.maximum(number * new, 1)
            seen = tf.random.stateless_uniform([batch - new], seed, 0, limit, tf.int64)
            ids = tf.concat([fresh, seen], 0)
            with tf.GradientTape() as tape:
                rows = emb.lookup(ids)
                tape.watch(rows)
                loss = tf.reduce_sum(rows)
            optimizer.apply_row_gradients([(tape.gradient(loss, rows), ids, emb)])
            return loss

        self.step = step

    def run(self, coordinator: object, first: int, count: int, hooked: bool) -> list[float]:
        """Schedule steps ``first`` to ``first + count - 1`` and wait for them: the time
        each finished (``perf_counter``)."""
        import tensorflow as tf

        from de_store.tables import _ps_growth

        # past the hook: ClusterCoordinator.schedule as TensorFlow defines it
        past = functools.partial(_ps_growth._schedule, coordinator)
        schedule = coordinator.schedule if hooked else past  # type: ignore[attr-defined]
        finished: list[float] = []
        values: list[object] = []
        ready = threading.Semaphore(0)

        def fetch() -> None:
            for _ in range(count):
                ready.acquire()
                values[len(finished)].fetch()  # type: ignore[attr-defined]
                finished.append(time.perf_counter())

        fetcher = threading.Thread(target=fetch)
        fetcher.start()
        for number in range(first, first + count):
            values.append(schedule(self.step, args=(tf.constant(number, tf.int64),)))
            ready.release()
        coordinator.join()  # type: ignore[attr-defined]
        fetcher.join()
        return finished


class _GrowthLog(logging.Handler):
    """The ``grew table`` lines, with the time each was logged."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.events: list[tuple[float, str, tuple]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("grew table"):
            self.events.append((time.perf_counter(), record.getMessage(), record.args))


def _growth_figures(events: list, finished: list[float], step_s: float) -> list[dict]:
    """One entry per growth (the tables grown at one join): what each cost the steps."""
    figures: list[dict] = []
    for logged, _, fields in events:
        # the message's fields: table, device, keys, removals, index from, to, rows from,
        # to, keys held, seconds growing, seconds waiting for the steps in flight
        grow_s, wait_s = float(fields[9]), float(fields[10])
        before = [t for t in finished if t <= logged]
        after = [t for t in finished if t > logged]
        if figures and figures[-1]["_last"] == len(before):  # another table, same join
            figures[-1]["tables"] += 1
            figures[-1]["grow_s"] = round(figures[-1]["grow_s"] + grow_s, 3)
            continue
        if not before or not after:
            continue
        gap = after[0] - before[-1]
        window = [t for t in finished if before[-1] - 5 * step_s <= t <= after[0] + 5 * step_s]
        figures.append({
            "_last": len(before), "tables": 1, "keys_held": int(fields[8]),
            "index_from": int(fields[4]), "index_to": int(fields[5]),
            "wait_s": round(wait_s, 3), "grow_s": round(grow_s, 3),
            "stall_s": round(gap - step_s, 3),
            "steps_per_s_around": round((len(window) - 1) / (window[-1] - window[0]), 1),
        })  # fmt: skip
    for figure in figures:
        del figure["_last"]
    return figures


def _rate(finished: list[float]) -> float:
    return (len(finished) - 1) / (finished[-1] - finished[0])


def _print(result: dict) -> None:
    print(
        f"{result['ps_tasks']} PS tasks, {result['workers']} worker(s), dim {result['dim']}, "
        f"{result['batch']} ids a step ({result['new_per_step']} new)"
    )
    print(f"steady state, past the hook:    {result['steady_steps_per_s_past_hook']} steps/s")
    print(f"steady state, through the hook: {result['steady_steps_per_s']} steps/s")
    print(f"load reading of {result['tables_read']} tables: {result['load_read_ms']} ms")
    for g in result["growths"]:
        print(
            f"growth at {g['keys_held']:,} keys a table ({g['tables']} tables, index "
            f"{g['index_from']:,} -> {g['index_to']:,}): waited {g['wait_s']} s for the steps "
            f"in flight, grew in {g['grow_s']} s, stall {g['stall_s']} s, "
            f"{g['steps_per_s_around']} steps/s around it"
        )


if __name__ == "__main__":
    main()
