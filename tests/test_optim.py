"""Global batch arithmetic, LR scaling and the schedule's shape."""

import itertools
import math

import pytest

from trainer.config import OptimConfig, TrainConfig
from trainer.loop.optim import batch_math, lr_factor


def test_global_batch_is_per_rank_times_ranks_times_accumulation():
    math_ = batch_math(TrainConfig(batch_size=32, grad_accum_steps=1), OptimConfig(), world_size=4)
    assert math_.global_batch == 128
    assert "32 per rank x 4 ranks x 1 accumulation = 128" in math_.describe()


@pytest.mark.parametrize(("rule", "expected"), [("none", 0.1), ("linear", 0.4), ("sqrt", 0.2)])
def test_lr_scales_to_the_global_batch(rule, expected):
    optim = OptimConfig(lr=0.1, lr_scaling=rule, reference_batch_size=64)
    math_ = batch_math(TrainConfig(batch_size=64, grad_accum_steps=2), optim, world_size=2)
    assert math_.global_batch == 256
    assert math.isclose(math_.lr, expected)


def test_warmup_rises_linearly_then_cosine_reaches_the_floor():
    config = OptimConfig(warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    factors = [lr_factor(step, 20, config) for step in range(21)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert factors[4] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(factors[4:]))
    assert math.isclose(factors[20], 0.1)


def test_step_schedule_decays_every_n_steps_after_warmup():
    config = OptimConfig(warmup_steps=2, schedule="step", step_every=5, step_gamma=0.5)
    assert [lr_factor(s, 100, config) for s in (2, 6, 7, 12)] == [1.0, 1.0, 0.5, 0.25]


def test_constant_schedule_stays_at_peak():
    config = OptimConfig(warmup_steps=0, schedule="constant")
    assert {lr_factor(s, 10, config) for s in range(10)} == {1.0}
