"""`memplan autotune --stack transformers|litgpt|torchtune --verify`: the trials run that library's own code
(trainer.stacks.trial_steps: transformers' Trainer with the emitted TrainingArguments, litgpt's and torchtune's
twins), a library that is not installed is one line naming its extra, and each library's code is a named
resident term of the CPU plan (memplan.memory.terms.library_code_resident_bytes).

The litgpt and torchtune runs are marked `libs`: they run in those libraries' own environments (.ci/run)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.emit import render
from memplan.hardware import load_profile
from memplan.memory import LIBRARY_CODE_BYTES
from memplan.model import ModelSpec
from memplan.plan import Plan
from memplan.setup import TrainSetup

TINY = ModelSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=64, tied=False)
# a 1-layer llama whose whole batch fits a 2 GiB budget on the CPU profile: one trial, no stepping down
AUTOTUNE = ["autotune", "--arch", "llama", "--layers", "1", "--hidden", "128", "--heads", "4", "--ffn", "384",
            "--vocab", "4096", "--device", "cpu", "--ctx", "128", "--global-batch", "8", "--budget", "2GiB"]
EXTRAS = {"transformers": "memplan[stacks]", "litgpt": "memplan[litgpt]", "torchtune": "memplan[torchtune]"}


# ---- a library that is not installed: one line, before any work ------------------------------------------

@pytest.mark.parametrize("stack,missing", [("transformers", "transformers"), ("transformers", "accelerate"),
                                           ("litgpt", "litgpt"), ("torchtune", "torchtune")])
def test_verify_on_a_stack_whose_library_is_missing_is_one_line_naming_its_extra(stack, missing, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    done = CliRunner().invoke(app, [*AUTOTUNE, "--stack", stack, "--verify"])
    assert done.exit_code == 2, done.output
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.output, done.output
    assert f"--stack {stack}" in lines[0] and missing in lines[0] and EXTRAS[stack] in lines[0], lines[0]
    assert "Verifying" not in done.stdout  # refused before the search and any trial


def test_a_stack_plan_that_fails_its_trial_is_neither_written_nor_emitted(tmp_path, monkeypatch):
    """--stack transformers --verify --out --emit: when no trial holds up, exit 3, --out says so (never the analytic
    plan) and no transformers config is emitted."""
    pytest.importorskip("transformers")
    import trainer.verify
    from memplan.errors import InputError
    from trainer.verify import Verification

    stacks = []

    def nothing_holds(result, steps, on_attempt=None, **_):
        stacks.append(result._evaluator.stack.name)
        return Verification(plan=None, attempts=[], budget_bytes=result.budget_bytes, steps_per_trial=steps,
                            max_micro_batches=4, family="cpu", notes=["every plan's measured peak was over budget"])

    monkeypatch.setattr(trainer.verify, "verify", nothing_holds)
    out, emitted = tmp_path / "plan.toml", tmp_path / "emitted"
    done = CliRunner().invoke(app, [*AUTOTUNE, "--stack", "transformers", "--verify", "--out", str(out),
                                    "--emit", str(emitted)])
    assert done.exit_code == 3, done.output
    assert stacks == ["transformers"] and "Not verified" in done.stdout
    with pytest.raises(InputError, match="measured peak was over budget"):
        Plan.load(out)
    assert not emitted.exists() or not any(emitted.iterdir())


# ---- what a trial runs -----------------------------------------------------------------------------------

def test_a_transformers_trial_takes_the_emitted_files_and_the_others_the_setup():
    from trainer.verify import trial_config

    plan = Plan(model=TINY, setup=TrainSetup(ctx=16, micro_batch=2, grad_accum=4, optimizer="adamw-fused"))
    files = trial_config(plan, "transformers")
    assert files == render(plan, "transformers")
    args = json.loads(files["training_args.json"])
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"], args["optim"]) == (
        2, 4, "adamw_torch_fused")
    assert trial_config(plan, "litgpt") is None and trial_config(plan, "torchtune") is None
    assert trial_config(plan, "memplan") is None


# ---- the library's code: a named resident term of the CPU plan --------------------------------------------

@pytest.mark.parametrize("stack", ["litgpt", "torchtune"])
def test_the_library_code_term_is_in_the_cpu_plan_only(stack):
    from memplan.estimate import estimate
    from memplan.memory.stacks import stack_for

    spec = ModelSpec(arch="llama", layers=1, hidden=128, heads=4, kv_heads=4, ffn=384, vocab=4096, tied=False)
    setup = TrainSetup(ctx=128, micro_batch=8, precision="fp32")
    cpu = estimate(spec, setup, load_profile("cpu"), stack=stack_for(stack)).memory
    assert cpu.runtime_terms["model_code"] == LIBRARY_CODE_BYTES[stack] > 0
    assert cpu.runtime == sum(cpu.runtime_terms.values())
    gpu = estimate(spec, setup.replace(precision="bf16"), load_profile("rtx-4090"), stack=stack_for(stack)).memory
    assert "model_code" not in gpu.runtime_terms


@pytest.mark.parametrize("stack,words", [("litgpt", "litgpt's and lightning's code"),
                                         ("torchtune", "torchtune's and torchao's code")])
def test_estimates_table_names_whose_code_the_term_holds(stack, words, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMPLAN_CACHE", str(tmp_path / "cache"))
    done = CliRunner().invoke(app, ["estimate", "--arch", "llama", "--layers", "1", "--hidden", "128", "--heads", "4",
                                    "--ffn", "384", "--vocab", "4096", "--device", "cpu", "--ctx", "128", "--batch",
                                    "8", "--precision", "fp32", "--stack", stack])
    assert done.exit_code == 0, done.output
    assert "of it, model code" in done.stdout and words in " ".join(done.stdout.split())
    assert "transformers'" not in done.stdout


# ---- litgpt's and torchtune's trials, for real, in their own environments ----------------------------------

@pytest.mark.libs
@pytest.mark.parametrize("stack", ["litgpt", "torchtune"])
def test_verify_runs_the_librarys_own_step_and_writes_the_plan_it_measured(stack, tmp_path, monkeypatch):
    pytest.importorskip(stack)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "plan.toml"
    done = CliRunner().invoke(app, [*AUTOTUNE, "--stack", stack, "--precision", "fp32", "--verify", "--json",
                                    "--out", str(out)])
    assert done.exit_code == 0, done.output
    verified = json.loads(done.stdout)["verified"]
    attempt = verified["attempts"][0]
    assert attempt["outcome"] == "fits" and attempt["steps"] == 3, attempt
    assert verified["method"].startswith({"litgpt": "litgpt's GPT", "torchtune": "torchtune's builders"}[stack])
    ratio = attempt["measured_peak"] / attempt["predicted_peak"]
    assert 0.9 < ratio < 1.1, ratio  # the project's bar for a measured CPU peak (benchmarks/local_memory.py)
    text = out.read_text()
    assert f'stack = "{stack}"' in text and "[verified]" in text
