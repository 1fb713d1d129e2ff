"""What importing de_store's modules loads, and which modules import each other.

``convert`` and ``compact`` rewrite checkpoints in numpy and pyarrow: they must work where
TensorFlow is slow to load or absent. pytest is a test extra: importing de_store, or its
test helpers other than the suites, must not need it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

import de_store as ds
from de_store.testing.tfra_sample import tfra_sample

ROOT = Path(__file__).resolve().parents[1]
#: Where each package's modules live (de_store.backends and .formats sit at the top).
PACKAGES = {"de_store": "de_store", "de_store.backends": "backends", "de_store.formats": "formats"}

SCRIPT = """
import json, sys
for module in sys.argv[2:]:
    __import__(module)
from de_store.cli import main
codes = [main(argv) for argv in json.loads(sys.argv[1])]
print(json.dumps([codes, sorted(m for m in ("tensorflow", "pytest") if m in sys.modules)]))
"""


def run_fresh(commands: list[list[str]], *modules: str) -> tuple[list[int], list[str]]:
    """Import ``modules`` and run the CLI ``commands`` in a new interpreter; the exit codes
    and which of tensorflow and pytest it then holds."""
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(commands), *modules],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    codes, loaded = json.loads(result.stdout.splitlines()[-1])
    return codes, loaded


def test_importing_compact_convert_and_the_test_helpers_loads_neither_tf_nor_pytest() -> None:
    modules = ["de_store", "de_store.compaction", "de_store.convert", "de_store.testing"]
    assert run_fresh([], *modules) == ([], [])


def test_the_restore_flow_and_the_memory_helpers_load_no_tensorflow() -> None:
    """The saver's restore flow imports ``de_store._memory`` for its ``malloc_trim``; it
    reads rows in numpy and imports TensorFlow on first use, so the module's allocator
    probe imports TensorFlow only when it is called."""
    assert run_fresh([], "de_store._memory", "de_store.saver.restore_flow") == ([], [])


def test_the_checkpoint_protocol_loads_no_tensorflow_and_imports_nothing_above_it() -> None:
    """``de_store.checkpoint`` (names, manifests, commit, barrier, chains, checks, gc,
    verify) needs no TensorFlow, and reaches no module of the TensorFlow side."""
    modules = module_files()
    protocol = sorted(m for m in modules if m.startswith("de_store.checkpoint"))
    assert len(protocol) > 10
    assert run_fresh([], *protocol) == ([], [])
    allowed = ("de_store.checkpoint", "de_store.backends", "de_store.formats", "de_store.errors",
               "de_store.progress")  # fmt: skip
    for name in protocol:
        above = {m for m in imported_modules(name, modules[name], modules)
                 if not m.startswith(allowed) and m != "de_store"}  # fmt: skip
        assert above == set(), name


def test_importing_a_conformance_suite_loads_pytest_only_then() -> None:
    assert run_fresh([], "de_store.testing.backend_suite") == ([], ["pytest"])


def save_chain(directory: Path) -> str:
    """A full checkpoint and a delta on it (TensorFlow is loaded here, in the test)."""
    variable = ds.Variable("emb", dim=4)
    keys = tf.range(200, dtype=tf.int64)
    variable.upsert(keys, tf.ones([200, 4]))
    ds.save([variable], str(directory / "ckpt-1"), incremental=True, blocking=True)
    variable.upsert(keys[:20], tf.fill([20, 4], 2.0))
    variable.remove(keys[-5:])
    ds.save([variable], str(directory / "ckpt-2"), incremental=True, blocking=True)
    return str(directory / "ckpt-2")


def test_convert_and_compact_run_without_tensorflow(tmp_path: Path) -> None:
    delta = save_chain(tmp_path / "run")
    tfra = tfra_sample(str(tmp_path / "tfra"), rows=50, dim=4)
    out = tmp_path / "out"
    commands = [
        ["convert", "-q", tfra, str(out / "from_tfra"), "--to", "parquet", "--dim", "4"],
        ["convert", "-q", str(out / "from_tfra"), str(out / "arrow"), "--to", "arrow"],
        ["convert", "-q", str(out / "arrow"), str(out / "TFRADynamicEmbedding"), "--to", "tfra"],
        ["convert", "-q", delta, str(out / "flat"), "--to", "binary", "--values-only"],
        ["convert", "-q", delta, str(out / "compacted")],
        ["verify", "-q", str(out / "compacted")],
    ]
    assert run_fresh(commands) == ([0] * len(commands), [])
    restored = ds.Variable("emb", dim=4)
    ds.restore([restored], str(out / "compacted"))
    keys, values = (t.numpy() for t in restored.export())
    expected = {k: 2.0 if k < 20 else 1.0 for k in range(195)}
    assert dict(zip(keys.tolist(), values[:, 0].tolist(), strict=True)) == expected
    assert np.all(values == values[:, :1])


def module_files() -> dict[str, Path]:
    """de_store's modules by dotted name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join([package, *(p for p in parts if p != "__init__")])] = path
    return found


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The de_store modules ``name`` imports anywhere (in functions and under
    TYPE_CHECKING too): the longest known prefix of each imported name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base += f".{node.module}" if node.module else ""
            targets += [f"{base}.{alias.name}" for alias in node.names]
    found = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def circles() -> list[set[str]]:
    """The sets of modules that import each other, directly or around a loop."""
    modules = module_files()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reachable = {name: reach(name) for name in graph}
    loops = {
        frozenset({name} | {m for m in reachable[name] if name in reachable[m]})
        for name in graph
        if name in reachable[name]
    }
    return [set(loop) for loop in loops]


def test_the_rewriting_and_row_modules_are_in_no_import_circle() -> None:
    mine = {
        "de_store._rewrite",
        "de_store.compaction",
        "de_store.convert",
        "de_store.saver.incremental",
        "de_store.saver.rows",
        "de_store.checkpoint.variable_rows",
    }
    assert [loop for loop in circles() if loop & mine] == []


def test_no_module_of_de_store_is_in_an_import_circle() -> None:
    """Every module, formats and backends included: a helper two modules share lives in a
    lower module (``formats._schema``, ``tables._types``); ``variable`` registers its class
    with ``saver.tf_hook`` instead of being imported by it."""
    assert circles() == []


def test_the_tf_hook_knows_variables_by_the_class_they_register() -> None:
    from de_store.saver import tf_hook

    assert isinstance(ds.Variable("hooked", dim=2), tf_hook.CheckpointedVariable)
    assert not isinstance(tf.Variable(1.0), tf_hook.CheckpointedVariable)


def test_de_store_compact_is_the_function_after_its_module_was_imported(tmp_path) -> None:
    """``de_store.compact`` is the function, also after ``import de_store.compaction``
    (the module that holds it) and ``import de_store.compact``, and ``from
    de_store.compact import compact`` finds it; it compacts when called."""
    var = ds.Variable("emb", dim=2)
    var.upsert(tf.constant([1, 2], tf.int64), tf.ones([2, 2]))
    ds.save([var], str(tmp_path / "ck"), blocking=True)
    script = (
        "import sys, de_store.compaction, de_store as ds\n"
        "from de_store.compact import compact\n"  # the path earlier docs showed
        "import de_store.compact\n"
        "assert ds.compact is compact is de_store.compaction.compact\n"
        "print(ds.compact(sys.argv[1], sys.argv[2]))\n"
    )
    src, out = str(tmp_path / "ck"), str(tmp_path / "flat")
    result = subprocess.run(
        [sys.executable, "-c", script, src, out], capture_output=True, text=True, check=False
    )
    assert (result.returncode, result.stdout.strip()) == (0, out), result.stderr[-2000:]
    restored = ds.Variable("emb", dim=2)
    ds.restore([restored], out)
    assert int(restored.size()) == 2
