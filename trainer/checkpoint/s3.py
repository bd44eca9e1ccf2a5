"""An S3 (or S3-compatible) checkpoint store on boto3, reached as `trainer.aws` says.

Large objects go up in parallel multipart with checksums that S3 verifies on receipt (CRC32
by default, SHA256 on request), while the manifest's sha256 covers each checkpoint end to end.
"""

from __future__ import annotations

import io
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoCredentialsError

from trainer.aws import error_code, missing_credentials, s3_client
from trainer.checkpoint.store import CheckpointStore, StaleWrite
from trainer.config import ConfigError

_STEP_PREFIX = re.compile(r"step-(\d+)/$")
# a failed precondition (412), the loser of a race (409), an If-Match on a deleted key (404)
_CONDITION_FAILED = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey", "404"}
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "AllAccessDisabled"}


class S3Store(CheckpointStore):
    """`s3://bucket/prefix`: objects `prefix/step-<N>/...` and `prefix/latest.json`.

    A step is published object by object in the order given (checkpoint, then manifest);
    readers trust a step only through `latest.json` and the manifest's sha256."""

    def __init__(
        self, uri: str, bucket: str, prefix: str, *, chunk_mb: int, concurrency: int, checksum: str
    ) -> None:
        self.uri, self.bucket, self.prefix = uri, bucket, prefix.strip("/")
        self.checksum = {"ChecksumAlgorithm": checksum}
        self.client = s3_client()
        self.transfer = TransferConfig(
            multipart_threshold=chunk_mb * 2**20,
            multipart_chunksize=chunk_mb * 2**20,
            max_concurrency=concurrency,
        )

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def prepare(self) -> None:
        """Write and delete a probe object, so a missing bucket, denied access or a bad
        endpoint stops the run before training rather than at the first checkpoint."""
        probe = self._key(f".probe-{uuid.uuid4().hex}")
        try:
            self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"", **self.checksum)
            self.client.delete_object(Bucket=self.bucket, Key=probe)
        except NoCredentialsError:
            raise ConfigError("checkpoint.uri", self.uri, missing_credentials()) from None
        except EndpointConnectionError as error:
            raise ConfigError("checkpoint.uri", self.uri, f"cannot reach the S3 endpoint ({error})") from None
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code", "")
            if code == "NoSuchBucket":
                raise ConfigError(
                    "checkpoint.uri", self.uri, f"bucket {self.bucket!r} does not exist"
                ) from None
            if code in _DENIED:
                raise ConfigError("checkpoint.uri", self.uri, f"access denied ({code})") from None
            raise ConfigError("checkpoint.uri", self.uri, f"S3 refused a probe write ({code})") from None
        except BotoCoreError as error:
            raise ConfigError("checkpoint.uri", self.uri, f"S3 probe failed ({error})") from None

    def clean_staging(self, scratch: Path) -> None:
        """Staging is on local disk; an interrupted write leaves at most an unreferenced
        step folder in the bucket, which the next save of that step replaces."""
        shutil.rmtree(scratch / "staging", ignore_errors=True)

    def staging(self, step: int, scratch: Path) -> Path:
        folder = scratch / "staging" / f"step-{step}-{uuid.uuid4().hex[:8]}"
        folder.mkdir(parents=True)
        return folder

    def publish(
        self,
        step: int,
        staging: Path,
        order: list[str],
        expected: str | None,
        progress: Callable[[int], None] = lambda done: None,
    ) -> None:
        """Upload from disk (parallel part reads), checking each object's size afterwards;
        the last, small file (the manifest, which names the step) goes up with If-None-Match
        or If-Match, so that S3 refuses it where another writer came between. Its progress
        is the bytes on the wire, which the writer process counts itself (boto3's own
        callback fires per 256 KiB read, ahead of the network: writer_process.py)."""
        try:
            for name in order[:-1]:
                path, key = staging / name, self._key(f"step-{step}/{name}")
                self.client.upload_file(
                    str(path), self.bucket, key, ExtraArgs=self.checksum, Config=self.transfer
                )
                self._check_size(key, path.stat().st_size)
            naming = order[-1]
            data = (staging / naming).read_bytes()
            if self.put_if(f"step-{step}/{naming}", data, expected) is None:
                raise StaleWrite(
                    f"s3://{self.bucket}/{self._key(f'step-{step}/{naming}')} changed under this write"
                )
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def abort_uploads(self, step: int) -> int:
        """Abort the multipart uploads left open under `step-<N>/` (a writer stopped mid-upload
        leaves its parts billed and invisible); how many there were."""
        prefix, aborted = self._key(f"step-{step}/"), 0
        paginator = self.client.get_paginator("list_multipart_uploads")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            for upload in page.get("Uploads", []):
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
                aborted += 1
        return aborted

    def _check_size(self, key: str, expected: int) -> None:
        """A cheap read-back, so that even a server that skips checksum checks cannot leave a
        short object for the manifest to vouch for."""
        stored = self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
        if stored != expected:
            raise OSError(f"s3://{self.bucket}/{key} holds {stored} bytes, expected {expected}")

    def put(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data, **self.checksum)

    def get(self, name: str) -> bytes | None:
        buffer = io.BytesIO()
        if not self._download(name, buffer):
            return None
        return buffer.getvalue()

    def get_versioned(self, name: str) -> tuple[bytes, str] | None:
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as error:
            if error_code(error) in {"404", "NoSuchKey"}:
                return None
            raise
        return answer["Body"].read(), answer["ETag"]

    def put_if(self, name: str, data: bytes, version: str | None) -> str | None:
        """PutObject with If-None-Match: * or If-Match: ETag. S3 answers 412 when the
        condition fails and 409 to the loser of two racing conditional writes."""
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
        try:
            answer = self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=data, **condition)
        except ClientError as error:
            if error_code(error) in _CONDITION_FAILED:
                return None
            raise
        return str(answer["ETag"])

    def delete_if(self, name: str, version: str) -> bool:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name), IfMatch=version)
        except ClientError as error:
            if error_code(error) in _CONDITION_FAILED:
                return False
            raise
        return True

    def local_path(self, name: str, cache: Path) -> Path:
        return cache / self.bucket / self._key(name)

    def fetch(self, name: str, cache: Path) -> bool:
        destination = self.local_path(name, cache)
        destination.parent.mkdir(parents=True, exist_ok=True)
        partial = destination.with_name(destination.name + f".part-{uuid.uuid4().hex[:8]}")
        try:
            with open(partial, "wb") as handle:
                if not self._download(name, handle):
                    return False
            partial.replace(destination)
            return True
        finally:
            partial.unlink(missing_ok=True)

    def evict(self, name: str, cache: Path) -> None:
        self.local_path(name, cache).unlink(missing_ok=True)

    def _download(self, name: str, handle: BinaryIO) -> bool:
        try:
            self.client.download_fileobj(self.bucket, self._key(name), handle, Config=self.transfer)
            return True
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in {"404", "NoSuchKey"}:
                return False
            raise

    def names(self, prefix: str) -> list[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        base = self._key("")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix))
        return sorted(item["Key"].removeprefix(base) for page in pages for item in page.get("Contents", []))

    def steps(self) -> list[int]:
        found = []
        paginator = self.client.get_paginator("list_objects_v2")
        prefix = self._key("step-")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                match = _STEP_PREFIX.search(common["Prefix"])
                if match:
                    found.append(int(match[1]))
        return sorted(found)

    def delete_step(self, step: int, version: str | None = None) -> bool:
        if version is not None and not self.delete_if(f"step-{step}/manifest.json", version):
            return False
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(f"step-{step}/")):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
        return True

    def location(self, step: int) -> str:
        return f"s3://{self.bucket}/{self._key(f'step-{step}')}"
