"""`--set` parsing follows Helm's strvals rules."""

import pytest
from helm_python import parse_set_string

from trainer.config.overrides import OverrideError, deep_merge, parse_set, typed_scalar


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("true", True),
        ("False", False),
        ("null", None),
        ("42", 42),
        ("-3", -3),
        ("0", 0),
        ("007", "007"),
        ("3e-4", "3e-4"),
        ("0.5", "0.5"),
        ("s3://b/p", "s3://b/p"),
    ],
)
def test_scalars_are_typed_like_helm(text, value):
    assert typed_scalar(text) == value
    assert type(typed_scalar(text)) is type(value)


def test_nested_keys_lists_indices_and_several_pairs():
    tree = parse_set("train.batch_size=16,optim.betas={0.9,0.95},data.options.files[1]=b")
    assert tree == {
        "train": {"batch_size": 16},
        "optim": {"betas": ["0.9", "0.95"]},
        "data": {"options": {"files": [None, "b"]}},
    }


def test_escapes_keep_commas_dots_and_equals_in_values():
    tree = parse_set(r"data.options.name=a\,b\=c,data.options.dotted\.key=1")
    assert tree == {"data": {"options": {"name": "a,b=c", "dotted.key": 1}}}


def test_values_may_contain_equals_signs():
    assert parse_set("checkpoint.uri=/tmp/x=y") == {"checkpoint": {"uri": "/tmp/x=y"}}


@pytest.mark.parametrize("expression", ["train.batch_size", "a..b=1", "=3"])
def test_malformed_expressions_are_rejected(expression):
    with pytest.raises(OverrideError):
        parse_set(expression)


def test_deep_merge_replaces_leaves_and_merges_sections():
    base = {"train": {"epochs": 3, "amp": "off"}, "seed": 1}
    merged = deep_merge(base, {"train": {"epochs": 5}, "seed": 2})
    assert merged == {"train": {"epochs": 5, "amp": "off"}, "seed": 2}
    assert base["train"]["epochs"] == 3


@pytest.mark.parametrize(
    "expression",
    [
        "train.batch_size=16,optim.lr=3e-4",
        "a.b.c=true,a.d=null,a.e=007,a.f=-3",
        "optim.betas={0.9,0.95}",
        r"data.options.name=a\,b,data.options.x\.y=1",
        "list[1].name=b,list[0]=a",
        "uri=s3://bucket/prefix=1",
    ],
)
def test_same_result_as_helms_own_parser(expression):
    """helm-python-sdk runs Helm's strvals parser; ours must agree (it is not a runtime
    dependency of the trainer image, hence a parser of our own)."""
    assert parse_set(expression) == parse_set_string(expression)


def test_an_empty_list_is_empty_unlike_helm():
    assert parse_set("x={}") == {"x": []}  # Helm gives [""]; an empty list is what users mean


def test_the_environments_overrides_come_last_so_a_kubeflow_sdk_job_can_set_the_config(monkeypatch):
    """TRAINER_SET: what a TrainJob made with the SDK's CustomTrainerContainer (env only) can
    change of the runtime's config; after the command line's, so it wins."""
    from trainer.config import load_config
    from trainer.run.arguments import parse_args

    monkeypatch.setenv("TRAINER_SET", "checkpoint.uri=s3://b/sdk-run-7,train.epochs=2")
    args = parse_args(["--set", "train.epochs=5,train.max_steps=9"])
    config = load_config(args.config, args.overrides)
    assert (config.checkpoint.uri, config.train.epochs, config.train.max_steps) == ("s3://b/sdk-run-7", 2, 9)
    monkeypatch.setenv("TRAINER_SET", " ")
    assert parse_args([]).overrides == []
