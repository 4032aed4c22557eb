"""autotune chooses torch.compile from the compiled step's own numbers (issue 25, item 4): its memory can let a
larger micro-batch fit, its one-off compile time is weighed against the run's length (--tokens or --max-steps),
and the plan and the JSON say why compile was taken or not (``memplan.autotune.CompileChoice``). No real compile
here: the figures are the planner's."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.autotune import autotune
from memplan.cli import app
from memplan.errors import InputError
from memplan.hardware import load_profile
from memplan.model import ModelSpec, from_size
from memplan.units import GiB

REF = {"layers": 2, "hidden": 256, "heads": 4, "ffn": 704, "vocab": 4096, "ctx": 256, "micro_batch": 4,
       "eager_seconds": 1.0, "compiled_seconds": 0.8, "compile_seconds": 30.0}
COST = {"fixed_seconds": 20.0, "seconds_per_op": 0.01}


def cpu_compiling():
    """The cpu profile with a calibrated compiled reference step and compile cost (as `calibrate --compile`)."""
    cpu = load_profile("cpu")
    return cpu.replace(calibrated={**cpu.calibrated, "compile_speedup": 1.25, "compile_reference": REF,
                                   "compile_cost": COST})


def llama(layers: int) -> ModelSpec:
    return ModelSpec(arch="llama", layers=layers, hidden=384, heads=6, kv_heads=6, ffn=1024, vocab=4096, tied=True)


KW = dict(ctx=256, global_batch=8, precision="fp32")


def test_max_steps_is_the_run_length_the_compile_time_is_weighed_against():
    device = cpu_compiling()
    short = autotune(llama(6), device, steps=3, **KW)
    long = autotune(llama(6), device, steps=100_000, **KW)
    assert short.run_steps == 3 and short.tokens == 3 * 8 * 256
    assert not short.plan.setup.compile and long.plan.setup.compile
    assert not short.compile.taken and long.compile.taken
    payback = long.compile.payback_steps  # the best compiled configuration's (the run's length can change which)
    assert 3 < short.compile.payback_steps and 3 < payback < 100_000
    # the run of --max-steps N is the run of --tokens N × the global batch
    assert autotune(llama(6), device, tokens=3 * 8 * 256, **KW).compile == short.compile
    # the decision agrees with the payback: a run just past it compiles, one short of it does not
    near = short.compile.payback_steps
    for n in (near - 2, near + 2):
        r = autotune(llama(6), device, steps=n, **KW)
        assert r.plan.setup.compile == (n > r.compile.payback_steps) == r.compile.taken
    with pytest.raises(InputError, match="not both"):
        autotune(llama(6), device, steps=3, tokens=1000, **KW)
    with pytest.raises(InputError, match="--max-steps"):
        autotune(llama(6), device, steps=0, **KW)


def test_the_plan_says_why_compile_was_taken_or_not():
    device = cpu_compiling()
    short = autotune(llama(6), device, steps=3, **KW).compile
    long = autotune(llama(6), device, steps=100_000, **KW).compile
    secs = f"{long.compile_seconds:.0f} s compile"
    assert short.why.startswith(f"torch.compile not taken: the {short.compile_seconds:.0f} s compile (") and \
        "is not paid back within the run's 3 steps" in short.why and f"it takes {short.payback_steps:,})" in short.why
    assert long.why.startswith("torch.compile taken: steps ") and \
        f"compile pays back its {secs} (" in long.why and \
        f"after {long.payback_steps:,} steps; the run is 100,000 steps" in long.why
    # without a run length: by step time, and it says there was nothing to weigh the compile against
    bare = autotune(llama(6), device, **KW)
    assert bare.compile.taken and bare.compile.run_steps is None and "no --tokens or --max-steps" in bare.compile.why
    # the note the plan prints is the same sentence; the JSON carries it with its figures
    assert long.why in autotune(llama(6), device, steps=100_000, **KW).notes
    data = autotune(llama(6), device, steps=3, **KW).to_json()
    assert data["run_steps"] == 3
    assert data["compile"]["taken"] is False and data["compile"]["why"] == short.why
    assert data["compile"]["payback_steps"] == short.payback_steps
    assert data["compile"]["eager_step_seconds"] > data["compile"]["compiled_step_seconds"] > 0
    # not considered: the JSON says why as well
    plain = autotune(llama(6), load_profile("cpu"), steps=3, **KW).to_json()["compile"]
    assert plain["considered"] is False and "no [calibrated] compile_speedup" in plain["why"]


def test_the_compiled_step_s_memory_lets_a_larger_micro_batch_fit_and_the_plan_says_so():
    # 124M at ctx 1024, bf16-mixed, no checkpointing on a 4090: micro-batch 8's peak is about 10.33 GiB compiled
    # (inductor's partitioner saves less) and 10.74 GiB eager; a limit of 10.55 GiB fits 8 only compiled
    device = load_profile("rtx-4090")
    device = device.replace(calibrated={**device.calibrated, "compile_speedup": 1.3})
    result = autotune(from_size("124m"), device, ctx=1024, global_batch=64, budget_bytes=int(10.55 * GiB / 0.9),
                      checkpointing="none", precision="bf16-mixed")
    choice = result.compile
    assert choice.taken and result.plan.setup.compile
    assert choice.compiled_micro_batch == 8 and choice.eager_micro_batch == 4
    assert result.plan.setup.micro_batch == 8
    assert "the compiled step's memory fits micro-batch 8 where the eager step's fits 4" in choice.why
    assert choice.peak_lower_bytes < 0 or choice.peak_lower_bytes > 0  # reported either way, in bytes


def test_the_cli_takes_max_steps_and_refuses_it_with_tokens_in_one_line():
    runner = CliRunner()
    r = runner.invoke(app, ["autotune", "--params", "1m", "--ctx", "128", "--max-steps", "50", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["run_steps"] == 50 and data["compile"]["why"]
    r = runner.invoke(app, ["autotune", "--params", "1m", "--ctx", "128", "--max-steps", "50", "--tokens", "1m"])
    assert r.exit_code == 2 and "not both" in r.output and "Traceback" not in r.output


def test_on_a_cpu_a_compiled_plan_holds_the_compiled_code_where_its_walk_is_the_eager_one_s():
    # selective checkpointing: the compiled step's walk is not modelled (memplan.memory.compiled), so it is the
    # eager step's; the process still holds inductor's modules and the compiled code, which the plan counts
    from memplan.memory import compiled_code_resident_bytes
    from memplan.setup import TrainSetup

    result = autotune(llama(6), cpu_compiling(), steps=100_000, **KW)
    setup = TrainSetup(ctx=256, micro_batch=8, precision="fp32", checkpointing="selective")
    ev = result._evaluator
    compiled, eager = ev.memory(setup.replace(compile=True)), ev.memory(setup)
    assert compiled.runtime_terms["compiled_code"] == compiled_code_resident_bytes(6)
    assert compiled.peak_reserved - eager.peak_reserved == compiled_code_resident_bytes(6)


def test_trains_own_plan_says_why_compile_was_taken_or_not_for_its_run():
    """`memplan train` plans through memplan.planning.autotuned_plan, which weighs the compile against the run's own
    limit (--max-steps, --max-tokens, --max-minutes): it prints the same reason autotune's plan gives."""
    from types import SimpleNamespace

    from memplan.planning import autotuned_plan

    def plan(**limit):
        said = []
        p = autotuned_plan(llama(6), 256, SimpleNamespace(vocab_size=4096), cpu_compiling(), global_batch_tokens=8 * 256,
                           budget_bytes=None, margin=0.1, say=lambda text, soft_wrap=False: said.append(text), **limit)
        return p, [line for line in said if "torch.compile" in line]

    short, short_said = plan(minutes=None, max_steps=3)
    long, long_said = plan(minutes=None, max_steps=100_000)
    assert not short.setup.compile and long.setup.compile
    assert len(short_said) == 1 and short_said[0].startswith("torch.compile not taken: ") and \
        "is not paid back within the run's 3 steps" in short_said[0]
    assert len(long_said) == 1 and long_said[0].startswith("torch.compile taken: ") and \
        "the run is 100,000 steps" in long_said[0]
    # a profile without a calibrated compile does not consider it, and says nothing of it
    plain_said = []
    autotuned_plan(llama(6), 256, SimpleNamespace(vocab_size=4096), load_profile("cpu"), minutes=None,
                   global_batch_tokens=8 * 256, budget_bytes=None, margin=0.1, max_steps=3,
                   say=lambda text, soft_wrap=False: plain_said.append(text))
    assert not [line for line in plain_said if "compile" in line]
