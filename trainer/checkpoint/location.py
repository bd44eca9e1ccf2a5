"""Which store a `checkpoint.uri` names: a local directory (a path or `file://`) or S3.

Apart from both stores so that each knows only the interface it implements, and boto3 is
imported only for S3 runs."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

from trainer.checkpoint.store import CheckpointStore, LocalStore
from trainer.config import CheckpointConfig, ConfigError

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def open_store(config: CheckpointConfig) -> CheckpointStore:
    """The store for `checkpoint.uri`: a path, a `file://` URI or `s3://bucket/prefix`.
    Only the URI is checked here; reachability is `prepare`'s job."""
    uri = config.uri
    parsed = urlparse(uri)
    if not uri:
        raise ConfigError("checkpoint.uri", uri, "must be a directory, file:// or s3:// URI")
    if parsed.scheme == "s3":
        if not _BUCKET.match(parsed.netloc):
            raise ConfigError("checkpoint.uri", uri, "s3:// needs a valid bucket name: s3://bucket/prefix")
        from trainer.checkpoint.s3 import S3Store  # boto3 is imported only for S3 runs

        return S3Store(
            uri,
            parsed.netloc,
            parsed.path,
            chunk_mb=config.multipart_chunk_mb,
            concurrency=config.max_concurrency,
            checksum=config.s3_checksum,
        )
    if parsed.scheme == "file":
        return LocalStore(Path(parsed.path))
    if parsed.scheme and len(parsed.scheme) > 1:  # a one-letter scheme is a Windows drive
        raise ConfigError(
            "checkpoint.uri", uri, f"unsupported scheme {parsed.scheme!r}; use a directory, file:// or s3://"
        )
    return LocalStore(Path(uri))
