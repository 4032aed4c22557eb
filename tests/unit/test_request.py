"""trainer.train_run: what `memplan train` runs is resolved in the library from a TrainRequest (flags as values),
with no command line involved; the CLI only maps flags to the request and renders what the resolution says."""

from __future__ import annotations

import json

import pytest

from memplan.errors import InputError
from memplan.planning import SetupAsked
from trainer import data
from trainer.train_run import ResolvedTrain, TrainRequest, TrainUI, resolve_train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = dict(arch="llama", layers=2, hidden=64, heads=2, kv_heads=2, ffn=128)  # as typer passes them
CONTROL = dict(max_steps=3, max_tokens=None, max_minutes=None, save_every=None, eval_every=None, keep=None,
               eval_batches=None, sample_tokens=0, prompts=None, max_nonfinite=None, verify_data=None)
HYPER = dict(lr=None, warmup_steps=None, min_lr_ratio=None, weight_decay=None, clip=None, seed=None)


class Recorder(TrainUI):
    def __init__(self):
        self.lines: list[str] = []

    def say(self, text: str, soft_wrap: bool = False) -> None:
        self.lines.append(text)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "s.jsonl").write_text("".join(json.dumps({"text": f"Story {i}: a fox met an owl by the river. " * 4})
                                          + "\n" for i in range(200)))
    out = root / "prepared"
    data.prepare(data.resolve_inputs([str(root / "s.jsonl")]), out,
                 data.PrepareConfig(tokenizer="bpe:300", workers=1, val_fraction=0.1))
    return out


def request(corpus, tmp_path, **changes) -> TrainRequest:
    base = dict(data=str(corpus), out=str(tmp_path / "run"), model=MODEL, control=CONTROL, hyper=HYPER,
                device="cpu", margin=0.1,
                setup=SetupAsked(ctx=64, batch=4, precision="fp32"))
    return TrainRequest(**{**base, **changes})


def test_a_request_with_its_setup_resolves_to_that_plan_and_writes_nothing(corpus, tmp_path):
    ui = Recorder()
    run = resolve_train(request(corpus, tmp_path), ui)
    assert isinstance(run, ResolvedTrain) and not run.resume and run.starting is None
    s = run.plan.setup
    assert (s.ctx, s.micro_batch, s.grad_accum, s.precision) == (64, 4, 1, "fp32")
    assert run.plan.model.vocab == run.prepared.vocab_size  # the vocabulary comes from the data
    assert run.plan.predicted["peak_reserved"] > 0
    assert run.overrides["max_steps"] == 3
    assert not (tmp_path / "run").exists()  # resolving writes nothing; the trainer does
    assert ui.lines == []  # a given precision: nothing to say


def test_a_request_without_a_setup_is_autotuned_and_says_what_it_chose(corpus, tmp_path):
    ui = Recorder()
    run = resolve_train(request(corpus, tmp_path, setup=SetupAsked(ctx=64)), ui)
    assert run.plan.setup.ctx == 64 and run.plan.predicted["tokens_per_second"] > 0
    given = resolve_train(request(corpus, tmp_path, setup=SetupAsked(ctx=64, batch=2)), ui)
    assert any("precision" in line for line in ui.lines)  # not given: the profile's best, said once
    assert given.plan.setup.micro_batch == 2


def test_request_refusals_are_input_errors_before_anything_runs(corpus, tmp_path):
    with pytest.raises(InputError, match="not both"):
        resolve_train(request(corpus, tmp_path, plan="plan.toml"), TrainUI())
    with pytest.raises(InputError, match="--out RUN"):
        resolve_train(request(corpus, tmp_path, resume=True, out=None), TrainUI())
    with pytest.raises(InputError, match="drop --from"):
        resolve_train(request(corpus, tmp_path, model={}, from_="x", resume=True), TrainUI())
    assert not (tmp_path / "run").exists()


def test_every_plan_carries_the_same_prediction_table(corpus, tmp_path):
    """A plan from flags, one rescaled for N processes and autotune's: one Prediction, one [predicted] table."""
    from memplan.autotune import autotune
    from memplan.hardware import load_profile
    from memplan.prediction import predict
    from memplan.planning import for_world

    run = resolve_train(request(corpus, tmp_path), TrainUI())
    p = run.plan
    assert p.predicted == predict(p.model, p.setup, run.profile).plan_table()
    assert set(p.predicted) == {"peak_reserved", "step_seconds", "tokens_per_second", "peak_allocated", "peak_phase"}
    two = for_world(p, 2, "ddp", run.profile)
    assert two.predicted == predict(two.model, two.setup, run.profile).plan_table()
    tuned = autotune(p.model, load_profile("cpu"), ctx=64, global_batch_tokens=256).plan
    assert set(tuned.predicted) == set(p.predicted)
