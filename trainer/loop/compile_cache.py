"""Compiled graphs that outlive the process and the pod.

Inductor keeps what it compiles on disk (FX graphs, AOTAutograd's, the C++ or Triton
kernels, autotune results) under `TORCHINDUCTOR_CACHE_DIR`, read when the folder is first
used (torch/_inductor/runtime/cache_dir_utils.py, `cache_dir`). The trainer points it at a
node-local folder per configuration (`folder_for`), so that a rank that torchrun restarts
in the same pod finds its graphs there and compiles nothing again.

A re-created pod (a lost node, a preemption) starts with an empty folder. So with
`train.compile_cache=shared` rank 0 also keeps the folder, as one archive, beside the
checkpoints (`compile-cache-<key>.tar.gz`), and every rank that finds its folder empty
unpacks it before the first step. torch's own portable form (`save_cache_artifacts`,
the "mega-cache") was measured too: it carries the FX and AOTAutograd entries but not the
CPU kernels' shared objects, so a new pod loading it still spent 80 % of a cold compile on
the C++ compiler here, where the folder itself took 12 %.

The key is what makes the graphs valid: torch and Python versions, the device, the model's
configuration and the shapes and precision it runs in. An archive holds code that the ranks
run, so `shared` trusts whoever can write the checkpoint location as it trusts the image;
`local` keeps compiled code off the store (docs/checkpoints.md, "The compile cache").
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import platform
import shutil
import tarfile
import tempfile
import threading
from pathlib import Path

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from trainer.checkpoint.store import CheckpointStore
from trainer.config import Config

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
ARCHIVE = "compile-cache-{key}.tar.gz"
SKIPPED = ("locks",)  # inductor's lock files: per process, never to be shipped


def cache_key(config: Config, device_name: str) -> str:
    """16 hex digits of what the compiled graphs depend on (see the module docstring)."""
    facts = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device_name,
        "model": dataclasses.asdict(config.model),
        "data": [config.data.name, config.data.options, dataclasses.asdict(config.data.synthetic)],
        "shapes": [config.train.batch_size, config.train.eval_batch_size],
        "precision": [config.train.amp, config.train.tf32, config.train.compile],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def folder_for(key: str) -> Path:
    """The node-local cache folder: `TORCHINDUCTOR_CACHE_DIR` where the job sets one, else one
    per configuration under the temporary directory. Importing torch sets the variable to
    inductor's default (`cache_dir`), which is taken as unset."""
    given = os.environ.get(CACHE_DIR_ENV)
    if given and os.path.abspath(given) != os.path.abspath(default_cache_dir()):
        return Path(given)
    return Path(tempfile.gettempdir()) / "ddp-trainer-compile" / key


def cached_files(folder: Path) -> set[str]:
    """The cache's entries, as paths relative to `folder`."""
    if not folder.is_dir():
        return set()
    found = (path.relative_to(folder) for path in folder.rglob("*") if path.is_file())
    return {str(path) for path in found if path.parts[0] not in SKIPPED}


def pack(folder: Path, files: set[str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as archive:
        for name in sorted(files):
            archive.add(folder / name, arcname=name)
    return buffer.getvalue()


def unpack(data: bytes, folder: Path) -> None:
    """Unpack into a new folder and rename it into place, so that a rank that reads the
    folder meanwhile sees all of it or nothing, and two ranks of a node unpacking at once
    leave one whole copy. tarfile's `data` filter refuses links out of the folder, absolute
    paths and device files (tarfile.TarError, as a damaged archive)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            archive.extractall(staging, filter="data")
        if cached_files(folder):
            return  # another rank of this node was first
        with contextlib.suppress(OSError):  # another rank's whole copy took its place first
            if folder.exists():
                folder.rmdir()  # empty: made by a compile that found nothing
            staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class CompileCache:
    """This rank's compile cache: the local folder, and with `shared` its archive in the
    store, which rank 0 keeps up to date with what this run compiled."""

    def __init__(self, store: CheckpointStore, key: str, *, shared: bool, writes: bool) -> None:
        self.store, self.shared, self.writes = store, shared, writes
        self.name = ARCHIVE.format(key=key)
        self.folder = folder_for(key)
        self.published: set[str] = set()
        self.upload: threading.Thread | None = None

    def open(self, log: logging.Logger) -> str:
        """Point inductor at the folder, fill an empty one from the store's archive, and
        say which: 'local' (a restart's own), 'shared' (this run's archive) or 'cold'. A
        store that cannot be read costs a compile, not the run: one warning."""
        os.environ[CACHE_DIR_ENV] = str(self.folder)
        found = cached_files(self.folder)
        if found:
            self.published = found if self.shared else set()
            return "local"
        if not self.shared:
            return "cold"
        try:
            data = self.store.get(self.name)
        except Exception as error:
            log.warning("compile cache: %s could not be read (%s); compiling from scratch", self.name, error)
            return "cold"
        if data is None:
            return "cold"
        try:
            unpack(data, self.folder)
        except (tarfile.TarError, EOFError, OSError) as error:  # damaged, or not ours to unpack
            log.warning("compile cache: %s cannot be unpacked (%s); compiling from scratch", self.name, error)
            return "cold"
        self.published = cached_files(self.folder)
        return "shared"

    def publish(self, log: logging.Logger) -> None:
        """Rank 0, after a compile: where the folder holds entries the store's archive lacks,
        upload the whole folder on a thread of its own (never holding up a step). An
        upload that fails is one warning; the next publish tries again."""
        if not (self.shared and self.writes) or (self.upload is not None and self.upload.is_alive()):
            return
        files = cached_files(self.folder)
        if not files - self.published:
            return

        def upload() -> None:
            try:
                self.store.put(self.name, pack(self.folder, files))
                self.published = files
            except Exception as error:
                log.warning("compile cache: %s could not be written (%s)", self.name, error)

        self.upload = threading.Thread(target=upload, name="compile-cache-upload", daemon=True)
        self.upload.start()
