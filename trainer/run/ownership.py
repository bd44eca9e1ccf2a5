"""Who owns the checkpoint location: rank 0 takes its lease before writing anything, after a
killed attempt's writer has finished (the writer lock), refuses to write over another run's
checkpoints, fences `latest.json` on a takeover, and finds the run's lineage; at the end it
lets the lease go."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.checkpoint.lease import Lease, job_id
from trainer.checkpoint.manager import LATEST_FILE, Checkpointer
from trainer.checkpoint.writer_process import writer_lock
from trainer.config import Config, ConfigError
from trainer.loop.preemption import LEASE_LOST, StopSignal


@dataclass
class Ownership:
    """Rank 0's hold on the location (empty on the other ranks): its lease, the lineage
    it writes under, and `latest.json` as it was when the lease was taken."""

    checkpointer: Checkpointer
    lineage: str | None = None
    lease: Lease | None = None
    latest_at_start: tuple[bytes, str] | None = None

    def let_go(self) -> None:
        """Release the lease; a run that published nothing gives it back as it found it."""
        if self.lease is None:
            return
        if self.checkpointer.store.get_versioned(LATEST_FILE) == self.latest_at_start:
            self.lease.give_back()
        else:
            self.lease.release()


def take_location(
    config: Config, run_id: str, checkpointer: Checkpointer, stop: StopSignal, wait_s: float
) -> Ownership:
    """Probe the store, take its lease before writing anything, then clean up and find the
    lineage. Raises ConfigError, holding no lease then."""
    ownership = Ownership(checkpointer)
    checkpointer.store.prepare()
    lease = None
    if config.checkpoint.lease:
        lease = Lease(checkpointer.store, job_id(run_id), run_id, config.checkpoint.lease_s)
        lease.refuse_if_taken()  # another job's: refused at once, not after the wait below
    # a killed attempt's writer may still be publishing (under the lease it was given) from
    # its staging folders: it finishes before this attempt takes the lease and cleans up
    with writer_lock(checkpointer.cache, wait_s):
        if lease is not None:
            ownership.lease = hold_lease(lease, checkpointer, stop)
        try:
            checkpointer.store.clean_staging(checkpointer.cache)
            refuse_overwrite(config, checkpointer)
            ownership.latest_at_start = checkpointer.store.get_versioned(LATEST_FILE)
            if ownership.lease is not None and ownership.lease.took_over:
                checkpointer.fence_latest()  # the superseded run's late write of it is refused from now on
            ownership.lineage = checkpointer.lineage(fresh=not config.checkpoint.resume)
        except BaseException:
            if ownership.lease is not None:
                ownership.lease.give_back()  # refused before writing: the lease as it was found
            raise
    return ownership


def hold_lease(lease: Lease, checkpointer: Checkpointer, stop: StopSignal) -> Lease:
    """Rank 0's hold on the checkpoint location (ConfigError naming a live owner): every
    commit is fenced by it, and losing it stops the run."""
    lease.acquire()
    checkpointer.fence = lease.fence
    lease.start(on_lost=lambda owner: stop.request(LEASE_LOST, owner))
    return lease


def refuse_overwrite(config: Config, checkpointer: Checkpointer) -> None:
    """A fresh start must not write over checkpoints another run saved."""
    if config.checkpoint.resume:
        return
    steps = checkpointer.store.steps()  # not only what latest.json names: it may be gone
    if steps or checkpointer.committed_step() is not None:
        newest = max(steps) if steps else checkpointer.committed_step()
        raise ConfigError(
            "checkpoint.resume",
            False,
            f"{config.checkpoint.uri} already holds checkpoints up to step {newest}; "
            "set checkpoint.resume=true or choose another checkpoint.uri",
        )


def lease_lost(config: Config, stop: StopSignal, step: int) -> ConfigError:
    """What a run says that stopped because another run took its checkpoint location: a
    permanent error, since a retry would be refused the lease."""
    return ConfigError(
        "checkpoint.uri",
        config.checkpoint.uri,
        f"another run holds its lease now ({stop.detail}); this run stopped at step {step} "
        "and publishes nothing more",
    )
