"""Checkpoints: a store interface (local directory, S3), the commit protocol over it, and
rank 0's background writer."""

from trainer.checkpoint.location import open_store
from trainer.checkpoint.manager import Checkpointer, CheckpointError, SavedCheckpoint
from trainer.checkpoint.store import CheckpointStore, LocalStore
from trainer.checkpoint.writer import CheckpointWriter

__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "CheckpointWriter",
    "Checkpointer",
    "LocalStore",
    "SavedCheckpoint",
    "open_store",
]
