"""Config loading and the promise that every bad value stops the run with one clear line."""

import pickle
from pathlib import Path

import pytest
import torch
import yaml
from conftest import HELPERS

from trainer.checkpoint.manager import CheckpointError
from trainer.cli import main
from trainer.config import ConfigError, bundled_config_names, dump_yaml, load_config, to_tree
from trainer.data.base import DataError


def test_defaults_are_the_digits_demo():
    config = load_config(None)
    assert (config.data.name, config.model.name) == ("digits", "cnn")
    assert config.train.batch_size > 0


def test_design_keys_exist():
    tree = to_tree(load_config(None))
    for key in [
        "data.name",
        "model.name",
        "train.epochs",
        "train.max_steps",
        "train.batch_size",
        "train.grad_accum_steps",
        "train.amp",
        "train.clip_grad_norm",
        "optim.lr",
        "optim.lr_scaling",
        "optim.warmup_steps",
        "checkpoint.uri",
        "checkpoint.every_steps",
        "checkpoint.keep_last",
        "log.format",
        "seed",
    ]:
        node = tree
        for part in key.split("."):
            assert part in node, key
            node = node[part]


def test_every_bundled_config_loads():
    assert "digits" in bundled_config_names()
    for name in bundled_config_names():
        load_config(name)


def test_file_then_overrides_in_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  batch_size: 8\n  epochs: 2\noptim:\n  lr: 1.0e-3\n")
    config = load_config(str(path), ["train.batch_size=16", "optim.lr=3e-4", "train.batch_size=24"])
    assert (config.train.batch_size, config.train.epochs, config.optim.lr) == (24, 2, 3e-4)


def test_print_config_round_trips(capsys, tmp_path):
    assert main(["--config", "digits", "--set", "train.epochs=3", "--print-config"]) == 0
    printed = capsys.readouterr().out
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed)
    assert load_config(str(saved)) == load_config("digits", ["train.epochs=3"])
    assert yaml.safe_load(printed)["train"]["epochs"] == 3
    assert printed == dump_yaml(load_config("digits", ["train.epochs=3"]))


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(ConfigError, match=r"did you mean train\.batch_size\?"):
        load_config(None, ["train.bach_size=3"])


@pytest.mark.parametrize(
    ("override", "suggested"),
    [
        ("optim.name=adamww", "did you mean 'adamw'? must be 'adamw' or 'sgd'"),
        ("train.amp=bf61", "did you mean 'bf16'? must be 'auto', 'off', 'bf16' or 'fp16'"),
        ("checkpoint.snapshot_every_steps=aut", "did you mean 'auto'? must be 'auto' or"),
    ],
)
def test_a_mistyped_choice_suggests_the_nearest(override, suggested):
    with pytest.raises(ConfigError) as raised:
        load_config(None, [override])
    assert suggested in str(raised.value)


def test_a_choice_near_none_gets_no_suggestion():
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["train.amp=zzz"])
    assert str(raised.value) == "train.amp='zzz': must be 'auto', 'off', 'bf16' or 'fp16'"


@pytest.mark.parametrize("kind", [ConfigError, CheckpointError, DataError])
def test_an_error_survives_the_pickle_a_broadcast_sends_it_in(kind):
    """Rank 0 decides a resume fails and broadcasts the error object to every rank."""
    error = kind("checkpoint.uri", "s3://b/run", "finding the resume step took longer than 10s")
    received = pickle.loads(pickle.dumps(error))
    assert type(received) is kind and str(received) == str(error) and received.key == "checkpoint.uri"


CONFIGS = HELPERS / "configs"
BAD = [
    (["--set", "train.batch_size=0"], "train.batch_size=0", "greater than 0"),
    (["--set", "train.batch_size=-4"], "train.batch_size=-4", "greater than 0"),
    (["--set", "train.grad_accum_steps=0"], "train.grad_accum_steps=0", "greater than 0"),
    (["--set", "train.batchsize=3"], "train.batchsize=3", "did you mean train.batch_size"),
    (["--set", "train.epochs=ten"], "train.epochs='ten'", "valid integer"),
    (["--set", "train.amp=fp32"], "train.amp='fp32'", "'auto', 'off', 'bf16' or 'fp16'"),
    (["--set", "train.amp=fp16,train.device=cpu"], "train.amp='fp16'", "needs a CUDA device"),
    (["--set", "train.device=cuda"], "train.device='cuda'", "no CUDA device"),  # where there is none
    (["--set", "optim.lr=0"], "optim.lr=0", "greater than 0"),
    (["--set", "optim.lr=-1"], "optim.lr=-1", "greater than 0"),
    (["--set", "optim.lr_scaling=cubic"], "optim.lr_scaling='cubic'", "'none', 'linear' or 'sqrt'"),
    (["--set", "data.name=imagenet"], "data.name='imagenet'", "allowed: digits, mnist, shards, synthetic"),
    (["--set", "model.name=resnet9000"], "model.name='resnet9000'", "allowed: cnn, mlp, transformer"),
    (["--set", "model.name=no_such_pkg.mod:build"], "model.name='no_such_pkg.mod:build'", "cannot import"),
    (["--set", "checkpoint.uri=gs://bucket/run"], "checkpoint.uri='gs://bucket/run'", "unsupported scheme"),
    (["--set", "data.name=mnist"], "data.path=''", "MNIST IDX files"),
    (["--set", "ddp.comm_hook=bf17"], "ddp.comm_hook='bf17'", "'none', 'bf16', 'fp16' or 'powersgd'"),
    (["--set", "ddp.powersgd_start_step=1"], "ddp.powersgd_start_step=1", "greater than or equal to 2"),
    (["--set", "ddp.bucket_cap_mb=0"], "ddp.bucket_cap_mb=0", "greater than 0"),
    (
        ["--set", "ddp.comm_hook=powersgd,ddp.static_graph=true"],
        "ddp.static_graph=True",
        "must be false with ddp.comm_hook=powersgd",
    ),
    (["--set", "train.batch_size=5000"], "train.batch_size=5000", "too large"),
    (["--set", "model.name=transformer"], "model.name='transformer'", "needs language_modeling data"),
    (["--config", "no-such-config"], "--config='no-such-config'", "bundled configs are: digits"),
    (["--set", "train..x=1"], "--set='train..x=1'", "empty key"),
    (["--config", str(CONFIGS / "empty.yaml")], "empty.yaml'", "is empty; give it a section"),
    (["--config", str(CONFIGS / "short-betas.yaml")], "optim.betas=[0.9]", "must be a list of 2 numbers"),
    (
        ["--set", "model.name=plugins:wrong_signature"],
        "model.name='plugins:wrong_signature'",
        "cannot be called as wrong_signature(config, spec): too many positional",
    ),
    (
        ["--bogus"],
        "python -m trainer: error: unrecognized arguments: --bogus",
        "see python -m trainer --help",
    ),
]


def bad_case(argv: list[str], named: str, allowed: str):
    """One BAD row; asking for CUDA is a mistake only on a host without it."""
    cuda = "train.device=cuda" in argv and torch.cuda.is_available()
    marks = [pytest.mark.skip(reason="this host has a CUDA device")] if cuda else []
    return pytest.param(argv, named, allowed, id=" ".join(argv), marks=marks)


@pytest.mark.parametrize(("argv", "named", "allowed"), [bad_case(*case) for case in BAD])
def test_bad_values_exit_2_with_one_line_and_touch_nothing(
    argv, named, allowed, capsys, workdir, monkeypatch
):
    monkeypatch.chdir(workdir)
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own exit
        code = exit.code
    assert code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert named in lines[0] and allowed in lines[0], lines[0]
    assert captured.out == ""
    assert list(Path(workdir).iterdir()) == []


def test_fresh_start_refuses_to_overwrite_saved_checkpoints(capsys, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    saved = workdir / "ckpt"
    (saved / "step-5").mkdir(parents=True)
    (saved / "latest.json").write_text('{"step": 5}')
    before = sorted(p.name for p in saved.rglob("*"))
    argv = ["--set", "checkpoint.uri=ckpt", "--set", "checkpoint.resume=false"]
    assert main(argv) == 2
    assert "checkpoint.resume=False" in capsys.readouterr().err
    assert sorted(p.name for p in saved.rglob("*")) == before
    assert (saved / "latest.json").read_text() == '{"step": 5}'
