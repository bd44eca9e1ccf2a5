"""A superseded job never writes again: the store refuses its late writes, and its restarts
are refused.

Job A trains on an S3 prefix (moto) through a proxy. Its next write of latest.json is held
in the network while A's whole process tree is paused (SIGSTOP). A's lease goes stale; job
B takes the location over and trains to its end. Then the held request arrives: the store
refuses it (412), for it was made against a version B has replaced. Then A thaws: its ranks
find the lease gone and stop (exit 2), and plain torchrun's restarts of the same job are
refused as superseded, although B has released the lease. Nothing in the store changes
after B's end (benchmarks.storage_trials.zombie_trial, which the fault trials run)."""

from __future__ import annotations

import pytest

from benchmarks.storage_trials import S3Target, zombie_trial


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_superseded_jobs_delayed_write_is_refused_and_its_restarts_write_nothing(s3_bucket, workdir):
    trial = zombie_trial(workdir, S3Target(s3_bucket.endpoint, s3_bucket.name, s3_bucket.env))
    assert trial.held_status == 412, trial.describe(0)  # refused by the store itself
    assert trial.b_code == 0 and trial.b_took_over, trial.describe(0)
    assert trial.store_step == trial.b_final and trial.store_epoch == 2, trial.describe(0)
    assert trial.a_code != 0 and trial.a_lost_line, trial.a_text[-3000:]
    assert trial.a_refused_restart, trial.a_text[-3000:]  # its torchrun's restarts, refused
    assert trial.unchanged_after_b, trial.describe(0)  # A wrote nothing more
    assert trial.passed()
