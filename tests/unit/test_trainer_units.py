"""The units the trainer composes, each alone: the schedule (trainer/schedule.py), the stop decisions
(trainer/stopping.py), evaluation (trainer/loop_eval.py), the checkpoint manager (trainer/checkpoint_policy.py) and the
factories of what is trained (trainer/task.py, trainer/finetune.py's ``finetune_task``)."""

import errno
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from memplan.errors import InputError
from memplan.setup import TrainSetup
from trainer import records
from trainer.schedule import (Schedule, cadence, decayed, default_eval_every, default_warmup, new_schedule,
                              probed_length, refitted, steps_from_limits)
from trainer.stopping import DiskFull, Stopping, eta_seconds, halved

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def config(**kw):
    from trainer.loop import TrainConfig

    return TrainConfig(**kw)


# ---- the schedule --------------------------------------------------------------------------------------

def test_cosine_warms_up_linearly_then_decays_to_the_floor_at_its_last_step_and_stays():
    s = Schedule(peak_lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=110)
    assert s.lr(1) == pytest.approx(1e-4)
    assert s.lr(10) == pytest.approx(1e-3)  # the end of the warmup is the peak
    assert s.lr(60) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half way through the cosine
    assert s.lr(110) == pytest.approx(1e-4) and s.lr(500) == pytest.approx(1e-4)
    assert s.fixed


def test_wsd_holds_the_peak_until_its_decay_is_fixed_then_decays_over_it():
    s = Schedule(peak_lr=1e-3, min_lr=0.0, warmup_steps=2, total_steps=50, kind="wsd")
    assert not s.fixed and s.lr(3) == s.lr(10_000) == 1e-3  # an estimate of 50 steps does not end it
    d = s.with_decay(100, 20)
    assert d.fixed and d.total_steps == 120
    assert d.lr(100) == 1e-3 and d.lr(110) == pytest.approx(5e-4) and d.lr(120) == pytest.approx(0.0)
    assert s.with_decay(100, 0).total_steps == 101  # at least one decay step


def test_defaults_of_warmup_and_cadence_at_their_boundaries():
    assert [default_warmup(n) for n in (1, 19, 20, 2000, 2020, 10**6)] == [0, 0, 1, 100, 100, 100]
    assert [default_eval_every(n) for n in (1, 9, 10, 5000, 5005, 10**6)] == [1, 1, 2, 1000, 1000, 1000]
    assert cadence(None, None, 100) == (20, 20)
    assert cadence(0, None, 100) == (0, 20)  # evaluations off: checkpoints at the default cadence
    assert cadence(7, 3, 100) == (7, 3)


def test_a_new_schedule_is_as_long_as_the_nearer_limit_and_its_warmup_never_longer():
    c = config(max_steps=50, max_tokens=1000, lr=1e-3, min_lr_ratio=0.5)
    assert steps_from_limits(c, 64) == 16  # 1000 tokens: ceil(15.6) steps, nearer than 50
    assert steps_from_limits(config(max_tokens=10), 64) == 1
    assert steps_from_limits(config(max_minutes=1.0), 64) is None
    s = new_schedule(config(lr=1e-3, warmup_steps=30), 16)
    assert (s.warmup_steps, s.total_steps, s.min_lr) == (16, 16, pytest.approx(1e-4))


def test_probed_length_leaves_the_allowance_and_gives_evaluations_their_share():
    # 100 s: 97 after the allowance, less 2 probe steps of 1 s and the final 1 s evaluation: 94 s
    total, every = probed_length(100.0, [1.0, 1.0], 1.0, None)
    assert (total, every) == (89, 17)  # 5 evaluations (1 s each, within 20% of 94 s) and 89 steps of 1 s
    assert probed_length(100.0, [1.0, 1.0], 1.0, 2) == (62, 2)  # each step carries half an evaluation
    assert probed_length(3.0, [1.0, 1.0], 1.0, None) == (1, 0)  # nothing left: one step, the final eval only


def test_a_refit_ends_an_unfixed_decay_at_the_new_limit_and_a_time_limit_alone_lifts_the_end():
    wsd = Schedule(peak_lr=1.0, min_lr=0.0, warmup_steps=40, total_steps=500, kind="wsd")
    s, ends = refitted(wsd, config(max_steps=100), step=30, tokens_per_step=64)
    assert ends and (s.decay_start, s.total_steps, s.warmup_steps) == (80, 100, 40)
    s, _ = refitted(wsd, config(max_steps=100), step=95, tokens_per_step=64)
    assert (s.decay_start, s.total_steps, s.warmup_steps) == (95, 100, 40)  # from this step on at the latest
    cosine = Schedule(peak_lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=50)
    assert refitted(cosine, config(max_steps=100), 30, 64) == (cosine, True)
    assert refitted(cosine, config(max_minutes=5.0), 30, 64) == (cosine, False)


def test_the_decay_starts_with_a_fifth_of_the_time_left_sized_from_the_measured_steps():
    wsd = Schedule(peak_lr=1.0, min_lr=0.0, warmup_steps=5, total_steps=500, kind="wsd")
    kw = dict(budget_seconds=100.0, recent=[0.5, 0.5, 1.5], eval_seconds=[2.0], eval_every=10)
    assert decayed(wsd, elapsed=79.0, step=50, **kw) is None
    assert decayed(wsd, elapsed=90.0, step=5, **kw) is None  # still warming up
    s, details = decayed(wsd, elapsed=80.0, step=50, **kw)
    # 20 s left, less the final 2 s evaluation, at 0.5 s a step plus a tenth of an evaluation
    assert details == {"decay_steps": 25, "total_steps": 75, "seconds_left": 20.0, "step_seconds": 0.7}
    assert s.decay_start == 50 and s.total_steps == 75


# ---- stopping ------------------------------------------------------------------------------------------

COSINE = Schedule(peak_lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=10)


def test_the_limits_stop_a_run_in_their_order():
    stop = Stopping(config(max_steps=5, max_tokens=1000))
    assert stop.reason(4, 900, COSINE) is None
    assert stop.reason(5, 0, COSINE) == "max_steps"
    assert stop.reason(1, 1000, COSINE) == "max_tokens"
    epoch = Stopping(config())
    assert epoch.reason(9, 0, COSINE) is None and epoch.reason(10, 0, COSINE) == "epoch"
    epoch.schedule_ends_run = False  # a resume given a new time limit alone
    assert epoch.reason(10, 0, COSINE) is None
    assert epoch.signal(15) and epoch.reason(0, 0, COSINE) == "interrupted"
    assert not epoch.signal(2) and epoch.stop_signal == 15  # a second signal: the caller stops at once


def test_a_time_limit_stops_the_run_with_its_allowance_left():
    stop = Stopping(config(max_minutes=1.0), started=time.perf_counter() - 57.0)
    assert stop.time_budget == pytest.approx(58.2)
    assert stop.reason(1, 0, COSINE) is None
    stop.started -= 1.5
    assert stop.reason(1, 0, COSINE) == "max_minutes"
    wsd = Schedule(peak_lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=3, kind="wsd")
    assert Stopping(config(max_minutes=1.0)).reason(3, 0, wsd) is None  # an estimate of 3 steps does not stop it
    assert Stopping(config(max_minutes=1.0)).reason(3, 0, wsd.with_decay(2, 1)) == "max_minutes"


def test_the_eta_is_the_time_left_until_a_time_limited_run_fixes_its_decay():
    wsd = Schedule(peak_lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=10, kind="wsd")
    c = config(max_minutes=1.0)
    assert eta_seconds(c, wsd, 50, 0, 64, [1.0], elapsed=20.0) == pytest.approx(40.0)
    assert eta_seconds(c, wsd.with_decay(50, 10), 50, 0, 64, [1.0], elapsed=20.0) == pytest.approx(10.0)
    assert eta_seconds(config(max_tokens=640), COSINE, 2, 128, 64, [0.5, 2.0, 0.5], elapsed=0.0) == 4.0


def test_non_finite_losses_in_a_row_stop_the_run_and_a_finite_one_resets_the_count():
    stop = Stopping(config(max_nonfinite=2))
    assert not stop.count_loss(math.nan) and stop.nonfinite_run == 1
    assert not stop.count_loss(1.0) and stop.nonfinite_run == 0
    assert not stop.count_loss(math.inf) and stop.count_loss(math.nan)
    message = stop.nonfinite_message(7, math.nan, -1, "fp16-mixed")
    assert message.startswith("step 7:") and "from step 0" in message and "bf16-mixed" in message


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_global_batch():
    s = TrainSetup(ctx=64, micro_batch=4, grad_accum=3)
    assert (halved(s).micro_batch, halved(s).grad_accum) == (2, 6)
    odd = s.replace(micro_batch=3, grad_accum=1)
    assert (halved(odd).micro_batch, halved(odd).grad_accum) == (1, 3)
    assert halved(s.replace(micro_batch=1)) is None


# ---- the checkpoint manager ----------------------------------------------------------------------------

def _one_process():
    from trainer.distributed import DistContext

    return DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def _save(manager, step: int, model, optimizer):
    return manager.save(step, model=model, wrapped=model, optimizer=optimizer,
                        state=lambda: {"step": step, "optimizer": optimizer.state_dict()},
                        meta=lambda: {"note": f"step {step}"}, tokenizer=SimpleNamespace(kind="tiktoken"),
                        tied=False, sharding="none")


def test_checkpoints_are_due_at_their_cadence_the_newest_keep_stay_and_a_resume_takes_the_newest(tmp_path):
    from trainer import checkpoint_format as ckpt
    from trainer.checkpoint_policy import CheckpointManager, resume_point

    manager = CheckpointManager(tmp_path, keep=2, dist=_one_process(), save_every=2)
    assert [s for s in range(1, 7) if manager.due(s)] == [2, 4, 6]
    assert not CheckpointManager(tmp_path, keep=2, dist=_one_process(), save_every=0).due(2)
    assert manager.newest_note() == "no checkpoint was saved"
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (2, 4, 6):
        with torch.no_grad():
            model.weight.fill_(step)
        _save(manager, step, model, optimizer)
    assert [c.step for c in ckpt.list_checkpoints(tmp_path / "checkpoints")] == [4, 6]
    assert manager.last_saved_step == 6 and manager.newest_note() == "the newest checkpoint, step-00000006, is intact"
    ref, meta, where = resume_point(tmp_path, "train")
    assert ref.step == 6 and meta["note"] == "step 6" and where.endswith("step-00000006/meta.json")
    fresh = torch.nn.Linear(3, 2)
    meta, state = manager.load(ref.path, model=fresh, wrapped=fresh, optimizer=None, device="cpu",
                               plain=lambda: pytest.fail("one process reads its checkpoint itself"))
    assert state["step"] == 6 and torch.equal(fresh.weight, torch.full((2, 3), 6.0))


def test_a_run_stopped_before_its_first_checkpoint_resumes_only_with_its_own_command(tmp_path):
    from trainer import rundir
    from trainer.checkpoint_policy import resume_point

    rundir.write_record(tmp_path, {"kind": "finetune", "plan": {}, "config": {}, "data": {}})
    ref, record, where = resume_point(tmp_path, "finetune")
    assert ref is None and record["kind"] == "finetune" and where.endswith("run.json")
    with pytest.raises(InputError, match="is a finetune run; resume it with memplan finetune"):
        resume_point(tmp_path, "train")


def test_a_resume_replaces_the_limits_together_and_refuses_to_change_what_is_not_run_control():
    from trainer.checkpoint_policy import apply_overrides

    run = config(max_steps=100, max_tokens=10**6, lr=1e-3)
    assert apply_overrides(run, {}) is run
    changed = apply_overrides(run, {"max_minutes": 5.0, "keep": 1, "lr": 1e-3})  # the run's own lr may be given
    assert (changed.max_steps, changed.max_tokens, changed.max_minutes, changed.keep) == (None, None, 5.0, 1)
    with pytest.raises(InputError, match="trains with lr = 0.001, this command asks for 0.01; drop --lr"):
        apply_overrides(run, {"lr": 1e-2})


def test_a_full_disk_while_writing_is_one_line_naming_the_file_and_the_intact_checkpoint(tmp_path):
    from trainer.checkpoint_policy import CheckpointManager

    manager = CheckpointManager(tmp_path, keep=3, dist=_one_process(), save_every=1)
    model = torch.nn.Linear(2, 2)
    _save(manager, 1, model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(DiskFull) as full:
        with manager.writing(tmp_path / "metrics.jsonl", step=3):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(full.value) == (f"{tmp_path / 'metrics.jsonl'}: no space left on device at step 3; the newest "
                               "checkpoint, step-00000001, is intact; free space, then continue it with --resume")
    with pytest.raises(ValueError):  # anything else goes through as it is
        with manager.writing(tmp_path / "x", step=3):
            raise ValueError("not a disk")


# ---- evaluation ----------------------------------------------------------------------------------------

def _evaluation(loss):
    from trainer.loop_eval import Evaluation

    return Evaluation(config=config(sample_tokens=0, eval_batches=2), loss=loss, prompts=lambda: ["Once"],
                      tokenizer=None, model=lambda: None, setup=lambda: TrainSetup(ctx=8, micro_batch=1),
                      device=torch.device("cpu"))


def test_an_evaluation_is_timed_and_recorded_and_one_out_of_memory_is_an_event_not_a_failure():
    asked = []
    result = {"eval_loss": 2.0, "eval_ppl": math.inf, "eval_tokens": 64, "eval_loss_by_source": {"a": 2.0},
              "eval_ppl_by_source": {"a": math.inf}, "eval_tokens_by_source": {"a": 64}}
    ok = _evaluation(lambda model, setup, device, n: asked.append(n) or result)
    line, event = ok.run(step=4, tokens=256)
    assert event is None and asked == [2] and ok.last_step == 4 and ok.last is line
    assert isinstance(line, records.EvalLine) and line.eval_ppl is None and line.samples == [] and line.tokens == 256
    assert line.eval_ppl_by_source == {"a": None}  # not finite: null in the JSON
    assert len(ok.seconds) == 1 and line.eval_seconds == ok.seconds[0]
    assert ok.run(step=0, tokens=0, emit=False) == (None, None) and ok.last_step == 4  # a probe: nothing kept
    assert ok.prompts() == ["Once"]

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    full = _evaluation(oom)
    line, event = full.run(step=6, tokens=0)
    assert line is None and isinstance(event, records.EvalOomEvent) and event.step == 6 and full.last_step == 6
    with pytest.raises(ValueError):
        _evaluation(lambda *a: (_ for _ in ()).throw(ValueError("a bug"))).run(step=1, tokens=0)


# ---- the factories of what is trained ------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from runs_helper import tiny_corpus, tiny_run

    root = tmp_path_factory.mktemp("units")
    corpus = tiny_corpus(root)
    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Count {i}?", "response": f"{i} {i + 1}."}) + "\n"
                           for i in range(12)))
    return tiny_run(root / "run", corpus, steps=2), corpus, sft


def _sft(run: Path, sft: Path):
    from trainer.finetune import base_of, load_sft

    plan, tokenizer, record, checkpoint = base_of(run)
    return plan, load_sft(sft, tokenizer, record, ctx=64, base_checkpoint=checkpoint, base_run=run)


def _base_weights(run: Path) -> dict:
    from trainer import checkpoint_format as ckpt

    return ckpt.read_weights(ckpt.latest_checkpoint(run / "checkpoints").path / ckpt.MODEL_FILE)


def test_a_finetune_built_by_its_factory_holds_the_base_weights_and_the_adapters(base):
    from trainer.finetune import finetune_task

    run, _, sft = base
    plan, data = _sft(run, sft)
    task = finetune_task(data)
    setup = TrainSetup(ctx=64, micro_batch=2, lora_rank=4)
    model = task.build_model(plan.model, setup, "cpu", True)
    weights = _base_weights(run)
    state = model.state_dict()
    assert torch.equal(state["embed.weight"], weights["embed.weight"])
    assert torch.equal(state["blocks.0.attn.qkv.base.weight"], weights["blocks.0.attn.qkv.weight"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_a", "lora_b")) for n in trainable)
    blank = task.build_model(plan.model, setup, "cpu", False)  # a resume: its checkpoint brings the weights
    assert not torch.equal(blank.state_dict()["embed.weight"], weights["embed.weight"])
    assert task.kind == "finetune" and task.meta(setup)["finetune"]["lora"]["rank"] == 4


def test_the_multi_process_path_builds_through_the_task_factory(base):
    """``distributed.build_wrapped_model`` (what every rank of a torchrun launch calls) builds the model the
    task's factory makes, base weights and adapters included, not a seeded reference model."""
    from trainer import distributed
    from trainer.finetune import finetune_task

    run, _, sft = base
    plan, data = _sft(run, sft)
    task = finetune_task(data)
    setup = TrainSetup(ctx=64, micro_batch=2, lora_rank=4)  # sharding none: nothing wraps it in one process
    model = distributed.build_wrapped_model(plan.model, setup, _one_process(), 0,
                                            build=lambda device, load: task.build_model(plan.model, setup, device,
                                                                                        load))
    assert any(n.endswith("lora_b") for n, _ in model.named_parameters())
    assert torch.equal(model.state_dict()["embed.weight"], _base_weights(run)["embed.weight"])


def test_the_trainer_trains_what_the_task_factories_give_it(base, tmp_path):
    from memplan.hardware import load_profile
    from memplan.plan import Plan
    from trainer.finetune import SFTStream, finetune_task
    from trainer.loop import TrainConfig, Trainer

    run, _, sft = base
    plan, data = _sft(run, sft)
    ft = Plan(model=plan.model, setup=TrainSetup(ctx=64, micro_batch=2, lora_rank=4), device="cpu")
    trainer = Trainer.start(tmp_path / "ft", ft, data, TrainConfig(max_steps=1, sample_tokens=0), load_profile("cpu"),
                            task=finetune_task(data))
    try:
        assert isinstance(trainer.stream, SFTStream)
        assert torch.equal(trainer.model.state_dict()["embed.weight"], _base_weights(run)["embed.weight"])
        assert all(n.endswith(("lora_a", "lora_b")) for n, p in trainer.model.named_parameters() if p.requires_grad)
        assert trainer.record()["kind"] == "finetune"
    finally:
        trainer.close()


def test_pretraining_loads_the_starting_weights_only_where_asked(base):
    from trainer.data import PreparedData
    from trainer.task import StartingWeights, pretraining

    run, corpus, _ = base
    from trainer.rundir import trained_checkpoint

    plan = trained_checkpoint(run).plan
    weights = _base_weights(run)
    loads = []
    task = pretraining(PreparedData(corpus), StartingWeights(load=lambda: loads.append(1) or weights, record={},
                                                             where="--from test"))
    torch.manual_seed(1)
    model = task.build_model(plan.model, plan.setup, "cpu", True)
    assert loads == [1] and torch.equal(model.state_dict()["embed.weight"], weights["embed.weight"])
    task.build_model(plan.model, plan.setup, "cpu", False)
    assert loads == [1]  # a rank that receives rank 0's weights, or a resume, never reads them


def test_each_rank_streams_its_share_of_the_rows_one_process_reads(base):
    from trainer.finetune import SFTStream

    run, _, sft = base
    _, data = _sft(run, sft)
    ranks = [SFTStream(data, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    single = SFTStream(data, 4, seed=3)
    for _ in range(7):  # past the end of an epoch
        (x0, y0), (x1, y1), (x, y) = next(ranks[0]), next(ranks[1]), next(single)
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()
    assert ranks[0].global_batch == single.global_batch == 4


def test_finetune_nproc_refusals_are_one_line(base, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from memplan.cli import app
    from runs_helper import one_line_error

    run, _, sft = base
    args = ["finetune", "--run", str(run), "--data", str(sft), "--out", str(tmp_path / "ft"), "--batch", "2",
            "--device", "cpu"]
    one_line_error(CliRunner().invoke(app, [*args, "--nproc", "0"]), "--nproc: '0' must be at least 1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    one_line_error(CliRunner().invoke(app, [*args, "--nproc", "2"]),
                   "--nproc 2: this process is already one of 2 started by torchrun; drop --nproc")
    assert not (tmp_path / "ft").exists()


# ---- the out-of-memory back-off ------------------------------------------------------------------------

class _Scaler:
    def __init__(self, state=None):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = dict(state)


def test_an_out_of_memory_step_is_redone_at_half_the_micro_batch_on_the_same_windows(base):
    from memplan.hardware import load_profile
    from memplan.plan import Plan
    from runs_helper import tiny_spec
    from trainer.backoff import back_off
    from trainer.checkpoint_policy import predicted_for
    from trainer.data import PreparedData
    from trainer.task import pretraining

    _, corpus, _ = base
    data = PreparedData(corpus)
    task, profile = pretraining(data), load_profile("cpu")
    plan = Plan(model=tiny_spec("llama", data.vocab_size), setup=TrainSetup(ctx=64, micro_batch=4, grad_accum=3),
                device="cpu")

    def stream(micro_batch):
        return task.make_stream(micro_batch=micro_batch, ctx=64, seed=0, rank=0, world_size=1)

    old = stream(4)
    next(old)
    data_state = old.state_dict()  # the failed step started here
    x, y = next(old)
    made = []
    b = back_off(7, "out of memory", plan=plan, data_state=data_state, new_stream=lambda m: made.append(m) or stream(m),
                 scaler=_Scaler({"scale": 1024.0}), new_scaler=_Scaler, time=12.5,
                 predict=lambda p: predicted_for(p, profile), flops=lambda p: p.setup.micro_batch * 1.0)
    assert made == [2] and (b.plan.setup.micro_batch, b.plan.setup.grad_accum) == (2, 6)
    assert b.plan.model == plan.model and b.flops_per_step == 2.0
    halves = [next(b.stream) for _ in range(2)]  # the same windows, in the same order, in two pieces
    assert torch.equal(torch.cat([h[0] for h in halves]), x) and torch.equal(torch.cat([h[1] for h in halves]), y)
    assert b.scaler.state == {"scale": 1024.0}
    assert b.predicted.as_dict() == predicted_for(b.plan, profile).as_dict() != predicted_for(plan, profile).as_dict()
    e = b.event
    assert isinstance(e, records.OomEvent) and (e.step, e.time, e.message) == (7, 12.5, "out of memory")
    assert (e.micro_batch, e.grad_accum, e.previous) == (2, 6, {"micro_batch": 4, "grad_accum": 3})
    assert e.predicted == b.predicted.as_dict()
    no_scaler = back_off(7, "m", plan=plan, data_state=data_state, new_stream=stream, scaler=None,
                         new_scaler=_Scaler, time=0.0, predict=lambda p: predicted_for(p, profile), flops=lambda p: 0.0)
    assert no_scaler.scaler is None
    one = dataclasses_replace_setup(plan, micro_batch=1)
    assert back_off(7, "m", plan=one, data_state=data_state, new_stream=stream, scaler=None, new_scaler=_Scaler,
                    time=0.0, predict=lambda p: predicted_for(p, profile), flops=lambda p: 0.0) is None


def dataclasses_replace_setup(plan, **changes):
    import dataclasses

    return dataclasses.replace(plan, setup=plan.setup.replace(**changes))


# ---- a time-limited run's length, from timed steps -----------------------------------------------------

def test_the_probe_times_each_step_and_the_evaluation_apart_from_the_reset_and_sizes_the_run():
    from trainer.schedule import first_schedule, probe, probed_length

    now, calls = [0.0], []

    def clock():
        return now[0]

    def work(name, seconds):
        def f():
            calls.append(name)
            now[0] += seconds
        return f

    durations = iter([3.0, 1.0])
    total, every, eval_seconds = probe(lambda: work("step", next(durations))(), work("eval", 5.0),
                                       budget_seconds=600.0, eval_every=None, after_steps=work("reset", 100.0),
                                       clock=clock)
    assert calls == ["step", "step", "reset", "eval"] and eval_seconds == 5.0  # the reset is not timed
    assert (total, every) == probed_length(600.0, [3.0, 1.0], 5.0, None)
    # 600 * 0.97 - 4 - 5 = 573 s: evaluations get 20% (22 of 5 s: the 5 of EVALS_PER_RUN), steps the rest at 1 s
    assert (total, every) == (548, 109)
    assert probe(work("step", 1.0), work("eval", 1.0), budget_seconds=600.0, eval_every=7, clock=clock)[1] == 7

    tokens_per_step, probed = 100, []
    sized = first_schedule(config(max_minutes=10.0), tokens_per_step, eval_every=None, save_every=None,
                           probe=lambda: probed.append(1) or (548, 0), epoch_steps=lambda: 1 / 0)
    # the probe's cadence taken (0: only the final evaluation); checkpoints at the default cadence
    assert probed == [1] and sized[0].kind == "wsd" and sized[0].total_steps == 548 and sized[1:] == (0, 109)
    given = first_schedule(config(max_minutes=10.0, eval_every=50), tokens_per_step, eval_every=50, save_every=None,
                           probe=lambda: (548, 50), epoch_steps=lambda: 1 / 0)
    assert given[1:] == (50, 50)
    limited = first_schedule(config(max_steps=40, max_minutes=10.0), tokens_per_step, eval_every=None,
                             save_every=3, probe=lambda: 1 / 0, epoch_steps=lambda: 1 / 0)
    assert (limited[0].kind, limited[0].total_steps, limited[1:]) == ("cosine", 40, (8, 3))
    epoch = first_schedule(config(), tokens_per_step, eval_every=None, save_every=None, probe=lambda: 1 / 0,
                           epoch_steps=lambda: 12)
    assert (epoch[0].kind, epoch[0].total_steps, epoch[1:]) == ("cosine", 12, (2, 2))


# ---- memory sampling -----------------------------------------------------------------------------------

def test_memory_is_measured_on_the_first_two_steps_then_once_per_interval_and_again_after_a_restart():
    from trainer.monitor import MemoryReading, MemorySampler

    class Monitor:
        resets = 0

        def reset(self):
            self.resets += 1

    def run(sampler, steps, monitor):
        measured, carried = [], []
        for step in steps:
            sampler.before_step(monitor)
            reading = sampler.after_step(step, 0.25, lambda: measured.append(step) or MemoryReading(peak_bytes=step))
            carried.append((reading.peak_bytes, sampler.step))
        return measured, carried

    one, monitor = MemorySampler(every_step=False, interval=1.0), Monitor()
    measured, carried = run(one, range(1, 8), monitor)
    assert measured == [1, 2, 7] and monitor.resets == 3  # 7: a second of training after step 2's end
    assert carried == [(1, 1), (2, 2), (2, 2), (2, 2), (2, 2), (2, 2), (7, 7)]  # a reading names its step
    one.restart()  # a new micro-batch: its first two steps
    assert run(one, range(8, 11), monitor)[0] == [8, 9]
    assert run(MemorySampler(every_step=True, interval=1e9), range(1, 5), Monitor())[0] == [1, 2, 3, 4]


# ---- a resume, restored --------------------------------------------------------------------------------

class _Stream:
    def __init__(self, position=0):
        self.position = position

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_a_restore_puts_back_the_weights_optimizer_position_rng_and_counters_and_names_a_bad_state(tmp_path):
    from trainer.checkpoint_policy import CheckpointManager, state_of

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    schedule = Schedule(peak_lr=1e-3, min_lr=1e-4, warmup_steps=2, total_steps=9, kind="wsd", decay_start=5)

    def state(eval_every=3, save_every=4, **changes):
        s = state_of(optimizer=optimizer, scaler=None, schedule=schedule, stream=_Stream(17), step=6, tokens=600,
                     train_seconds=12.5, eval_every=eval_every, save_every=save_every, nonfinite_run=2)
        return {**s, **changes}

    saving = CheckpointManager(tmp_path, keep=2, dist=_one_process())
    path = _checkpoint(saving, 6, model, optimizer, state())
    after = torch.rand(4)  # what the RNG gives after the save

    def restore(save_every=None, eval_every=None, path=path):
        fresh = torch.nn.Linear(3, 2)
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        manager, stream = CheckpointManager(tmp_path, keep=2, dist=_one_process(), save_every=save_every), _Stream()
        torch.manual_seed(99)
        r = manager.restore(path, model=fresh, wrapped=fresh, optimizer=fresh_optimizer, scaler=None, stream=stream,
                            device="cpu", plain=lambda: pytest.fail("one process reads its checkpoint itself"),
                            eval_every=eval_every)
        return r, manager, stream, fresh, fresh_optimizer

    r, manager, stream, fresh, fresh_optimizer = restore()
    assert torch.equal(torch.rand(4), after)  # the RNG as saved
    assert (r.step, r.tokens, r.train_seconds, r.schedule, r.eval_every, r.nonfinite_run) == (6, 600, 12.5, schedule,
                                                                                               3, 2)
    assert stream.position == 17 and manager.save_every == 4 and manager.last_saved_step == 6
    assert torch.equal(fresh.weight, model.weight)
    restored_avg, saved_avg = (o.state_dict()["state"][0]["exp_avg"] for o in (fresh_optimizer, optimizer))
    assert torch.equal(restored_avg, saved_avg)
    r, manager, *_ = restore(save_every=10, eval_every=5)  # the cadence given on the resume wins
    assert (r.eval_every, manager.save_every) == (5, 10)
    broken = _checkpoint(saving, 8, model, optimizer, {k: v for k, v in state().items() if k != "scheduler"})
    with pytest.raises(InputError, match=r"step-00000008/state.pt: incomplete training state \(KeyError"):
        restore(path=broken)


def _checkpoint(manager, step, model, optimizer, state):
    return manager.save(step, model=model, wrapped=model, optimizer=optimizer, state=lambda: state,
                        meta=lambda: {"note": f"step {step}"}, tokenizer=SimpleNamespace(kind="tiktoken"),
                        tied=False, sharding="none")


# ---- the run directory, opened -------------------------------------------------------------------------

def test_a_run_directory_opens_record_first_and_rewrites_its_plan_only_when_the_setup_differs(tmp_path):
    import contextlib

    from memplan.plan import Plan
    from runs_helper import tiny_spec
    from trainer import rundir

    data = SimpleNamespace(manifest={"tokenizer": {"sha256": "ab" * 32, "kind": "bpe", "vocab_size": 320,
                                                   "eot_id": 0, "merges": [1, 2]}},
                           path=tmp_path / "data", train_tokens=1234, source_names=("a", "b"))
    identity = rundir.run_identity(data)
    assert identity == {"tokenizer_sha256": "ab" * 32,
                        "tokenizer": {"kind": "bpe", "vocab_size": 320, "eot_id": 0, "sha256": "ab" * 32},
                        "data": {"path": str((tmp_path / "data").resolve()), "train_tokens": 1234,
                                 "sources": ["a", "b"]}}

    written = []

    @contextlib.contextmanager
    def writing(path):
        written.append(path.name)
        yield

    run = tmp_path / "run"
    plan = Plan(model=tiny_spec("llama", 320), setup=TrainSetup(ctx=64, micro_batch=4), device="cpu")
    run.mkdir()
    plan.save(run / "plan.toml")  # a run started again (never checkpointed): its plan written anew all the same
    (run / "plan.toml").write_text((run / "plan.toml").read_text() + "# old\n")
    writer = rundir.open_run(run, plan=plan, record=lambda: {"kind": "train", "plan": {}, "config": {},
                                                             **identity}, writing=writing)
    writer.close()
    assert written == ["run.json", "checkpoints", "plan.toml", "metrics.jsonl"]
    assert rundir.read_record(run)["data"]["train_tokens"] == 1234 and (run / "checkpoints").is_dir()
    assert Plan.load(run / "plan.toml").setup == plan.setup and "# old" not in (run / "plan.toml").read_text()
    marked = (run / "plan.toml").read_text() + "# kept\n"
    (run / "plan.toml").write_text(marked)
    written.clear()
    rundir.open_run(run, plan=plan, writing=writing).close()  # a resume with the same setup
    assert written == ["checkpoints", "metrics.jsonl"] and (run / "plan.toml").read_text() == marked
    halved = plan.__class__(model=plan.model, setup=plan.setup.replace(micro_batch=2, grad_accum=2), device="cpu")
    rundir.open_run(run, plan=halved, writing=writing).close()  # another setup: rewritten
    assert Plan.load(run / "plan.toml").setup.micro_batch == 2


# ---- the run report's refresh --------------------------------------------------------------------------

def test_a_report_refresh_is_due_an_interval_after_the_last_render_asked_for_even_a_skipped_one(tmp_path):
    from trainer.reporting import ReportRenderer

    class Child:
        returncode = 0

        def __init__(self):
            self.done = False

        def poll(self):
            return 0 if self.done else None

        def communicate(self):
            self.done = True
            return "", ""

    now, children = [100.0], []
    renderer = ReportRenderer(tmp_path, on_failure=pytest.fail, refresh_seconds=60.0, clock=lambda: now[0])
    renderer._start = lambda: children.append(Child()) or children[-1]
    assert renderer.refresh_due()  # never rendered
    renderer.last_render = now[0]  # the run opens
    now[0] += 59.5
    assert not renderer.refresh_due()
    now[0] += 0.5
    assert renderer.refresh_due()
    renderer.refresh()
    assert len(children) == 1 and renderer.last_render == 160.0 and not renderer.refresh_due()
    now[0] += 60.0
    renderer.refresh()  # the first still renders: none started, and the next refresh an interval from now
    assert len(children) == 1 and renderer.last_render == 220.0 and not renderer.refresh_due()
    now[0] += 30.0
    assert renderer.write() == tmp_path / "report.html" and len(children) == 2 and renderer.last_render == 250.0


# ---- the model, built for this process -----------------------------------------------------------------

def test_a_task_builds_its_model_seeded_in_one_process_and_through_the_wrapper_over_several(monkeypatch):
    from trainer import distributed
    from trainer.task import TrainingTask

    asked = []

    def build_model(spec, setup, device, with_weights):
        asked.append((device, with_weights))
        return torch.nn.Linear(4, 4)

    task = TrainingTask(build_model=build_model, make_stream=None, evaluate=None, prompts=None)
    setup = TrainSetup(ctx=8, micro_batch=1)
    wrapped, model = task.built(None, setup, dist=_one_process(), seed=3, device="cpu", with_weights=True)
    again, _ = task.built(None, setup, dist=_one_process(), seed=3, device="cpu", with_weights=False)
    assert wrapped is model and torch.equal(model.weight, again.weight)  # seeded
    assert asked == [("cpu", True), ("cpu", False)]

    calls = []

    class Wrapped(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    def build_wrapped_model(spec, setup, dist, seed, build):
        calls.append(seed)
        return Wrapped(build("cuda:1", dist.rank == 0))

    monkeypatch.setattr(distributed, "build_wrapped_model", build_wrapped_model)
    monkeypatch.setattr(distributed, "unwrapped", lambda w: w.module)
    asked.clear()
    for rank, with_weights in ((0, True), (1, True), (0, False)):
        dist = SimpleNamespace(rank=rank, world_size=2)
        wrapped, model = task.built(None, setup, dist=dist, seed=5, device="cpu", with_weights=with_weights)
        assert isinstance(wrapped, Wrapped) and model is wrapped.module
    # rank 0 loads the starting weights, the others receive them; a resume loads none
    assert calls == [5, 5, 5] and asked == [("cuda:1", True), ("cuda:1", False), ("cuda:1", False)]


# ---- signals, and stopping together --------------------------------------------------------------------

def test_a_signal_is_the_reason_to_stop_a_second_stops_now_and_the_handlers_come_back():
    import os
    import signal
    import threading

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = Stopping(config(max_steps=10))
    with pytest.raises(KeyboardInterrupt):
        with stop.catching_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)  # (delivered between bytecodes)
            assert stop.stop_signal == signal.SIGTERM and stop.reason(1, 0, None) == "interrupted"
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    elsewhere = []

    def in_a_thread():
        with Stopping(config()).catching_signals():
            elsewhere.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert elsewhere == [before[0]]  # nothing installed outside the main thread


def test_the_ranks_stop_on_any_ranks_signal_and_on_rank_0s_clock():
    schedule = new_schedule(config(), 100)
    stop = Stopping(config(max_steps=10))
    shared = []
    reason = stop.reason_in_ranks(3, 0, schedule, largest=lambda v: max(v, 15),  # rank 1 got a SIGTERM
                                  from_rank0=lambda r: shared.append(r) or r)
    assert reason == "interrupted" and stop.stop_signal == 15 and shared == ["interrupted"]
    calm = Stopping(config(max_steps=10))
    assert calm.reason_in_ranks(3, 0, schedule, largest=lambda v: v, from_rank0=lambda r: "max_minutes") \
        == "max_minutes" and calm.stop_signal is None  # rank 0's clock said so
    assert calm.reason_in_ranks(10, 0, schedule, largest=lambda v: v, from_rank0=lambda r: r) == "max_steps"


# ---- a new run's checks, under the run's lock ----------------------------------------------------------

def test_a_new_run_is_checked_under_its_lock_which_a_failed_check_releases(base, tmp_path):
    from memplan.hardware import load_profile
    from memplan.plan import Plan
    from runs_helper import tiny_spec
    from trainer import rundir
    from trainer.checkpoint_policy import check_new_run, holding_lock
    from trainer.data import PreparedData

    run_dir, corpus, _ = base
    data, profile = PreparedData(corpus), load_profile("cpu")
    plan = Plan(model=tiny_spec("llama", data.vocab_size), setup=TrainSetup(ctx=64, micro_batch=2), device="cpu")
    new = tmp_path / "new"
    seen = []

    def checked():
        assert (new / rundir.LOCK_FILE).exists()  # locked before the checks: no second writer passes them
        check_new_run(new, plan, data, profile, allow_existing=False, verify_data=True)
        seen.append("checked")
        return "built"

    built, lock = holding_lock(new, checked)
    assert built == "built" and seen == ["checked"]
    lock.release()
    with pytest.raises(InputError, match="already holds a run"):
        check_new_run(run_dir, plan, data, profile, allow_existing=False, verify_data=False)
    with pytest.raises(InputError, match="holds checkpoints; resume it with --resume"):
        check_new_run(run_dir, plan, data, profile, allow_existing=True, verify_data=False)
    other = Plan(model=tiny_spec("llama", data.vocab_size + 1), setup=plan.setup, device="cpu")
    with pytest.raises(InputError, match="the model's vocabulary is"):
        holding_lock(tmp_path / "refused", lambda: check_new_run(tmp_path / "refused", other, data, profile,
                                                                 allow_existing=False, verify_data=False))
    assert not (tmp_path / "refused").exists()  # the lock released, and the directory it made removed
    holding_lock(tmp_path / "refused", lambda: None)[1].release()  # free again


# ---- a step's batches ----------------------------------------------------------------------------------

def test_a_steps_batches_are_the_streams_next_micro_batches_in_order():
    from trainer.step import next_batches

    rows = iter([(torch.full((2, 3), i), torch.full((2, 3), -i)) for i in range(5)])
    batches = next_batches(rows, 3, torch.device("cpu"))
    assert [(int(x[0, 0]), int(y[0, 0])) for x, y in batches] == [(0, 0), (1, -1), (2, -2)]
    assert int(next(rows)[0][0, 0]) == 3  # no more taken than the step's


# ---- the run's lines -----------------------------------------------------------------------------------

def test_the_run_log_hands_every_line_on_and_flushes_train_lines_in_batches_and_events_at_once(tmp_path,
                                                                                                monkeypatch):
    import contextlib

    from trainer import rundir

    def train(step):
        return records.TrainLine(step=step, loss=4.0, tokens_per_second=1.0, lr=1e-3, grad_norm=1.0, tokens=step,
                                 step_seconds=1.0, time=float(step), mfu=0.1, micro_batch=1, grad_accum=1,
                                 skipped=False, eta_seconds=1.0, total_steps=9)

    on_disk = lambda: [r.step for r in rundir.metric_records(tmp_path)]  # noqa: E731
    written, seen = [], []

    @contextlib.contextmanager
    def writing(path):
        written.append(path.name)
        yield

    monkeypatch.setattr(rundir, "METRICS_FLUSH_SECONDS", 1e9)
    log = rundir.RunLog(writing)
    log.on_event(seen.append)
    log.emit(train(1))  # before the file is open: handed on only
    log.writer = rundir.MetricsWriter(tmp_path)
    log.writer.flushed = -math.inf  # the first line finds a flush due
    log.emit(train(2))
    log.emit(train(3))
    assert [r.step for r in seen] == [1, 2, 3] and on_disk() == [2]  # 3 waits in the buffer
    log.emit(records.CheckpointEvent(step=3, path="p", seconds=0.5))
    assert on_disk() == [2, 3, 3] and written == ["metrics.jsonl"] * 3  # an event is written at once, with it 3
    log.emit(train(4))
    synced, fsync = [], rundir.os.fsync
    monkeypatch.setattr(rundir.os, "fsync", lambda fd: (synced.append(fd), fsync(fd))[1])
    log.flush()
    assert on_disk() == [2, 3, 3, 4] and not synced
    log.flush(sync=True)  # a checkpoint's lines: onto the disk
    assert synced == [log.writer._f.fileno()]

    @contextlib.contextmanager
    def full(path):
        yield
        raise DiskFull(f"{path}: no space left on device")

    log._writing = full
    with pytest.raises(DiskFull):  # a full disk stops the run ...
        log.emit(train(5))
    log.close()  # ... and closing after it loses the lines that cannot be written, raising nothing
    assert log.writer._f.closed
    quiet = rundir.RunLog(writing, active=False)  # a rank other than 0
    quiet.on_event(pytest.fail)
    quiet.emit(train(1))


def test_the_save_timeout_is_read_from_the_environment_and_a_bad_one_refused_in_one_line(monkeypatch):
    """$MEMPLAN_SAVE_TIMEOUT: the seconds each exchange of a distributed checkpoint save waits (issue 29, item 5a;
    tests/runs/test_hostile_ranks.py runs it); not a positive number of seconds: one line naming it."""
    import datetime

    from trainer import distributed

    monkeypatch.delenv("MEMPLAN_SAVE_TIMEOUT", raising=False)
    assert distributed.save_timeout() == distributed.TIMEOUT == datetime.timedelta(minutes=10)
    monkeypatch.setenv("MEMPLAN_SAVE_TIMEOUT", "2.5")
    assert distributed.save_timeout() == datetime.timedelta(seconds=2.5)
    for bad in ("0", "-3", "nan", "inf", "ten", "1e9"):
        monkeypatch.setenv("MEMPLAN_SAVE_TIMEOUT", bad)
        with pytest.raises(InputError, match=r"^environment variable MEMPLAN_SAVE_TIMEOUT=.*: give the seconds"):
            distributed.save_timeout()


def test_a_dcp_failure_is_named_by_the_rank_it_happened_in():
    """DCP raises the same CheckpointException in every rank: settle names the rank whose part failed, with that
    rank's own error, not each rank that relays it."""
    from torch.distributed.checkpoint.api import CheckpointException

    from trainer import distributed

    relayed = CheckpointException("save", {1: (OSError(28, "No space left on device"), None)})
    assert distributed.failed_rank(relayed, 0)[0] == 1
    rank, error = distributed.failed_rank(relayed, 1)
    assert rank == 1 and isinstance(error, OSError)
    assert distributed.cause_of(error) == "OSError: [Errno 28] No space left on device"
    plain = ValueError("bad\nthing")
    assert distributed.failed_rank(plain, 3) == (3, plain) and distributed.cause_of(plain) == "ValueError: bad thing"
