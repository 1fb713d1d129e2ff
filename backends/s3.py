"""Amazon S3 (and S3-compatible stores) through s3fs: ``s3://bucket/prefix``.

No rename: objects are written once under their final names (a multipart upload becomes
visible only when it completes; a failed one is aborted) and a commit marker decides
visibility. ``write_once`` is a conditional put (``If-None-Match: *``), which S3 and moto
honour. Against moto or another endpoint, give ``endpoint_url`` but no ``region_name``.
"""

from __future__ import annotations

from botocore.exceptions import BotoCoreError

from .base import Capabilities
from .fsspec_generic import FsspecBackend


class S3Backend(FsspecBackend):
    """A bucket prefix on S3; see :class:`FsspecBackend`."""

    protocol = "s3"
    capabilities = Capabilities(supports_atomic_rename=False)
    makes_parent_dirs = False
    native_errors = (OSError, BotoCoreError)
