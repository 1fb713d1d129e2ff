"""Amazon S3 (and S3-compatible stores) through s3fs: ``s3://bucket/prefix``.

No rename: objects are written once under their final names (a multipart upload becomes
visible only when it completes; a failed one is aborted) and a commit marker decides
visibility. A streamed write uploads its parts concurrently while the shard is still being
encoded (see :mod:`._multipart`), and a streamed read takes a sequential run of reads from
one GET (see :mod:`._streaming`). ``write_once`` is a conditional put
(``If-None-Match: *``), which S3 and moto honour. Against moto or another endpoint, give
``endpoint_url`` but no ``region_name``.
"""

from __future__ import annotations

import contextlib
from typing import Any

from botocore.exceptions import BotoCoreError
from fsspec.asyn import sync

from ._multipart import MultipartUpload
from ._streaming import StreamingDownload
from .base import Capabilities
from .fsspec_generic import FsspecBackend


class S3Backend(FsspecBackend):
    """A bucket prefix on S3; see :class:`FsspecBackend`."""

    protocol = "s3"
    capabilities = Capabilities(supports_atomic_rename=False)
    makes_parent_dirs = False
    native_errors = (OSError, BotoCoreError)
    #: Storage options are checked (see :mod:`.options`): S3FileSystem's, and those it hands
    #: to the aiobotocore session it builds.
    storage_options_extra: tuple[str, ...] = (
        "profile", "session_vars", "event_hooks", "include_builtin_handlers"
    )  # fmt: skip
    #: Bytes per multipart part of a streamed write.
    upload_part_size: int = 16 << 20
    #: Most parts of one streamed write uploading at once (memory: this + 1 parts).
    upload_concurrency: int = 4
    #: Full parts a streamed write holds before it starts a multipart upload: a file smaller
    #: than this + 1 parts (80 MiB) goes as one PUT once it is closed, as s3fs sends an
    #: object under its chunk size; 0 sends every file of a part or more in parts, side by
    #: side while it is written (memory: ``max(upload_concurrency, this) + 1`` parts).
    upload_whole_parts: int = 4

    def _open_upload(self, full: str) -> Any:
        return MultipartUpload(
            self.fs, full, self.upload_part_size, self.upload_concurrency, self.upload_whole_parts
        )

    def _open_download(self, full: str) -> Any:
        """One streamed GET per sequential run of reads (:mod:`._streaming`), after one
        HEAD for the object's size."""
        self.fs.invalidate_cache(full)
        size = int(self._file_info(full)["size"])
        bucket, key, version = self.fs.split_path(full)
        version_arg = {"VersionId": version} if version else {}

        async def open_get(start: int) -> Any:
            response = await self.fs._call_s3(
                "get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{size - 1}",
                **version_arg,
            )  # fmt: skip
            return response["Body"]

        return StreamingDownload(self.fs.loop, open_get, f"s3://{full}", size, (BotoCoreError,))

    def read_bytes(self, path: str) -> bytes:
        """One GET of the object (s3fs's ``cat_file`` asks for a HEAD first, to split a
        large object among concurrent GETs; de_store reads whole only its small files)."""
        with self._translating("read", path):
            data: bytes = self.fs.cat_file(self._full(path), max_concurrency=1)
        self.stats.add_read(len(data))
        return data

    def _file_info(self, full: str) -> dict[str, Any]:
        """One HEAD of the object (s3fs's ``info`` lists the prefix too when none is there).

        A key with objects under it but none of its own raises FileNotFoundError, not
        IsADirectoryError: no file is there to read or size.
        """
        bucket, key, version = self.fs.split_path(full)
        if not key:
            raise IsADirectoryError(full)
        version_arg = {"VersionId": version} if version else {}
        head = sync(self.fs.loop, self.fs._call_s3, "head_object", Bucket=bucket, Key=key,
                    **version_arg)  # fmt: skip
        return {"name": full, "size": int(head["ContentLength"]), "type": "file"}

    def list(self, prefix: str = "") -> list[str]:
        """One listing of the keys under ``prefix/``; when it finds none, one HEAD for an
        object named ``prefix`` itself (s3fs's ``find`` adds a second listing to that)."""
        full = self._full(prefix)
        bucket, _, key = full.partition("/")
        with self._translating("list", prefix):
            self.fs.invalidate_cache(full)
            try:
                found = self.fs.find(bucket, prefix=f"{key}/" if key else "")
            except FileNotFoundError:
                return []
            found = [p for p in found if not p.endswith("/")]
            if not found and key:
                with contextlib.suppress(FileNotFoundError):
                    found = [self._file_info(full)["name"]]
        return sorted(self._rel(p) for p in found)
