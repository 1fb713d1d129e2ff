"""Google Cloud Storage through gcsfs: ``gs://bucket/prefix``.

gcsfs's experimental zonal/HNS support is switched off (``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``
set to false before gcsfs is imported, unless the user set it): with it every call against
an emulator stalls about 60 s. ``publish`` copies then deletes (the emulator answers 501 to
``moveTo``). ``write_once`` uploads with ``ifGenerationMatch=0``, exclusive on real GCS; the
emulator ignores that precondition, so there only the existence check protects it. A
streamed write encodes its next chunk while the last one uploads (see :mod:`._gcs_upload`),
and a streamed read takes a sequential run of reads from one GET (see :mod:`._streaming`);
with gcsfs's experimental zonal support switched on, reads and writes go through gcsfs's
own file, which knows zonal buckets.
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from fsspec.asyn import sync
from gcsfs.retry import HttpError, retry_request, validate_response
from google.auth.exceptions import GoogleAuthError

from ._gcs_upload import ResumableUpload
from ._streaming import StreamingDownload
from .base import Capabilities
from .fsspec_generic import FsspecBackend


class GCSBackend(FsspecBackend):
    """A bucket prefix on Google Cloud Storage; see :class:`FsspecBackend`."""

    protocol = "gs"
    capabilities = Capabilities(supports_atomic_rename=False)
    makes_parent_dirs = False
    #: gcsfs raises what the store answered, when its retries gave out, as HttpError (a
    #: 5xx, a 429), not as OSError.
    native_errors = (OSError, GoogleAuthError, HttpError)
    #: Storage options are checked (see :mod:`.options`): GCSFileSystem's, and the retry
    #: and copy settings gcsfs's extended filesystem reads from its keywords.
    storage_options_extra: tuple[str, ...] = (
        "retry_timeout", "retry_initial", "retry_maximum", "retry_multiplier",
        "memmove_max_workers",
    )  # fmt: skip
    #: Bytes per chunk of a streamed write's upload session (a multiple of 256 KiB); an
    #: object under one chunk goes as one simple upload. Memory: two chunks.
    upload_chunk_size: int = 16 << 20

    def _open_upload(self, full: str) -> Any:
        if hasattr(self.fs, "_is_zonal_bucket"):  # gcsfs's experimental filesystem
            return super()._open_upload(full)
        return ResumableUpload(self.fs, full, self.upload_chunk_size)

    def _open_download(self, full: str) -> Any:
        """One streamed GET per sequential run of reads (:mod:`._streaming`), after one GET
        of the object's metadata for its size (gcsfs's file reads 5 MiB blocks, a GET
        each). The GET is gcsfs's media download with a ``Range`` header, through its
        session, credentials and retries of a failed request."""
        if hasattr(self.fs, "_is_zonal_bucket"):  # gcsfs's experimental filesystem
            return super()._open_download(full)
        fs, size = self.fs, int(self._file_info(full)["size"])
        url = fs.url(full)

        async def open_once(start: int) -> _ResponseBody:
            await fs._set_session()
            headers = fs._get_headers({"Range": f"bytes={start}-{size - 1}"})
            response = await fs.session.get(url, headers=headers, timeout=fs.requests_timeout)
            if response.status >= 400:
                try:
                    validate_response(response.status, await response.read(), url)
                finally:
                    response.close()
                raise OSError(f"GET of gs://{full} answered {response.status}")
            return _ResponseBody(response)

        open_get = retry_request(retries=6)(open_once)  # as gcsfs retries its requests
        return StreamingDownload(fs.loop, open_get, f"gs://{full}", size)

    def _file_info(self, full: str) -> dict[str, Any]:
        """One GET of the object's metadata (gcsfs's ``info`` lists the prefix beside it)."""
        info: dict[str, Any] = sync(self.fs.loop, self.fs._get_object, full)
        if info["type"] != "file":
            raise IsADirectoryError(full)
        return info


class _ResponseBody:
    """The body of an aiohttp response, read as :class:`._streaming.Body`."""

    def __init__(self, response: Any) -> None:
        self._response = response

    async def read(self, size: int) -> bytes:
        data: bytes = await self._response.content.read(size)
        return data

    def close(self) -> None:
        self._response.close()
