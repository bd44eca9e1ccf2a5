"""The checkpoint writer process (`run`), started by `writer_start.spawn_writer`.

Started by a node's first rank at the start of a run. It serializes, hashes and uploads in
its own interpreter, so none of that holds the training process's GIL, at a lower CPU
priority (set before its imports), so it fills idle cycles. It reads pickled messages on
stdin (a `WriterSetup`, then `(SaveRequest, SharedState)` pairs, or a `Republish` of a
durable checkpoint another writer staged) and answers with pickled events on stdout, its
progress among them (the training process watches for silence). The next stage waits for
nothing but the previous stage; the upload runs on a thread, one at a time, and a durable
checkpoint staged while another uploads waits in one slot, where a newer one replaces it
(`Uploads`: latest wins, so a slow store costs durability, never training time). When its
parent is gone (stdin closes, a SIGKILLed rank included) it finishes what it was given,
the snapshot in flight and the uploads, and exits: a killed rank loses no state it had
already handed over. Signals meant for the training process group do not stop it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from trainer.checkpoint.lease import LeaseFence
from trainer.checkpoint.location import open_store
from trainer.checkpoint.manager import Checkpointer
from trainer.checkpoint.shared_state import SharedStateReader
from trainer.checkpoint.snapshots import SnapshotDir
from trainer.checkpoint.writing import PROGRESS_EVERY_S, Coalesced, Event, Progress, SaveRequest, SaveWork
from trainer.config import CheckpointConfig

WRITER_NICENESS = 10
LOCK_FILE, LOCK_WAIT_S = "writer.lock", 60.0


@dataclass(frozen=True)
class WriterSetup:
    """What the writer writes to: the durable store (rank 0 only), the node's snapshots;
    `cache` is the location's node-local folder (its staging and the writer lock)."""

    durable: CheckpointConfig | None
    cache: Path
    snapshots: SnapshotDir | None
    attempts: int
    fence: LeaseFence | None = None


@dataclass(frozen=True)
class Republish:
    """A durable checkpoint staged by a writer that was replaced (`staged`, complete): this
    writer publishes it, as its newest pending one."""

    request: SaveRequest
    staged: Path


class Uploads:
    """One upload at a time, on a thread; of the checkpoints staged meanwhile only the
    newest waits (an older one is dropped, reported as Coalesced)."""

    def __init__(self, work: SaveWork, emit: Callable[[Event], None]) -> None:
        self.work, self.emit = work, emit
        self._pending: tuple[Path, SaveRequest] | None = None
        self._busy = False
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="upload", daemon=True)
        self._closed = False
        self._thread.start()

    def offer(self, staged: Path, request: SaveRequest) -> None:
        with self._ready:
            if self._pending is not None:
                older, old_request = self._pending
                shutil.rmtree(older, ignore_errors=True)
                self.emit(Coalesced(old_request.step, request.step))
            self._pending = (staged, request)
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while self._pending is None and not self._closed:
                    self._ready.wait()
                if self._pending is None:
                    return
                (staged, request), self._pending = self._pending, None
            self.work.publish(staged, request)

    def close(self) -> None:
        """Finish the upload in flight and the pending one, then stop."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join()


def _receive(inbox: BinaryIO) -> object | None:
    try:
        return pickle.load(inbox)
    except EOFError:
        return None


def serve(inbox: BinaryIO, outbox: BinaryIO) -> None:
    setup = _receive(inbox)
    if not isinstance(setup, WriterSetup):
        return
    sending = threading.Lock()

    def emit(event: Event) -> None:
        with sending, contextlib.suppress(OSError):  # a parent that is gone reads no events
            pickle.dump(event, outbox)
            outbox.flush()

    durable = None
    if setup.durable is not None:
        durable = Checkpointer(open_store(setup.durable), setup.durable.keep_last, setup.cache, setup.fence)
    snapshots = setup.snapshots.checkpointer() if setup.snapshots is not None else None
    work = SaveWork(durable, snapshots, setup.attempts, emit)
    sys.addaudithook(_counting_sends(work))
    reader = SharedStateReader()
    with writer_lock(setup.cache, LOCK_WAIT_S):
        emit(Progress(0, "ready", 0, 0))  # started: the training process's watch hears it
        beating = threading.Event()
        threading.Thread(target=_heartbeat, args=(work, emit, beating), name="progress", daemon=True).start()
        uploads = Uploads(work, emit)
        while (message := _receive(inbox)) is not None:
            if isinstance(message, Republish):
                uploads.offer(_adopted(durable, message), message.request)
                continue
            request, shared = message
            staged = work.stage(reader.open(shared), request)
            if staged is not None:
                uploads.offer(staged, request)
        uploads.close()
        beating.set()


def _heartbeat(work: SaveWork, emit: Callable[[Event], None], stop: threading.Event) -> None:
    """Where the work stands, every PROGRESS_EVERY_S while there is work: a writer that is
    alive says so even while a request waits on the server, and a frozen one says nothing."""
    while not stop.wait(PROGRESS_EVERY_S):
        if (current := work.current()) is not None:
            emit(current)


def _counting_sends(work: SaveWork) -> Callable[[str, tuple], None]:
    """An audit hook (this process's own, for its life) that hands `work` the size of each
    block http.client sends: an upload's progress as the network takes it, block by block
    (16 KiB through urllib3), where boto3's callback fires per 256 KiB read into its buffers
    (s3transfer/upload.py AggregatedProgressCallback) and so runs ahead of a slow link."""

    def hook(event: str, args: tuple) -> None:
        if event == "http.client.send":
            work.sent(len(args[1]))

    return hook


def _adopted(durable: Checkpointer, message: Republish) -> Path:
    """The replaced writer's staged folder, as this writer's own (hard links: the training
    process removes the original once the step is over)."""
    return durable.adopt(message.request.step, message.staged)


@contextmanager
def writer_lock(cache: Path, timeout_s: float) -> Iterator[bool]:
    """This node's writer lock for a checkpoint location (in its node-local cache folder):
    a writer holds it until its last snapshot and upload are done, and a (re)starting run
    takes it before it takes the lease, cleans staging and looks for a resume point, so that
    a writer of a killed attempt finishes its publish (not fenced out, nothing removed under
    it) and the new attempt sees it and never writes beside it. True once held; False if
    `timeout_s` ran out first (the run goes on without it).

    The holder removes the lock file as it lets go, and the cache folder with it where that
    is empty (a local location downloads nothing): a plain run leaves no folder behind. So a
    taker checks, once it holds the lock, that the file it locked is still the one at the
    path; one that a leaving holder removed is given up, and the path tried again."""
    deadline = time.monotonic() + timeout_s
    path = cache / LOCK_FILE
    while True:
        with _opened(path) as handle:
            if not _flock(handle, deadline):
                yield False
                return
            if not _locked_the_path(handle, path):
                continue
            try:
                yield True
            finally:
                path.unlink(missing_ok=True)  # while held: a taker waiting on it tries again
                with contextlib.suppress(OSError):
                    cache.rmdir()
            return


def _opened(path: Path) -> BinaryIO:
    """The lock file, made if need be, with its folder."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return open(path, "a+b")
        except FileNotFoundError:  # the folder went between the two lines: a holder leaving
            continue


def _flock(handle: BinaryIO, deadline: float) -> bool:
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def _locked_the_path(handle: BinaryIO, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


def run(inbox: BinaryIO, outbox: BinaryIO) -> int:
    """The writer's life, in whichever process it started (writer_start.py)."""
    for name in ("SIGINT", "SIGTERM"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    serve(inbox, outbox)
    return 0


def main() -> int:
    """A writer started as a new interpreter: its events on its stdout."""
    outbox = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # anything printed must not corrupt the event stream
    return run(sys.stdin.buffer, outbox)
