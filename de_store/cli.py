"""The ``de-store`` command: demo, ls, inspect, verify, convert, gc.

A thin layer over :mod:`de_store.catalog`, :mod:`de_store.checkpoint.verify`,
:mod:`de_store.convert`, :mod:`de_store.checkpoint.gc` and :mod:`de_store.demo`. Only ``demo``
imports TensorFlow (it trains a model). Errors print as one line ``de-store: error: ...``
with exit code 1 (2 for usage errors, 130 for Ctrl-C); ``--debug`` shows the traceback.
The storage server of an ``s3://``, ``gs://`` or ``http(s)://`` URL is tried once before
anything else, so that no network fails in one line instead of a minute of retries.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import select
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TypeAlias

import de_store

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: Ctrl-C, as a shell reports a command ended by SIGINT.
EXIT_INTERRUPTED = 130
#: The reader of the output went away (``de-store inspect URL | head``): 128 + SIGPIPE.
EXIT_BROKEN_PIPE = 141
#: The arguments that name a storage location, checked for a reachable server first.
_URL_ARGUMENTS = ("url", "src", "dst", "dir")


#: What ``ArgumentParser.add_subparsers`` returns, each command adding its parser to it.
_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _parser() -> argparse.ArgumentParser:
    """The ``de-store`` parser: one subparser per command, each built by its own function."""
    parser = argparse.ArgumentParser(
        prog="de-store",
        description="Inspect, verify, convert and clean de_store checkpoints.",
        epilog="Options shared by every command go after it: de-store verify --quiet URL.",
    )
    parser.add_argument("--version", action="version", version=f"de-store {de_store.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common_options()
    for add_command in (_add_demo, _add_ls, _add_inspect, _add_verify, _add_convert, _add_gc):
        add_command(sub, common)
    return parser


def _common_options() -> argparse.ArgumentParser:
    """The options every command takes (a parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    common.add_argument(
        "--debug", action="store_true", help="show the traceback of an error and every log"
    )
    common.add_argument(
        "--verbose", "-v", action="store_true", help="log each save, commit and restore (INFO)"
    )
    common.add_argument(
        "--storage-options",
        metavar="JSON",
        type=_json_object,
        default=None,
        help='fsspec options for the URLs, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'',
    )
    return common


def _add_demo(sub: _Subparsers, common: argparse.ArgumentParser) -> None:
    demo = sub.add_parser("demo", parents=[common], help="train, save async, reshard, check")
    demo.add_argument(
        "dir",
        nargs="?",
        default="de_store_demo",
        help="folder or URL to save into (default ./de_store_demo); checked before training",
    )
    demo.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    demo.add_argument("--ids", type=int, default=1_000_000, help="id space (default 1000000)")
    demo.add_argument("--save-shards", type=int, default=2, help="table shards saving (2)")
    demo.add_argument("--restore-shards", type=int, default=3, help="shards restoring (3)")


def _add_ls(sub: _Subparsers, common: argparse.ArgumentParser) -> None:
    ls = sub.add_parser("ls", parents=[common], help="checkpoints under a path")
    ls.add_argument("url", help="folder or URL to list checkpoints under, at any depth")
    ls.add_argument("--json", action="store_true", help="one JSON list for scripts")


def _add_inspect(sub: _Subparsers, common: argparse.ArgumentParser) -> None:
    inspect = sub.add_parser("inspect", parents=[common], help="what a checkpoint holds")
    inspect.add_argument("url", help="a committed checkpoint's folder or URL")
    inspect.add_argument("--json", action="store_true", help="one JSON object for scripts")


def _add_verify(sub: _Subparsers, common: argparse.ArgumentParser) -> None:
    verify = sub.add_parser("verify", parents=[common], help="check completeness and checksums")
    verify.add_argument("url", help="a committed checkpoint's folder or URL")


def _add_convert(sub: _Subparsers, common: argparse.ArgumentParser) -> None:
    convert = sub.add_parser(
        "convert",
        parents=[common],
        help="change format, flatten a chain, TFRA in/out",
        description="TFRA files hold raw keys and values and record no dim and no dtype: "
        "give --dim, --key-dtype and --value-dtype as the variable was created. The file "
        "sizes are checked against them (a values file must hold keys x dim x itemsize "
        "bytes); a wrong dtype of the same size (float32 for int32) cannot be detected.",
    )
    convert.add_argument("src", help="a committed checkpoint, or a TFRA folder (give --dim)")
    convert.add_argument("dst", help="new checkpoint folder, or the TFRA folder to write")
    convert.add_argument(
        "--to",
        choices=["parquet", "arrow", "binary", "tfra"],
        help="format to write (default, for a checkpoint SRC: each variable's own)",
    )
    convert.add_argument("--dim", type=int, help="dim of the TFRA variables read")
    convert.add_argument(
        "--key-dtype", default="int64", help="TFRA key dtype (int64); the files do not record it"
    )
    convert.add_argument(
        "--value-dtype",
        default="float32",
        help="TFRA value dtype (float32); the files do not record it",
    )
    convert.add_argument(
        "--name", action="append", default=[], help="only this variable (repeatable)"
    )
    convert.add_argument(
        "--values-only", action="store_true", help="drop extra columns (optimizer slots)"
    )


def _add_gc(sub: _Subparsers, common: argparse.ArgumentParser) -> None:
    gc = sub.add_parser(
        "gc",
        parents=[common],
        help="list (and with --yes delete) abandoned staging and orphaned checkpoints",
    )
    gc.add_argument("url", help="a folder of checkpoints (e.g. run/de_store), not one above")
    gc.add_argument("--yes", action="store_true", help="delete; without it gc only lists")
    gc.add_argument("--dry-run", action="store_true", help="only list (the default)")
    gc.add_argument(
        "--grace",
        type=_grace_seconds,
        default=3600.0,
        metavar="SECONDS",
        help="keep anything modified within this many seconds (default 3600)",
    )


def _grace_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON: {err}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``de-store`` with ``argv`` (default: the command line); return the exit code."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # the demo imports TensorFlow
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    with _logging_to_stderr(verbose=args.verbose, debug=args.debug):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        _check_reachable(args)
        code = int(_COMMANDS[args.command](args))
        sys.stdout.flush()  # a reader gone away shows here, not at exit
        return code
    except KeyboardInterrupt:
        print("de-store: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError as err:
        if _stdout_gone():
            return EXIT_BROKEN_PIPE
        return _report(err, args)
    except Exception as err:
        return _report(err, args)


def _report(err: Exception, args: argparse.Namespace) -> int:
    if args.debug:
        raise err
    message = str(err).splitlines()[0] if str(err) else type(err).__name__
    print(f"de-store: error: {message}", file=sys.stderr)
    return EXIT_USAGE if isinstance(err, _UsageError) else EXIT_FAILED


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader went away (polling it reports an error); if
    so, stdout goes to /dev/null from now on, so that exiting (which flushes what is left
    of it) prints no ``Broken pipe`` error."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poller.poll(0)):
            return False
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
    except (OSError, ValueError, AttributeError):  # no file descriptor, or no poll()
        return False
    return True


def _check_reachable(args: argparse.Namespace) -> None:
    from de_store.checkpoint.destination import check_reachable

    for name in _URL_ARGUMENTS:
        url = getattr(args, name, None)
        if isinstance(url, str):
            check_reachable(url, args.storage_options)


class _StderrHandler(logging.Handler):
    """Writes each record as one line to the current ``sys.stderr``."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def _logging_to_stderr(*, verbose: bool, debug: bool) -> Iterator[None]:
    """While a command runs: de_store's warnings (retries) on stderr, one line each, and
    its INFO lines with ``verbose``. Other libraries' records are dropped unless ``debug``
    (gcsfs logs a traceback when it gives up; the error reaches the command anyway)."""
    ours, root = logging.getLogger("de_store"), logging.getLogger()
    saved = (ours.level, ours.propagate, root.level)
    handler = _StderrHandler()
    formats = "de-store: %(levelname)s: %(message)s"
    handler.setFormatter(logging.Formatter(formats if not debug else f"%(asctime)s {formats}"))
    ours.addHandler(handler)
    ours.setLevel(logging.INFO if verbose or debug else logging.WARNING)
    ours.propagate = False
    if not debug:
        root.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        ours.removeHandler(handler)
        ours.level, ours.propagate = saved[:2]
        root.setLevel(saved[2])


class _UsageError(ValueError):
    """Arguments that do not fit together."""


def _progress(args: argparse.Namespace, unit: str = "B") -> Any:
    from de_store.progress import progress_for

    return lambda total, label: progress_for(total, label, quiet=args.quiet, unit=unit)


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    raise AssertionError


# --- commands ---------------------------------------------------------------------------
def _cmd_demo(args: argparse.Namespace) -> int:
    if args.save_shards < 1 or args.restore_shards < 1 or args.steps < 1 or args.ids < 1:
        raise _UsageError("--steps, --ids, --save-shards and --restore-shards must be >= 1")
    from de_store import demo

    return (
        EXIT_OK
        if demo.run(
            args.dir,
            steps=args.steps,
            ids=args.ids,
            save_shards=args.save_shards,
            restore_shards=args.restore_shards,
            progress=not args.quiet,
            storage_options=args.storage_options,
        )
        else EXIT_FAILED
    )


def _cmd_ls(args: argparse.Namespace) -> int:
    import dataclasses

    from de_store.catalog import list_checkpoints

    found = list_checkpoints(args.url, args.storage_options)
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in found], indent=1))
        return EXIT_OK
    if not found:
        _require_exists(args.url, args.storage_options)
        print(f"no checkpoints under {args.url}")
        return EXIT_OK
    rows = [("PATH", "STATUS", "KIND", "STEP", "COMMITTED", "SIZE", "VARIABLES", "PARENT")]
    for s in found:
        step = "-" if s.step is None else str(s.step)
        count = "-" if s.variables is None else str(s.variables)
        when, size = _when(s.committed), _size(s.bytes)
        rows.append(
            (s.path or ".", s.status, s.kind or "-", step, when, size, count, s.parent or "-")
        )
    _print_table(rows)
    for s in found:
        if s.problem is not None:
            print(f"damaged {s.path or '.'}: {s.problem}")
    return EXIT_OK


def _require_exists(url: str, storage_options: dict[str, Any] | None) -> None:
    """Raise if nothing is at ``url`` (a folder, or on object stores a prefix of objects)."""
    from de_store.backends import open_backend
    from de_store.errors import StorageNotFoundError

    if not open_backend(url, storage_options).exists(""):
        raise StorageNotFoundError(f"{url} does not exist")


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _cmd_inspect(args: argparse.Namespace) -> int:
    from de_store.catalog import describe

    info = describe(args.url, args.storage_options)
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
        return EXIT_OK
    topology = info["topology"]
    print(f"checkpoint  {info['url']}")
    print(f"committed   {_when(info['committed'])} (generation {info['generation']})")
    print(f"size        {_size(info['bytes'])}, {info['rows']:,} rows")
    per_rank = ", ".join(f"rank {r}: {n}" for r, n in topology["shards_per_rank"].items())
    print(f"saved by    {topology['proc_size']} process(es); shards {per_rank}")
    if info["metadata"]:
        print(f"metadata    {json.dumps(info['metadata'], sort_keys=True)}")
    _print_chain(info)
    print()
    header = (
        "VARIABLE DIM KEY VALUE COLUMNS ROWS REMOVED SHARDS SIZE FORMAT COMPRESSION STORED-AS "
        "SAVED-AS"
    )
    rows = [tuple(header.split())]
    for name, v in info["variables"].items():
        extras = ",".join(c for c in v["columns"] if c != "value") or "-"
        links = v["chain_links"]
        saved_as = f"delta (chain of {links})" if v["incremental"] else "full"
        rows.append(
            (
                name,
                str(v["dim"]),
                v["key_dtype"],
                v["value_dtype"],
                extras,
                f"{v['rows']:,}",
                f"{v['removed']:,}" if v["incremental"] else "-",
                str(v["shards"]),
                _size(v["bytes"]),
                v["format"],
                v["compression"],
                v["value_precision"],
                saved_as,
            )
        )
    _print_table(rows)
    if info["chain_error"]:
        print(f"de-store: error: {info['chain_error']}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _print_chain(info: dict[str, Any]) -> None:
    """The kind of the checkpoint and, for a delta, its chain oldest first."""
    chain = info["chain"]
    if info["kind"] == "full":
        print("kind        full")
        return
    deltas = sum(link["kind"] == "delta" for link in chain)
    print(f"kind        delta on {info['parent']}")
    if info["chain_error"]:
        print(f"chain       BROKEN, it cannot be restored: {info['chain_error']}")
    else:
        rows = sum(link["rows"] + link["removed"] for link in chain)
        size = _size(sum(link["bytes"] for link in chain))
        print(
            f"chain       {len(chain)} links, oldest first: a full one and {deltas} delta(s); "
            f"a restore reads {rows:,} rows, {size}"
        )
    rows = []
    for link in chain:
        this = "  <- this checkpoint" if link["folder"] == info["folder"] else ""
        if link["kind"] == "missing":
            rows.append((f"  {link['folder']}", "missing", "-", "-"))
            continue
        removed = f", {link['removed']:,} removed" if link["kind"] == "delta" else ""
        rows_text = f"{link['rows']:,} rows{removed}"
        rows.append((f"  {link['folder']}", link["kind"], rows_text, _size(link["bytes"]) + this))
    _print_table(rows)


def _cmd_verify(args: argparse.Namespace) -> int:
    from de_store.backends import open_location
    from de_store.checkpoint.verify import verify_checkpoint
    from de_store.progress import progress_for

    backend, name = open_location(args.url, args.storage_options)
    with progress_for(0, "verify", quiet=args.quiet) as progress:
        report = verify_checkpoint(backend, name, progress=progress)
    for problem in report.problems:
        print(f"BAD {problem.path}: {problem.message}")
    if report.ok:
        removed = f" and {report.removed:,} removed keys (tombstones)" if report.removed else ""
        print(
            f"OK {args.url}: {report.files} files, {_size(report.bytes)}, "
            f"{report.rows:,} rows{removed}, every checksum matches"
        )
        return EXIT_OK
    print(f"de-store: error: {args.url}: {len(report.problems)} problem(s)", file=sys.stderr)
    return EXIT_FAILED


def _cmd_convert(args: argparse.Namespace) -> int:
    from de_store.backends import open_location
    from de_store.checkpoint.destination import check_destination
    from de_store.convert import TfraOptions, convert

    check_destination(*open_location(args.dst, args.storage_options), probe=True)
    tfra_options = TfraOptions(args.dim, args.key_dtype, args.value_dtype, tuple(args.name))
    summary = convert(
        args.src,
        args.dst,
        args.to,
        storage_options=args.storage_options,
        tfra_options=tfra_options,
        values_only=args.values_only,
        progress_factory=_progress(args, unit="shards"),
    )
    print(summary)
    return EXIT_OK


def _cmd_gc(args: argparse.Namespace) -> int:
    from de_store.backends import open_backend
    from de_store.checkpoint import gc

    _require_exists(args.url, args.storage_options)
    backend = open_backend(args.url, args.storage_options)
    plan = gc.plan(backend, args.grace)
    if args.dry_run or not args.yes:
        for item in plan.remove:
            print(f"would remove {item.folder}: {item.reason}")
        for item in plan.kept:
            print(f"kept {item.folder}: {item.reason}")
        hint = " (run again with --yes to delete)" if plan.remove else ""
        print(f"would remove {len(plan.remove)} item(s) under {args.url}{hint}")
        return EXIT_OK
    deleted, kept = gc.delete(backend, plan.remove, args.grace)
    for item in deleted:
        print(f"removed {item.folder}: {item.reason}")
    for item in plan.kept + kept:
        print(f"kept {item.folder}: {item.reason}")
    print(f"removed {len(deleted)} item(s) under {args.url}")
    return EXIT_OK


_COMMANDS = {
    "demo": _cmd_demo,
    "ls": _cmd_ls,
    "inspect": _cmd_inspect,
    "verify": _cmd_verify,
    "convert": _cmd_convert,
    "gc": _cmd_gc,
}


if __name__ == "__main__":
    sys.exit(main())
