"""Where a sharded dataset lives: a local folder or an S3 prefix, read object by object."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from trainer.aws import error_code, is_s3, s3_client, split_s3_uri
from trainer.data.base import DataError

_MISSING = {"NoSuchKey", "404", "NoSuchBucket"}


class ShardSource(Protocol):
    uri: str

    def read(self, name: str) -> bytes:
        """The object's bytes; a DataError naming it when it is not there or not readable."""

    def sizes(self) -> dict[str, int]:
        """Every object's size by name, relative to the dataset's root."""

    def write(self, name: str, data: bytes) -> None:
        """Store an object (the shard writer's side)."""


class LocalSource:
    def __init__(self, folder: Path) -> None:
        self.folder, self.uri = folder, str(folder)

    def read(self, name: str) -> bytes:
        try:
            return (self.folder / name).read_bytes()
        except FileNotFoundError:
            raise DataError("data.path", self.uri, f"{name} is missing") from None
        except OSError as error:
            raise DataError("data.path", self.uri, f"{name} cannot be read ({error})") from None

    def sizes(self) -> dict[str, int]:
        return {
            str(path.relative_to(self.folder)): path.stat().st_size
            for path in self.folder.rglob("*")
            if path.is_file()
        }

    def write(self, name: str, data: bytes) -> None:
        path = self.folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.partial")
        staging.write_bytes(data)
        staging.rename(path)


class S3Source:
    """Objects under `s3://bucket/prefix/`, with the checkpoints' client (`trainer.aws`)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.bucket, self.prefix = split_s3_uri("data.path", uri)
        self.client = s3_client()
        from botocore.exceptions import BotoCoreError, ClientError  # botocore only for S3 data

        self.errors = (BotoCoreError, ClientError)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def read(self, name: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()
        except self.errors as error:
            code = error_code(error)
            if code in _MISSING:
                raise DataError("data.path", self.uri, f"{name} is missing ({code})") from None
            raise DataError("data.path", self.uri, f"{name} cannot be read ({error})") from None

    def sizes(self) -> dict[str, int]:
        found: dict[str, int] = {}
        start = f"{self.prefix}/" if self.prefix else ""
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=start
            ):
                for item in page.get("Contents", []):
                    found[item["Key"][len(start) :]] = item["Size"]
        except self.errors as error:
            raise DataError("data.path", self.uri, f"cannot list the dataset ({error})") from None
        return found

    def write(self, name: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)
        except self.errors as error:
            raise DataError("data.path", self.uri, f"cannot write {name} ({error})") from None


def open_source(path: str, *, create: bool = False) -> ShardSource:
    """The dataset at `path`; with `create`, a local folder is made (the writer's side)."""
    if is_s3(path):
        return S3Source(path)
    folder = Path(path.removeprefix("file://"))
    if create and path:
        folder.mkdir(parents=True, exist_ok=True)
    if not path or not folder.is_dir():
        raise DataError("data.path", path, "must be an s3:// prefix or a folder of shards with an index.json")
    return LocalSource(folder)
