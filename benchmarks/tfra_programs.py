"""TFRA's Keras 2 programs under TFRA 0.8.1 and, with the import swapped, under de_store.

Two kinds of program, each run under both libraries with ``TF_USE_LEGACY_KERAS=1`` (tf_keras):

* **TFRA's Keras demos**, as its repository holds them: ``movielens-1m-keras`` (``train``,
  ``export``, ``test``) and ``amazon-video-games-keras-eager`` (``train``, ``test``). Each
  demo folder is copied from ``--tfra-repo``; on the de_store side every
  ``from tensorflow_recommenders_addons import dynamic_embedding as de`` becomes
  ``import de_store as de``, and nothing else changes. The demos load their data with
  ``tensorflow_datasets``; this machine cannot download it, so ``benchmarks/tfds_standin``
  stands in for it (the same fields and dtypes, rows from a fixed seed: both libraries train
  on the same examples). Each run's exit status, seconds and the figures it prints (the
  last training loss and AUC or accuracy, the test's accuracy) are shown side by side. The
  demos draw their embeddings and dense weights from unseeded initializers, so two runs of
  one library differ too: their figures are compared as a user would, not digit by digit.
* **TFRA's parameter-server demo** ``movielens-1m-keras-ps``, started as its ``start.sh``
  starts it (2 PS tasks, 1 and then 2 workers, the chief training with tf_keras
  ``model.fit`` under ``ParameterServerStrategy``), import swapped likewise.
* **Idioms** (``benchmarks/_tfra_idioms.py``): small TFRA programs with fixed data and
  constant initializers, each returning arrays, compared value by value (``np.allclose``,
  ``rtol=1e-5``, ``atol=1e-6``: TensorFlow 2.16 and 2.21 may round differently).

The TFRA side runs under ``--tfra-python``, the interpreter of a virtual environment with
``tensorflow==2.16.2``, ``tensorflow-recommenders-addons==0.8.1`` and ``tf_keras==2.16.0``;
the de_store side under ``--de-store-python`` (default: this interpreter).

Usage::

    python benchmarks/tfra_programs.py --tfra-python /work/tfra_venv/bin/python \\
        --tfra-repo PATH_TO_A_TFRA_CHECKOUT

Prints a table, then one JSON line with every run and idiom.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from de_store.testing.servers import free_ports

HERE = os.path.dirname(os.path.abspath(__file__))
SIDES = ("tfra", "de_store")
SWAP = (
    "from tensorflow_recommenders_addons import dynamic_embedding as de",
    "import de_store as de",
)
DEMOS = {
    "movielens-1m-keras": [
        ("train", ["movielens-1m-keras.py", "--mode=train", "--steps_per_epoch={steps}"]),
        ("export", ["movielens-1m-keras.py", "--mode=export"]),
        ("test", ["movielens-1m-keras.py", "--mode=test", "--test_steps={test_steps}"]),
    ],
    "amazon-video-games-keras-eager": [
        ("train", ["main.py", "--mode=train", "--num_steps={steps}"]),
        ("test", ["main.py", "--mode=test", "--num_steps={test_steps}"]),
    ],
}
#: What each demo prints: the last value of each figure is kept, or for a pattern with two
#: groups (``correct/batch``), the share over every batch the run printed.
FIGURES = {
    "loss": re.compile(r"\bloss: ([0-9.]+)"),
    "auc": re.compile(r"\bauc\w*: ([0-9.]+)"),
    "accuracy": re.compile(r"\bbinary_accuracy: ([0-9.]+)"),
    "closely_accurate": re.compile(r"(\d+)/(\d+) are closely accurate"),
    "absolutely_accurate": re.compile(r"(\d+)/(\d+) are absolutely accurate"),
    "ctr": re.compile(r"ctr: (?:tf\.Tensor\()?([0-9.]+)"),
    "sparse_domain": re.compile(r"size of sparse domain: (?:tf\.Tensor\()?(\d+)"),
}


def environment() -> dict[str, str]:
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(HERE, "tfds_standin"), env.get("PYTHONPATH", "")]
    )
    return env


def copy_demo(repo: str, demo: str, side: str, workdir: str) -> str:
    """The demo's folder copied into ``workdir/side``, its import swapped on de_store's side."""
    source = os.path.join(repo, "demo", "dynamic_embedding", demo)
    target = os.path.join(workdir, side, demo)
    shutil.copytree(source, target)
    if side == "de_store":
        for name in os.listdir(target):
            if name.endswith(".py"):
                path = os.path.join(target, name)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(text.replace(*SWAP))
    return target


def figures(output: str) -> dict[str, float]:
    found = {}
    for name, pattern in FIGURES.items():
        matches = pattern.findall(output)
        if matches and pattern.groups == 2:
            right, seen = (sum(int(m[i]) for m in matches) for i in (0, 1))
            found[name] = round(right / seen, 4)
        elif matches:
            found[name] = float(matches[-1])
    return found


def run_demo(python: str, folder: str, argv: list[str], log: str) -> dict[str, Any]:
    start = time.perf_counter()
    done = subprocess.run(
        [python, *argv], cwd=folder, env=environment(), capture_output=True, text=True, timeout=1800
    )
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    with open(log, "w") as f:
        f.write(output)
    result: dict[str, Any] = {
        "rc": done.returncode,
        "seconds": round(seconds, 1),
        **figures(output),
    }
    if done.returncode:
        result["error"] = last_error(output)
    return result


def last_error(output: str) -> str:
    lines = [line for line in output.splitlines() if re.match(r"^\w*(Error|Exception)\b", line)]
    return lines[-1][:300] if lines else output.strip().splitlines()[-1][:300]


def run_demos(args: argparse.Namespace, pythons: dict[str, str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for demo, runs in DEMOS.items():
        for side in SIDES:
            folder = copy_demo(args.tfra_repo, demo, side, args.workdir)
            for name, argv in runs:
                argv = [a.format(steps=args.steps, test_steps=args.test_steps) for a in argv]
                log = os.path.join(args.workdir, f"{side}-{demo}-{name}.log")
                result = run_demo(pythons[side], folder, argv, log)
                results.setdefault(f"{demo} {name}", {})[side] = result
                print(f"{demo:32s} {name:7s} {side:9s} {describe(result)}", flush=True)
    return results


PS_DEMO = "movielens-1m-keras-ps"


def run_ps_demo(python: str, folder: str, workers: int, log: str) -> dict[str, Any]:
    """TFRA's parameter-server demo as its ``start.sh`` starts it: 2 PS tasks and
    ``workers`` workers in the background, then the chief, which trains 2 epochs of 10
    steps with ``model.fit``; every task a process on a free 127.0.0.1 port."""
    ports = [f"127.0.0.1:{port}" for port in free_ports(3 + workers)]
    flags = [f"--ps_list={','.join(ports[1:3])}", f"--worker_list={','.join(ports[3:])}"]
    flags += [f"--chief={ports[0]}"]
    command = [python, f"{PS_DEMO}.py", *flags]
    tasks = [("ps", i) for i in range(2)] + [("worker", i) for i in range(workers)]
    servers = [
        subprocess.Popen(
            [*command, f"--task_mode={job}", f"--task_id={task}"],
            cwd=folder,
            env=environment(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for job, task in tasks
    ]
    try:
        return run_demo(python, folder, [*command[1:], "--task_mode=chief"], log)
    finally:
        for server in servers:
            server.kill()
            server.wait()


def run_ps_demos(args: argparse.Namespace, pythons: dict[str, str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for side in SIDES:
        folder = copy_demo(args.tfra_repo, PS_DEMO, side, args.workdir)
        for workers in (1, 2):
            name = f"train, {workers} worker{'s' if workers > 1 else ''}"
            log = os.path.join(args.workdir, f"{side}-{PS_DEMO}-{workers}.log")
            result = run_ps_demo(pythons[side], folder, workers, log)
            results.setdefault(f"{PS_DEMO} {name}", {})[side] = result
            print(f"{PS_DEMO:32s} {name:19s} {side:9s} {describe(result)}", flush=True)
    return results


def describe(result: dict[str, Any]) -> str:
    if result["rc"]:
        return f"FAILED rc={result['rc']} in {result['seconds']} s: {result['error']}"
    shown = {k: v for k, v in result.items() if k not in ("rc", "seconds")}
    return f"ok in {result['seconds']} s " + " ".join(f"{k}={v:g}" for k, v in shown.items())


def run_idioms(args: argparse.Namespace, pythons: dict[str, str]) -> dict[str, Any]:
    outputs = {}
    for side in SIDES:
        out = os.path.join(args.workdir, f"idioms-{side}.json")
        env = dict(environment(), IDIOMS_LIBRARY=side)
        script = os.path.join(HERE, "_tfra_idioms.py")
        done = subprocess.run(
            [pythons[side], script, out], env=env, capture_output=True, text=True, timeout=1800
        )
        if done.returncode:
            raise SystemExit(
                f"the idioms failed under {side}: {last_error(done.stdout + done.stderr)}"
            )
        with open(out) as f:
            outputs[side] = json.load(f)["idioms"]
    return {
        name: compare(outputs["tfra"][name], outputs["de_store"].get(name))
        for name in outputs["tfra"]
    }


def compare(tfra: dict[str, Any], ours: dict[str, Any] | None) -> dict[str, Any]:
    """An idiom's verdict: ``same``, ``different`` (with the largest difference),
    ``tfra fails`` (TFRA 0.8.1 itself cannot run it) or ``de_store fails``."""
    if ours is None or not ours["ok"]:
        error = ours["error"] if ours else "not run"
        return {"verdict": "both fail" if not tfra["ok"] else "de_store fails", "error": error}
    if not tfra["ok"]:
        return {"verdict": "tfra fails", "error": tfra["error"]}
    if sorted(tfra["values"]) != sorted(ours["values"]):
        return {
            "verdict": "different",
            "error": f"keys {sorted(tfra['values'])} vs {sorted(ours['values'])}",
        }
    largest = 0.0
    for key, value in tfra["values"].items():
        a, b = np.asarray(value), np.asarray(ours["values"][key])
        if a.shape != b.shape:
            return {"verdict": "different", "error": f"{key}: shape {a.shape} vs {b.shape}"}
        if a.dtype.kind in "fc" or b.dtype.kind in "fc":
            if not np.allclose(a.astype(float), b.astype(float), rtol=1e-5, atol=1e-6):
                return {"verdict": "different", "error": f"{key}: max diff {np.abs(a - b).max():g}"}
            largest = max(largest, float(np.abs(a.astype(float) - b.astype(float)).max(initial=0)))
        elif not np.array_equal(a, b):
            return {"verdict": "different", "error": f"{key}: values differ"}
    return {"verdict": "same", "max_abs_diff": largest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tfra-python", required=True, help="python of a venv with TFRA 0.8.1")
    parser.add_argument("--tfra-repo", required=True, help="a TFRA checkout (holds demo/)")
    parser.add_argument("--de-store-python", default=sys.executable)
    parser.add_argument("--steps", type=int, default=300, help="training steps of each demo")
    parser.add_argument("--test-steps", type=int, default=20)
    parser.add_argument("--workdir", default=None, help="default: a new temporary folder")
    parser.add_argument(
        "--parts", default="demos,ps-demo,idioms", help="what to run, comma separated"
    )
    args = parser.parse_args()
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="tfra_programs_")
    os.makedirs(args.workdir, exist_ok=True)
    pythons = {"tfra": args.tfra_python, "de_store": args.de_store_python}
    print(f"work folder: {args.workdir}")
    parts = args.parts.split(",")
    demos = run_demos(args, pythons) if "demos" in parts else {}
    demos |= run_ps_demos(args, pythons) if "ps-demo" in parts else {}
    idioms = run_idioms(args, pythons) if "idioms" in parts else {}
    for name, verdict in idioms.items():
        detail = verdict.get("error", verdict.get("max_abs_diff", ""))
        print(f"idiom {name:40s} {verdict['verdict']:14s} {detail}")
    summary = {
        "demo_runs_ok": {s: sum(not r[s]["rc"] for r in demos.values()) for s in SIDES},
        "demo_runs": len(demos),
        "idioms": len(idioms),
        "idioms_same": sum(v["verdict"] == "same" for v in idioms.values()),
        "idioms_tfra_fails": sum(
            v["verdict"] in ("tfra fails", "both fail") for v in idioms.values()
        ),
    }
    print(" ".join(f"{k}={v}" for k, v in summary.items()))
    print(json.dumps({**summary, "demos": demos, "idiom_verdicts": idioms}))


if __name__ == "__main__":
    main()
