"""The ring all-reduce model behind `estimate`."""

import math

import pytest

from operator_scripts.reports.estimate import (
    PRESETS,
    Interconnect,
    ddp_buckets,
    hook_bytes,
    limit,
    main,
    predict,
    ring_allreduce_seconds,
    step_allreduces,
)

LINK = Interconnect("test", bandwidth=10e9, latency=10e-6)


def test_ring_allreduce_moves_2_n_minus_1_over_n_of_the_bytes():
    assert ring_allreduce_seconds(1e9, 1, LINK) == 0
    buckets = 1 + math.ceil((1e9 - 2**20) / (25 * 2**20))  # DDP: 1 MiB first, then 25 MiB
    assert ddp_buckets(1e9) == buckets == 40 and ddp_buckets(2**20) == 1 and ddp_buckets(2**20 + 1) == 2
    assert math.isclose(ring_allreduce_seconds(1e9, 2, LINK), 1e9 / 10e9 + 2 * 10e-6 * buckets)
    assert math.isclose(ring_allreduce_seconds(1e9, 8, LINK), 14 / 8 * 0.1 + 14 * 10e-6 * buckets)


def test_speedup_without_and_with_overlap():
    comm = 0.1 + 2 * 10e-6 * 40  # 1 GB at 10 GB/s, two hops' latency for each of 40 buckets
    plain = predict(0.1, 1e9, 2, LINK, overlap=False)
    assert math.isclose(plain.step_seconds, 0.1 + comm)
    assert math.isclose(plain.speedup, 2 * 0.1 / (0.1 + comm))
    hidden = predict(0.1, 1e9, 2, LINK, overlap=True)  # backward (2/3 of 0.1 s) hides most of it
    assert math.isclose(hidden.step_seconds, 0.1 + comm - 0.1 * 2 / 3)
    small = predict(0.1, 1e6, 8, LINK, overlap=True)
    assert small.speedup == pytest.approx(8) and small.efficiency == pytest.approx(1)


def test_cli_prints_a_row_per_device_count(capsys):
    assert (
        main(["--step-ms", "50", "--grad-mb", "100", "--devices", "2", "16", "--interconnect", "eth-25g"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("eth-25g: 3.1 GB/s") and len(lines) == 5  # heading, 2 rows, the answer
    assert lines[-1].startswith("at 16 devices the step is")
    assert set(PRESETS) >= {"nvlink4", "pcie4", "ib-ndr400", "eth-100g"}


def test_ddp_ops_estimate(capsys):
    from operator_scripts.cli import main as ddp_ops

    assert ddp_ops(["estimate", "--step-ms", "20", "--grad-mb", "10", "--devices", "4"]) == 0
    assert "nvlink4" in capsys.readouterr().out


def test_what_each_hook_sends():
    shapes = [(512, 256), (512,), (8, 4)]  # a matrix, a vector, a matrix too small to compress
    elements = 512 * 256 + 512 + 8 * 4
    assert hook_bytes("none", shapes) == 4 * elements
    assert hook_bytes("bf16", shapes) == hook_bytes("fp16", shapes) == 2 * elements
    # PowerSGD at rank 2: (512 + 256) x 2 floats for the matrix; 8 x 4 = 32 is under twice
    # (8 + 4) x 2 = 48, so it goes whole, as the vector does
    assert hook_bytes("powersgd", shapes, rank=2) == 4 * ((512 + 256) * 2 + 512 + 32)


def test_a_hook_pays_latency_per_call_of_its_fp32_buckets():
    # bf16 halves the bytes, not the calls: DDP buckets the fp32 gradients (1 MiB, then 25 MiB)
    assert step_allreduces("bf16", 100e6) == step_allreduces("none", 100e6) == ddp_buckets(100e6) == 5
    assert step_allreduces("none", 100e6, bucket_cap_mb=100) == 2
    # PowerSGD: the trainer's one bucket, reduced in three calls (vectors, P, Q)
    assert step_allreduces("powersgd", 100e6) == 3
    slow = Interconnect("far", 1e9, 10e-3)  # 10 ms a hop: the calls dominate
    assert math.isclose(ring_allreduce_seconds(1e6, 2, slow, allreduces=3), 1e6 / 1e9 + 2 * 10e-3 * 3)
    assert predict(0.1, 1e6, 2, slow, overlap=False, allreduces=3).comm_seconds == pytest.approx(0.061)


def test_the_answer_names_what_limits_the_speedup_first(capsys):
    slow_link = predict(0.05, 100e6, 64, Interconnect("1g", 0.125e9, 50e-6), overlap=True)
    assert "first: communication" in limit(slow_link, 0.0)
    fast = predict(0.05, 1e6, 64, PRESETS["nvlink4"], overlap=True)
    assert "first: compute" in limit(fast, 0.0) and "first: data loading" in limit(fast, 0.02)
    assert main(["--step-ms", "50", "--grad-mb", "100", "--devices", "2", "--link-gbit", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("1 Gbit/s link: 0.125 GB/s") and out[-1].startswith("at 2 devices")
    halved = main(
        ["--step-ms", "50", "--grad-mb", "100", "--devices", "2", "--link-gbit", "1", "--comm-hook", "bf16"]
    )
    assert halved == 0 and "50.0 MB of gradients" in capsys.readouterr().out


def test_a_negative_data_wait_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--step-ms", "5", "--grad-mb", "1", "--data-ms", "-3"])
    assert exit.value.code == 2
    assert "argument --data-ms: '-3': must be 0 or more" in capsys.readouterr().err


def test_one_bandwidth_only(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--step-ms", "5", "--grad-mb", "1", "--link-gbit", "10", "--bandwidth-gbs", "3"])
    assert exit.value.code == 2
    assert "--bandwidth-gbs 3 and --link-gbit 10: give one" in capsys.readouterr().err


def test_each_row_splits_the_ring_into_its_bytes_and_its_latency_and_names_the_larger(capsys):
    """The latency term grows as 2(N-1) hops per bucket; the bytes' term levels off at twice
    the gradients over the bandwidth: the small model turns latency-bound with N."""
    from operator_scripts.reports.estimate import ring_terms

    link = Interconnect("eth", bandwidth=12.5e9, latency=20e-6)
    small, big = ring_terms(0.2e6, 1024, link), ring_terms(944e6, 8, link)
    assert small.dominant == "latency" and math.isclose(small.latency_seconds, 2 * 1023 * 20e-6)
    assert big.dominant == "bandwidth" and math.isclose(big.bandwidth_seconds, 14 / 8 * 944e6 / 12.5e9)
    main(["--step-ms", "3.5", "--grad-mb", "0.2", "--devices", "2", "1024", "--link-gbit", "1"])
    rows = capsys.readouterr().out.splitlines()[2:4]
    assert rows[0].split()[0] == "2" and "bandwidth)" in rows[0]
    assert rows[1].split()[0] == "1024" and "latency)" in rows[1]
