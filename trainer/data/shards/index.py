"""A sharded dataset's `index.json`: its shape, and each split's shards with size and sha256.

The index is written last, so a dataset whose index exists is complete; every shard is
checked against its entry (size at start, sha256 on each read), which turns a missing or
damaged shard into an error that names it."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer.data.base import DataError, DataSpec

FORMAT = "ddp-trainer-shards/1"
INDEX_FILE = "index.json"
SPLITS = ("train", "val", "test")


class ShardEntry(BaseModel):
    """One shard: a safetensors file of `inputs` and `targets`, `samples` long."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    file: Annotated[str, Field(pattern=r"^[A-Za-z0-9._/-]+\.safetensors$")]
    samples: Annotated[int, Field(gt=0)]
    bytes: Annotated[int, Field(gt=0)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class SpecEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    task: Literal["classification", "language_modeling"]
    input_shape: list[Annotated[int, Field(gt=0)]]
    num_classes: Annotated[int, Field(gt=0)]
    tokens_per_sample: Annotated[int, Field(gt=0)] = 1


class ShardIndex(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    format: Literal["ddp-trainer-shards/1"]
    spec: SpecEntry
    train: list[ShardEntry]
    val: list[ShardEntry]
    test: list[ShardEntry]

    def data_spec(self) -> DataSpec:
        spec = self.spec
        return DataSpec(spec.task, tuple(spec.input_shape), spec.num_classes, spec.tokens_per_sample)

    def shards(self) -> list[ShardEntry]:
        return [*self.train, *self.val, *self.test]


def parse_index(data: bytes, where: str) -> ShardIndex:
    """The index at `where`, or a DataError naming its first problem."""
    try:
        return ShardIndex.model_validate(json.loads(data))
    except json.JSONDecodeError as error:
        raise DataError("data.path", where, f"{INDEX_FILE} is not JSON ({error})") from None
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise DataError("data.path", where, f"{INDEX_FILE}: {field}: {first['msg']}") from None


def describe(data: bytes) -> tuple[int, str]:
    return len(data), hashlib.sha256(data).hexdigest()
