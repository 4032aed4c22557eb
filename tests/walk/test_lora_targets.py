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
import memplan.memory.stacks.litgpt as litgpt_hooks
import memplan.memory.stacks.transformers as stacks
from memplan.cli import app
from memplan.errors import InputError
from memplan.memory import peak_memory
from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from memplan.memory.stacks import stack_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runs_helper import one_line_error, tiny_corpus, tiny_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MEDIAN_BAR, WORST_BAR = 0.03, 0.10
LLAMA = dict(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=320, tied=False)
GPT2 = dict(arch="gpt2", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=320, tied=False)
runner = CliRunner()


def _lora(targets, precision="bf16-mixed", **kw) -> TrainSetup:
    return TrainSetup(**{"ctx": 128, "micro_batch": 4, "precision": precision, "lora_rank": 4,
                         "lora_targets": targets, **kw})


def _trace(stack, shape, setup, dropout=None) -> int:
    from runs_helper import traced_peak

    return traced_peak(stack, ModelSpec(**shape), setup, lora_dropout=dropout)


def _walk(stack, shape, setup, dropout=None) -> int:
    return peak_memory(ModelSpec(**shape), setup, stack=stack_for(stack, lora_dropout=dropout, cpu=True)).peak_allocated


def _error(stack, shape, setup, dropout=None) -> float:
    traced = _trace(stack, shape, setup, dropout)
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
    (["--lora-targets", "q,v", "--checkpointing", "selective"], ["selective", "--lora-rank", "accepted with LoRA: none, full"]),
    (["--lora-targets", "head", "--tied"], ["head", "ties", "accepted for a tied model"]),
    (["--lora-targets", "head", "--tied", "--stack", "torchtune", "--precision", "bf16"],
     ["head", "torchtune", "accepted for a tied model"]),
    (["--lora-targets", "up,down,head", "--stack", "torchtune", "--precision", "bf16"],
     ["up,down,head", "lora_attn_modules", "at least one of qkv, q, k, v, proj"]),
])
def test_bad_target_combinations_are_one_line(args, needles):
    shape = ["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "128", "--vocab", "320", "--ctx", "128"]
    if "--arch" not in args:
        shape = ["--arch", "llama", *shape]
    if "--tied" not in args:
        shape.append("--untied")
    done = runner.invoke(app, ["estimate", *shape, "--lora-rank", "4", "--device", "rtx-4090", *args])
    one_line_error(done, *needles)


def test_trace_of_q_alone_on_a_fused_attention_is_one_line():
    _needs("transformers")
    done = runner.invoke(app, ["trace", "--stack", "transformers", "--arch", "gpt_neox", "--layers", "2", "--hidden",
                               "64", "--heads", "4", "--ffn", "128", "--vocab", "320", "--ctx", "64", "--device", "cpu",
                               "--lora-rank", "4", "--lora-targets", "q"])
    one_line_error(done, "--lora-targets q", "gpt_neox", "fused", "accepted for gpt_neox")


def test_estimate_json_names_the_targets_as_given():
    done = runner.invoke(app, ["estimate", "--params", "124m", "--ctx", "1k", "--device", "rtx-4090", "--json",
                               "--lora-rank", "8", "--lora-targets", "q,v"])
    assert done.exit_code == 0, done.output
    setup = json.loads(done.stdout)["setup"]
    assert setup["lora_targets"] == "q,v" and setup["lora_rank"] == 8


# ---- memplan's trainer: adapters on slices of the fused qkv, and on the head ----------------------

def _adapted(targets, **shape):
    from trainer.lora import apply_lora
    from trainer.model import build_model

    torch.manual_seed(0)
    model = build_model(ModelSpec(**{**LLAMA, **shape}), "sdpa", "none", torch.float32)
    apply_lora(model, 4, 16.0, targets)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_b" in name:
                p.normal_()  # a trained B: the adapters change the function
    return model


def test_q_v_and_head_adapters_alone_get_gradients_and_only_their_columns_change():
    from trainer.lora import merge_lora

    model = _adapted(("q", "v", "head"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"blocks.{i}.attn.qkv.lora_{m}_{s}" for i in range(2) for m in "ab" for s in "qv"} | {
        "head.lora_a", "head.lora_b"}
    attn = model.blocks[0].attn.qkv
    assert attn.lora_b_q.shape == (64, 4) and attn.lora_b_v.shape == (32, 4)  # heads·hd; kv_heads·hd
    ids = torch.randint(0, 320, (2, 16))
    model(ids).float().pow(2).mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n in trainable)
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    base = attn.base.weight.detach().clone()
    with torch.no_grad():
        before = model(ids)
    merge_lora(model)
    merged = model.blocks[0].attn.qkv.weight
    assert torch.equal(merged[64:96], base[64:96])  # k's rows: no adapter wrote there
    assert not torch.equal(merged[:64], base[:64]) and not torch.equal(merged[96:], base[96:])
    with torch.no_grad():
        assert torch.allclose(model(ids), before, atol=1e-4)


def test_a_slice_adapter_gets_the_gradient_of_its_columns_only():
    """_AddToSlice's backward against autograd's own out-of-place slice add (torch.cat of the columns)."""
    from trainer import lora as trainer_lora

    def out_of_place(y, delta, start, scale):
        width = delta.shape[-1]
        return torch.cat([y[..., :start], y[..., start:start + width] + delta * scale, y[..., start + width:]], -1)

    ids = torch.randint(0, 320, (2, 16))
    grads = []
    for add in (trainer_lora._AddToSlice.apply, out_of_place):
        model = _adapted(("k",))
        original, trainer_lora._AddToSlice.apply = trainer_lora._AddToSlice.apply, add
        try:
            model(ids).float().pow(2).mean().backward()
        finally:
            trainer_lora._AddToSlice.apply = original
        grads.append([p.grad for p in model.parameters() if p.requires_grad])
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(*grads))


def test_memplan_trainer_refuses_a_tied_head_in_one_line():
    with pytest.raises(InputError, match="accepted for a tied model"):
        _adapted(("head",), tied=True)


def test_finetune_with_q_v_head_trains_those_adapters_only(tmp_path):
    from test_finetune import write_jsonl  # noqa: E402

    from trainer.loop import load_trained

    run = tiny_run(tmp_path / "run", tiny_corpus(tmp_path), steps=4, tied=False)
    out = tmp_path / "ft"
    done = runner.invoke(app, ["finetune", "--device", "cpu", "--run", str(run), "--data",
                               str(write_jsonl(tmp_path / "sft.jsonl")), "--out", str(out), "--lora-rank", "4",
                               "--lora-targets", "v,q,head", "--batch", "4", "--max-steps", "2", "--save-every", "2",
                               "--eval-every", "2"])
    assert done.exit_code == 0, done.output
    meta = json.loads(next((out / "checkpoints").glob("step-*/meta.json")).read_text())
    assert meta["finetune"]["lora"]["targets"] == "q,v,head"
    base, tuned = load_trained(run)[0].state_dict(), load_trained(out)[0].state_dict()  # adapters folded in
    q, kv = 64, 32
    qkv0, qkv1 = base["blocks.0.attn.qkv.weight"], tuned["blocks.0.attn.qkv.weight"]
    assert torch.equal(qkv0[q:q + kv], qkv1[q:q + kv])  # k: no adapter
    assert not torch.equal(qkv0[:q], qkv1[:q]) and not torch.equal(qkv0[q + kv:], qkv1[q + kv:])
    assert not torch.equal(base["head.weight"], tuned["head.weight"])
    for frozen in ("embed.weight", "blocks.0.attn.proj.weight", "blocks.1.mlp.up.weight", "norm.weight"):
        assert torch.equal(base[frozen], tuned[frozen]), frozen


# ---- the walk against each library's trace ------------------------------------------------------

def _assert_bars(errors: dict) -> None:
    values = [abs(e) for e in errors.values()]
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert statistics.median(values) <= MEDIAN_BAR, errors
    assert abs(errors[worst]) <= WORST_BAR, (worst, errors[worst])


def _grid(stack, targets, precisions, checkpointings=("none",), shapes=(LLAMA,), dropouts=(None,)):
    _needs(stack)
    return {f"{s['arch']} {t} {p} {c} {d}": _error(stack, s, _lora(t, p, checkpointing=c), d)
            for s in shapes for t in targets for p in precisions for c in checkpointings for d in dropouts}


def test_memplan_q_v_and_head_meet_the_bars():
    errors = _grid("memplan", ("q,v", "k", "head", "q,v,head"), ("fp32", "bf16-mixed", "bf16"))
    _assert_bars(errors)
    assert max(abs(e) for e in errors.values()) < 0.005, errors  # exact but for the walk's usual bytes


def test_transformers_q_v_and_head_meet_the_bars():
    errors = _grid("transformers", ("q,v", "head", "q,v,head"), ("fp32", "bf16-mixed", "bf16"))
    _assert_bars(errors)
    assert max(abs(e) for e in errors.values()) < 0.01, errors


@pytest.mark.libs
def test_litgpt_q_v_and_head_meet_the_bars():
    errors = _grid("litgpt", ("q,v", "q,v,head"), ("fp32", "bf16-mixed", "bf16"))
    _assert_bars(errors)
    assert max(abs(e) for e in errors.values()) < 0.01, errors


@pytest.mark.libs
def test_torchtune_q_v_and_head_meet_the_bars():
    errors = _grid("torchtune", ("q,v", "q,v,head"), ("fp32", "bf16"))
    _assert_bars(errors)
    assert max(abs(e) for e in errors.values()) < 0.01, errors


# ---- the adapters' parameters: the library's trainable parameters --------------------------------

def _trainable(stack, shape, setup) -> int:
    from trainer.stacks import StackModel, _built

    net = _built(stack, StackModel(spec=ModelSpec(**shape)), setup, None)[0]
    return sum(p.numel() for p in net.parameters() if p.requires_grad)


def _walked_adapter_params(stack, shape, setup) -> int:
    """The adapters' parameters as the walk holds them: memplan's, plus the stack's own beyond them."""
    spec = ModelSpec(**shape)
    extra = stack_for(stack).lora_bytes_delta(spec, setup)
    per = 4 if stack == "transformers" else setup.param_bytes  # peft keeps its adapters fp32
    return (terms.lora_params(spec, setup) * setup.param_bytes + extra) // per


@pytest.mark.parametrize("stack", ["memplan", "transformers", pytest.param("litgpt", marks=pytest.mark.libs),
                                   pytest.param("torchtune", marks=pytest.mark.libs)])
@pytest.mark.parametrize("targets", ["q,v", "k", "q,v,head", "v,proj,up,down,head"])
def test_the_walked_adapters_are_the_librarys_trainable_parameters(stack, targets):
    _needs(stack) if stack != "memplan" else None
    setup = _lora(targets, "fp32")
    assert _walked_adapter_params(stack, LLAMA, setup) == _trainable(stack, LLAMA, setup)


# ---- each mechanism: with its hook the walk meets the trace, without it misses ----------------------

def _head_transient_absent(spec, setup, matrix):
    return 0 if matrix == "head" else _HF_TRANSIENT(spec, setup, matrix)


_HF_TRANSIENT = stacks.hf_lora_forward_transient_bytes
WIDE = {**LLAMA, "layers": 4, "hidden": 256, "ffn": 64, "vocab": 64, "kv_heads": 4}


@pytest.mark.parametrize("stack,module,term,absent,shape,setup,dropout,miss", [
    # memplan: each of q's and v's A casts the fp32 norm output anew under autocast and saves its copy
    ("memplan", terms, "lora_input_casts_bytes", lambda *a: 0, WIDE, _lora("q,v"), None, 0.04),
    # only the head trains: nothing below it saves anything, and no backward runs below it
    ("memplan", walk_lora, "head_adapter_forward", None, LLAMA, _lora("head", "fp32"), None, WORST_BAR),
    # transformers' checkpointing makes the blocks' input need a gradient even where only the head trains
    ("transformers", stacks.TransformersStack, "checkpointed_input_needs_grad", property(lambda self: False), LLAMA,
     _lora("head", "fp32", checkpointing="full"), None, WORST_BAR),
    # peft's lm_head adapter: lora_A keeps an fp32 cast of the bf16 final norm output
    ("transformers", stacks, "hf_lora_head_saved_bytes", lambda *a, **k: 0,
     {**WIDE, "layers": 2, "vocab": 512}, _lora("down,head", "bf16"), None, 0.02),
    # peft's lm_head adapter in fp32 with dropout: lora_B's output and its scaled copy beside the logits, and
    # the final norm's output held by the CausalLM's forward beside the dropout's output lora_A saves
    ("transformers", stacks, "hf_lora_forward_transient_bytes", _head_transient_absent, LLAMA, _lora("head", "fp32"),
     0.05, 0.04),
    ("transformers", stacks, "hf_lora_head_input_held_bytes", lambda *a, **k: 0, LLAMA, _lora("head", "fp32"), 0.05,
     0.04),
    # litgpt's LoRAQKVLinear for q and v: zero_pad's index_copy_ keeps the adapter's output
    pytest.param("litgpt", litgpt_hooks, "lit_qkv_zero_pad_saved_bytes", lambda *a: 0, LLAMA, _lora("q,v", "fp32"),
                 None, 0.04, marks=pytest.mark.libs),
    # litgpt's lm_head adapter: its dropout (finetune/lora.py's 0.05) keeps a mask of the final norm output
    pytest.param("litgpt", litgpt_hooks, "lib_lora_head_saved_bytes", lambda *a, **k: 0,
                 {**WIDE, "layers": 2, "vocab": 512}, _lora("q,v,head", "fp32"), None, 0.02, marks=pytest.mark.libs),
], ids=["memplan-slice-adapters-cast-their-input", "memplan-head-only-frozen-blocks",
        "peft-checkpointing-input-grads", "peft-head-input-cast", "peft-head-forward-transient", "peft-head-input-held", "litgpt-zero-pad-source", "litgpt-head-dropout-mask"])
def test_each_mechanism_brings_the_walk_to_the_trace_and_its_absence_misses_it(monkeypatch, stack, module, term,
                                                                               absent, shape, setup, dropout, miss):
    _needs(stack) if stack != "memplan" else None
    with_it = _error(stack, shape, setup, dropout)
    assert abs(with_it) <= 0.005, with_it
    if term == "head_adapter_forward":  # the head-only step walked as any LoRA step (the frozen blocks' walk out)
        import memplan.memory.walk as walk

        monkeypatch.setattr(walk, "_FrozenBlocksStep", walk._Step)
    else:
        monkeypatch.setattr(module, term, absent)
    without = _error(stack, shape, setup, dropout)
    assert abs(without) > miss, (with_it, without)
