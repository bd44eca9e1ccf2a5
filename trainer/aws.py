"""How every part of the trainer reaches S3: checkpoints and sharded datasets alike.

Endpoint, region and credentials come only from the standard AWS environment and credential
chain (AWS_ENDPOINT_URL[_S3], AWS_REGION, keys, profiles, web identity/IRSA), so what the
chart sets for checkpoints serves the dataset too. Transient errors are retried by
botocore's retry mode (`standard` unless AWS_RETRY_MODE says otherwise). boto3 is imported
only when a client is made, so runs without S3 never load it.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import urlparse

from trainer.config import ConfigError

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def is_s3(uri: str) -> bool:
    return urlparse(uri).scheme == "s3"


def split_s3_uri(field: str, uri: str) -> tuple[str, str]:
    """`s3://bucket/prefix` as (bucket, prefix without slashes at its ends); a ConfigError
    naming `field` for a bucket name S3 would refuse."""
    parsed = urlparse(uri)
    if not _BUCKET.match(parsed.netloc):
        raise ConfigError(field, uri, "s3:// needs a valid bucket name: s3://bucket/prefix")
    return parsed.netloc, parsed.path.strip("/")


def s3_client() -> Any:
    """A boto3 S3 client on the standard chain; the environment's AWS_RETRY_MODE and
    AWS_MAX_ATTEMPTS win over our default of 6 attempts in `standard` mode."""
    import boto3
    from botocore.config import Config

    retries = {} if "AWS_RETRY_MODE" in os.environ else {"retries": {"mode": "standard", "max_attempts": 6}}
    return boto3.client("s3", config=Config(connect_timeout=10, read_timeout=60, **retries))


def error_code(error: Exception) -> str:
    """A botocore ClientError's code (`NoSuchKey`, `403`); empty for any other error."""
    response = getattr(error, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def missing_credentials() -> str:
    """Why botocore found no credentials, where the environment says: a credentials file that
    is not there (the chart mounts it from a Secret, optional so that this line says so)."""
    path = os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "")
    if path and not os.path.isfile(path):
        return (
            f"no AWS credentials: AWS_SHARED_CREDENTIALS_FILE={path} does not exist (the chart mounts it "
            "from checkpoint.s3.existingSecret's key checkpoint.s3.credentialsKey, an AWS credentials file: "
            "kubectl create secret generic NAME --from-file=credentials=FILE)"
        )
    return "no AWS credentials found (keys, profile or web identity)"
