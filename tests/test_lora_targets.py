"""LoRA on q, k, v alone and on the LM head (``--lora-targets q,v``, ``head``; issue 15, point 2).

memplan's own trainer puts an adapter on each of q, k, v alone as a slice of its fused qkv matrix
(``trainer/lora.py``: its own A, a B as tall as the slice, written into those columns only) and on
the head; transformers (peft's ``target_modules``), litgpt (``lora_query/key/value/head``) and
torchtune (``lora_attn_modules``, ``apply_lora_to_output``) build them in their own idiom. The walk
(``memplan/memory``) is held to each library's exact trace (``trace_stack``) within the project's bars
(median ≤ 3%, worst ≤ 10%), the adapters' parameter count to the library's trainable parameters,
and each mechanism's hook is shown to matter: without it the walk misses the trace by more than the
bar it meets with it.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import memplan.memory.lora as walk_lora
import memplan.memory.terms as terms
import memplan.stacks as stacks
from memplan.cli import app
from memplan.errors import InputError
from memplan.memory import peak_memory
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.stacks import stack_of

sys.path.insert(0, str(Path(__file__).parent))
from runs_helper import one_line_error, tiny_corpus, tiny_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MEDIAN_BAR, WORST_BAR = 0.03, 0.10
LLAMA = dict(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=320, tied=False)
GPT2 = dict(arch="gpt2", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=320, tied=False)
runner = CliRunner()


def _lora(targets, precision="bf16-mixed", **kw) -> TrainSetup:
    return TrainSetup(**{"ctx": 128, "micro_batch": 4, "precision": precision, "lora_rank": 4,
                         "lora_targets": targets, **kw})


def _trace(stack, shape, setup, dropout=None):
    from trainer.stacks import StackModel, trace_stack

    return trace_stack(stack, StackModel(spec=ModelSpec(**shape)), setup, lora_dropout=dropout)


def _walk(stack, shape, setup, dropout=None) -> int:
    return peak_memory(ModelSpec(**shape), setup, stack=stack_of(stack, lora_dropout=dropout, cpu=True)).peak_allocated


def _error(stack, shape, setup, dropout=None) -> float:
    traced = _trace(stack, shape, setup, dropout).peak_allocated
    return (_walk(stack, shape, setup, dropout) - traced) / traced


def _needs(stack):
    if stack == "transformers":
        pytest.importorskip("transformers")
        pytest.importorskip("peft")
    else:
        pytest.importorskip(stack)  # litgpt and torchtune: each in an environment of its own


# ---- the flag ------------------------------------------------------------------------------------

def test_targets_are_named_in_one_order_with_qkv_for_all_three():
    assert TrainSetup(lora_rank=4, lora_targets="v,q").lora_targets == "q,v"
    assert TrainSetup(lora_rank=4, lora_targets="v,k,q,down").lora_targets == "qkv,down"
    assert TrainSetup(lora_rank=4, lora_targets="head,q,qkv").lora_targets == "qkv,head"
    setup = TrainSetup(lora_rank=4, lora_targets="q,v,head")
    assert setup.lora == ("qkv",) and setup.lora_adapters == ("q", "v") and setup.lora_head
    assert TrainSetup(lora_rank=4).lora_targets == "qkv,proj,up,down"  # the default, as documented


@pytest.mark.parametrize("args,needles", [
    (["--lora-targets", "q,o"], ["--lora-targets", "'q,o'", "qkv, q, k, v, proj, up, down, head"]),
    (["--lora-targets", "q,v", "--stack", "transformers", "--arch", "gpt2"],
     ["q,v", "gpt2", "fused", "accepted for gpt2: qkv, proj, up, down, head"]),
    (["--lora-targets", "q,v", "--checkpointing", "selective"], ["q,v", "selective", "accepted with selective"]),
    (["--lora-targets", "head", "--tied"], ["head", "ties", "accepted for a tied model"]),
])
def test_bad_target_combinations_are_one_line(args, needles):
    shape = ["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128", "--vocab", "320", "--ctx", "128"]
    if "--arch" not in args:
        shape = ["--arch", "llama", *shape]
    if "--tied" not in args:
        shape.append("--untied")
    done = runner.invoke(app, ["estimate", *shape, "--lora-rank", "4", "--device", "rtx-4090", *args])
    one_line_error(done, *needles)


def test_estimate_json_names_the_targets_as_given():
    done = runner.invoke(app, ["estimate", "--params", "124m", "--ctx", "1k", "--device", "rtx-4090", "--json",
                               "--lora-rank", "8", "--lora-targets", "q,v"])
    assert done.exit_code == 0, done.output
    setup = json.loads(done.stdout)["setup"]
    assert setup["lora_targets"] == "q,v" and setup["lora_rank"] == 8
