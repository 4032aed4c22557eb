"""memplan.cli.options: an option is declared once, a group of them (MODEL, SETUP, DEVICE, RUN) is spread into
every command that takes it by ``@with_groups``, and a command hands the trainer typed values, not text."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import typer
from typer.testing import CliRunner

from memplan.cli import app
from memplan.cli.options import DeviceFlags, ModelFlags, SetupFlags, with_groups
from memplan.planning import SetupAsked


def test_a_group_is_spread_into_the_signature_and_handed_back_as_one_typed_object():
    seen = {}

    @with_groups
    def command(model: ModelFlags = None, setup: SetupFlags = None, device: DeviceFlags = None, json: bool = False):
        seen.update(model=model, setup=setup, device=device, json=json)

    names = list(inspect.signature(command).parameters)
    fields = [f.name for cls in (ModelFlags, SetupFlags, DeviceFlags) for f in dataclasses.fields(cls)]
    assert names == [*fields, "json"]  # in the groups' order: what --help lists
    small = typer.Typer()
    small.command()(command)
    result = CliRunner().invoke(small, ["--layers", "2", "--ctx", "8k", "--device", "cpu", "--tied"])
    assert result.exit_code == 0, result.output
    assert seen["model"] == ModelFlags(layers=2, tied=True) and seen["model"].given
    assert seen["setup"].ctx == "8k" and seen["setup"].setup().ctx == 8192
    assert seen["device"] == DeviceFlags(device="cpu") and seen["json"] is False


def test_a_name_taken_twice_is_refused_when_the_command_is_declared():
    def twice(model: ModelFlags = None, layers: int = 0):
        pass

    with pytest.raises(TypeError, match="'layers' is taken twice"):
        with_groups(twice)


def test_the_model_options_are_one_declaration_in_every_command_that_takes_them():
    """estimate, autotune, trace, sweep and train offer MODEL as the same options: same flags, help and panel."""
    import typer.main

    click_app = typer.main.get_command(app)
    expected = None
    for name in ("estimate", "autotune", "trace", "sweep", "train"):
        params = {p.name: p for p in click_app.commands[name].params}
        model = [(p.opts, p.secondary_opts, p.help, getattr(p, "rich_help_panel", None))
                 for f in dataclasses.fields(ModelFlags) for p in [params[f.name]]]
        expected = expected or model
        assert model == expected, name


def test_train_hands_the_trainer_typed_values(monkeypatch):
    """`memplan train --ctx 8k --batch 4 --budget 6GiB ...`: the request holds ints and floats (the planner parses
    no text), and a bad count is still one line naming its option."""
    from trainer import train_run

    asked = {}

    def resolve(request, ui):
        asked["request"] = request
        raise typer.Exit(0)

    monkeypatch.setattr(train_run, "resolve_train", resolve)
    result = CliRunner().invoke(app, ["train", "--layers", "2", "--ctx", "8k", "--batch", "4", "--grad-accum", "2",
                                      "--budget", "6GiB", "--margin", "0.2", "--global-batch-tokens", "16k",
                                      "--lr", "1e-3", "--warmup", "10", "--max-steps", "5", "--seed", "7"])
    assert result.exit_code == 0, result.output
    req = asked["request"]
    assert req.setup == SetupAsked(ctx=8192, batch=4, grad_accum=2) and req.setup.given
    assert (req.budget_bytes, req.margin, req.global_batch_tokens) == (6 << 30, 0.2, 16_000)
    assert req.model["layers"] == 2 and req.model["params"] is None
    assert (req.hyper["lr"], req.hyper["warmup_steps"], req.hyper["seed"]) == (1e-3, 10, 7)
    assert req.control["max_steps"] == 5 and req.control["max_tokens"] is None
    bad = CliRunner().invoke(app, ["train", "--layers", "2", "--batch", "four"])
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--batch" in bad.stderr
    assert "request" in asked and bad.stderr.startswith("memplan: error")
