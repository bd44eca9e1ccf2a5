"""Checkpoints: a store interface (local directory, S3 later) and the commit protocol over it."""

from trainer.checkpoint.manager import Checkpointer, CheckpointError, SavedCheckpoint
from trainer.checkpoint.store import CheckpointStore, LocalStore, open_store

__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "Checkpointer",
    "LocalStore",
    "SavedCheckpoint",
    "open_store",
]
