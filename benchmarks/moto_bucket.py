"""A bucket of moto's S3 in a lowest-priority process of its own (`benchmarks.checkpoint.
moto_process`), with the AWS_* variables boto3 and the trainer read, and what the state-size
benchmark does to its keys."""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager

from benchmarks.checkpoint import AWS, moto_process

REGION = AWS["AWS_REGION"]


def list_keys(bucket: str) -> list[str]:
    import boto3

    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


def prefix_of(key: str) -> str:
    return key.split("/", 1)[0]


def empty_bucket(bucket: str) -> None:
    import boto3

    client = boto3.client("s3")
    for key in list_keys(bucket):
        client.delete_object(Bucket=bucket, Key=key)


@contextmanager
def bucket_on_moto():
    """A bucket of moto's S3 in its lowest-priority process; the AWS_* variables boto3 and
    the trainer read."""
    import boto3

    with moto_process() as (endpoint, _):
        os.environ.update({**AWS, "AWS_ENDPOINT_URL": endpoint})
        bucket = f"state-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield bucket, endpoint
