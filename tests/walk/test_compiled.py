"""torch.compile's step: the walk's compile hook (memplan.memory.compiled) against the compiled trace
(trainer.compiled_trace, on fake tensors), and compile where it cannot run (trainer.compile_guard)."""

from __future__ import annotations

import types

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app
from memplan.memory import peak_memory
from memplan.memory.compiled import compile_memory_json
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from runs_helper import one_line_error

LLAMA = ModelSpec(arch="llama", layers=2, hidden=128, heads=4, kv_heads=2, ffn=512, vocab=512, tied=False)


def test_the_compiled_walk_saves_less_by_the_partitioners_terms():
    setup = TrainSetup(ctx=128, micro_batch=4, precision="bf16-mixed")
    eager = peak_memory(LLAMA, setup)
    compiled = peak_memory(LLAMA, setup.replace(compile=True))
    n = setup.ctx * setup.micro_batch
    assert eager.peak_moment == compiled.peak_moment == "backward: loss"  # every block's saved tensors live
    # silu(gate) of each block (n·F·bf16), and the first block's x + attention saved as bf16, not fp32
    assert eager.peak_allocated - compiled.peak_allocated == LLAMA.layers * n * LLAMA.ffn * 2 + n * LLAMA.hidden * 2
    figures = compile_memory_json(LLAMA, setup.replace(compile=True), compiled.peak_allocated, eager.peak_allocated)
    assert figures["modelled"] and figures["saved_less_per_block"]["silu_gate"] == n * LLAMA.ffn * 2


@pytest.mark.parametrize("change", [{"checkpointing": "selective"}, {"lora_rank": 8, "lora_targets": "head"}])
def test_the_compile_hook_leaves_what_it_does_not_model_eager(change):
    setup = TrainSetup(ctx=128, micro_batch=4, precision="bf16-mixed", **change)
    eager = peak_memory(LLAMA, setup).peak_allocated
    assert peak_memory(LLAMA, setup.replace(compile=True)).peak_allocated == eager
    figures = compile_memory_json(LLAMA, setup.replace(compile=True), eager, eager)
    assert figures["modelled"] is False and figures["why"]


def test_a_gpt2_compiled_step_is_planned_eager_and_says_so():
    """gpt2's GELU MLP and LayerNorm: the compiled trace holds their decompositions' fp32 buffers (a 2 × 128 gpt2 at
    4 × 128, bf16-mixed: trace 20,200,060, the walk −12.0%); the walk says it is the eager step's."""
    gpt2 = ModelSpec(arch="gpt2", layers=2, hidden=128, heads=4, kv_heads=4, ffn=512, vocab=512, tied=True)
    setup = TrainSetup(ctx=128, micro_batch=4, precision="bf16-mixed")
    eager = peak_memory(gpt2, setup).peak_allocated
    assert peak_memory(gpt2, setup.replace(compile=True)).peak_allocated == eager
    figures = compile_memory_json(gpt2, setup.replace(compile=True), eager, eager)
    assert figures["modelled"] is False and "gelu" in figures["why"]


def test_trace_compile_of_another_stack_is_one_line():
    result = CliRunner().invoke(app, ["trace", "--params", "1m", "--ctx", "64", "--stack", "transformers",
                                      "--compile", "--device", "cpu"])
    one_line_error(result, "--compile", "--stack memplan")


def test_compile_without_a_cpp_compiler_is_one_line_naming_eager(capsys):
    from torch._inductor import config

    from trainer.compile_guard import compile_unavailable, step_model_for

    # inductor's own config.patch, which puts cpp.cxx back on exit (monkeypatch.setattr on the config's
    # proxy deleted the key on undo, and every later compile in the process then failed)
    with config.patch({"cpp.cxx": ("memplan-test-no-such-c++",)}):
        assert "no C++ compiler" in compile_unavailable("cpu")
        model = torch.nn.Linear(2, 2)
        assert step_model_for(model, True, "cpu") is model
    assert config.cpp.cxx != ("memplan-test-no-such-c++",)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no C++ compiler" in lines[0] and "eager" in lines[0]


def test_a_compile_failing_in_a_step_falls_back_to_eager(capsys):
    """The trainer's step (Trainer._train_step) with a compiled model whose compile fails: the step is taken
    eager, once, from no gradients, and later steps stay eager."""
    import torch._dynamo.exc as dynamo_exc

    from trainer.loop import Trainer
    from trainer.model import build_model
    from trainer.step import make_optimizer

    spec = ModelSpec(arch="llama", layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=64, tied=False)
    model = build_model(spec)
    before = [p.detach().clone() for p in model.parameters()]

    class Failing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            self.inner(x).sum().backward()  # gradients of a half-done step, which the retry must not add to
            raise dynamo_exc.BackendCompilerFailed(lambda *a: None, RuntimeError("C++ compile failed"), None)

    trainer = types.SimpleNamespace(step_model=Failing(), wrapped=model, optimizer=make_optimizer(model, "sgd"),
                                    setup=TrainSetup(ctx=8, micro_batch=2, precision="fp32"), scaler=None,
                                    device=torch.device("cpu"), config=types.SimpleNamespace(clip=1.0), step=0)
    batch = [(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))]
    result = Trainer._train_step(trainer, batch)
    assert trainer.step_model is model and torch.isfinite(result.loss)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: torch.compile failed at step 1") and "eager" in err[0]
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # the step was taken
    Trainer._train_step(trainer, batch)  # eager from now on: no second warning
    assert capsys.readouterr().err == ""


def test_autotune_plans_a_compiled_step_with_its_own_memory():
    from memplan.autotune import _Evaluator, autotune
    from memplan.hardware import load_profile
    from memplan.model import from_size

    device = load_profile("rtx-4090").replace(calibrated={"compile_speedup": 1.3})
    ev = _Evaluator(from_size("22m"), device, 1.3, None)
    setup = TrainSetup(ctx=1024, micro_batch=8, precision="bf16-mixed")
    assert ev.memory(setup.replace(compile=True)).peak_allocated < ev.memory(setup).peak_allocated
    selective = setup.replace(checkpointing="selective")  # not modelled: the eager step's walk, shared
    assert ev.memory(selective.replace(compile=True)) is ev.memory(selective)
    result = autotune(from_size("22m"), device, ctx=1024)
    assert result.plan.setup.compile and result.plan.setup.checkpointing == "none"
    assert any("torch.compile" in n and "lower" in n for n in result.notes), result.notes


def test_under_lora_the_compiled_walk_saves_silu_gate_in_every_block():
    """LoRA on qkv and proj: every block's MLP input needs a gradient, so eager saves silu(gate) in every block and
    the compiled step in none; the first block's frozen input is not saved, so its fp32 x + attention stays
    (trace --compile at 12m, micro-batch 4 × 512, bf16-mixed: 928,322,636 traced, the walk +0.00%)."""
    setup = TrainSetup(ctx=128, micro_batch=4, precision="bf16-mixed", lora_rank=8, lora_targets="qkv,proj")
    eager = peak_memory(LLAMA, setup)
    compiled = peak_memory(LLAMA, setup.replace(compile=True))
    assert eager.peak_moment == compiled.peak_moment == "backward: loss"
    assert eager.peak_allocated - compiled.peak_allocated == LLAMA.layers * setup.ctx * 4 * LLAMA.ffn * 2


def test_under_full_checkpointing_the_compiled_walk_holds_silus_fp32_chain():
    """Full checkpointing, bf16-mixed: the backward graph recomputes the block and runs silu's backward through
    fp32 buffers (trace --compile: the gate cast to fp32, dh·up cast to fp32, sigmoid(g) and their product, beside
    up's 16-bit gradient), where eager holds gate|up, silu(g), dh and the two 16-bit gradients: 6·n·F bytes more at
    the first block's MLP backward (the 2 × 128 llama at 4 × 128: trace 15,733,832, the walk +0.09%)."""
    setup = TrainSetup(ctx=128, micro_batch=4, precision="bf16-mixed", checkpointing="full")
    eager = peak_memory(LLAMA, setup)
    compiled = peak_memory(LLAMA, setup.replace(compile=True))
    assert eager.peak_moment == compiled.peak_moment == "block backward: MLP"
    assert compiled.peak_allocated - eager.peak_allocated == 6 * setup.ctx * 4 * LLAMA.ffn
    figures = compile_memory_json(LLAMA, setup.replace(compile=True), compiled.peak_allocated, eager.peak_allocated)
    assert figures["modelled"] and figures["checkpointed_per_block"]["gate_fp32"] == setup.ctx * 4 * LLAMA.ffn * 4
    fp32 = setup.replace(precision="fp32")  # the gate is read as it is: the walk is the eager one
    assert peak_memory(LLAMA, fp32.replace(compile=True)).peak_allocated == peak_memory(LLAMA, fp32).peak_allocated


def test_under_lora_on_down_alone_the_compiled_walk_saves_silu_gate_in_every_block_but_the_first():
    """LoRA on down alone: the first block's MLP input needs no gradient, so eager saves no silu(gate) there
    either; every later block saves it in eager and not compiled (trace --compile: the walk +0.33% bf16-mixed)."""
    setup = TrainSetup(ctx=128, micro_batch=4, precision="bf16-mixed", lora_rank=8, lora_targets="down")
    eager = peak_memory(LLAMA, setup)
    compiled = peak_memory(LLAMA, setup.replace(compile=True))
    assert eager.peak_moment == compiled.peak_moment == "backward: loss"
    assert eager.peak_allocated - compiled.peak_allocated == (LLAMA.layers - 1) * setup.ctx * 4 * LLAMA.ffn * 2
