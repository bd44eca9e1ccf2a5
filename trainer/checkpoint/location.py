"""Which store a `checkpoint.uri` names: a local directory (a path or `file://`) or S3.

Apart from both stores so that each knows only the interface it implements, and boto3 is
imported only for S3 runs."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from trainer.aws import split_s3_uri
from trainer.checkpoint.store import CheckpointStore, LocalStore
from trainer.config import CheckpointConfig, ConfigError


def open_store(config: CheckpointConfig) -> CheckpointStore:
    """The store for `checkpoint.uri`: a path, a `file://` URI or `s3://bucket/prefix`.
    Only the URI is checked here; reachability is `prepare`'s job."""
    uri = config.uri
    parsed = urlparse(uri)
    if not uri:
        raise ConfigError("checkpoint.uri", uri, "must be a directory, file:// or s3:// URI")
    if parsed.scheme == "s3":
        bucket, prefix = split_s3_uri("checkpoint.uri", uri)
        from trainer.checkpoint.s3 import S3Store  # boto3 is imported only for S3 runs

        return S3Store(
            uri,
            bucket,
            prefix,
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
