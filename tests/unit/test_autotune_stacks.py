"""`memplan autotune --stack S`: the search takes its axes from the stack object, proposes only setups that
stack's code runs, chooses the fastest fitting one on that stack's walk, and its advice is walked on it too."""

from __future__ import annotations

import itertools

import pytest
from typer.testing import CliRunner

from memplan.advice import levers
from memplan.autotune import LOSSY_OPTIMIZERS, _sig, autotune, divisors, search_axes
from memplan.cli import app
from memplan.errors import InputError
from memplan.estimate import memory_on
from memplan.hardware import load_profile
from memplan.memory.stacks import MEMPLAN, REGISTRY, stack_for
from memplan.model import from_size
from memplan.setup import CHECKPOINTINGS, TrainSetup
from memplan.units import GiB, format_bytes

SPEC = from_size("22m")  # a llama shape (rotary): every stack builds it
H100 = load_profile("h100-sxm")  # CUDA, bf16: 8-bit AdamW is tried where the stack takes it
CTX, SEQUENCES = 1024, 64
STACKS = tuple(REGISTRY)


def _checked(stack, setup) -> None:
    """The stack's own checks, as estimate and trace run them: raise InputError where its code does not run it."""
    stack.check_walked(setup)
    stack.check_lora_targets(SPEC, setup)
    stack.check_setup(SPEC, setup)


def _budget(stack) -> int:
    """A budget under which the whole batch at once does not fit, but a few sequences do (checkpointing and the
    micro-batch matter), on that stack's own walk."""
    s = TrainSetup(ctx=CTX, micro_batch=8, grad_accum=SEQUENCES // 8, precision=stack.precisions[-1],
                   attention="sdpa", checkpointing="none", optimizer="adamw-fused")
    return int(memory_on(SPEC, s, H100, stack).peak_reserved / 0.9)


@pytest.mark.parametrize("name", STACKS)
def test_the_searched_setups_are_the_stacks_own_and_cover_its_axes(name):
    stack = stack_for(name)
    result = autotune(SPEC, H100, ctx=CTX, global_batch=SEQUENCES, budget_bytes=_budget(stack), stack=stack)
    space = result.space
    # every axis is the stack object's: a new stack gets its own search from its attributes
    assert space["checkpointing"] == [c for c in CHECKPOINTINGS if c in stack.checkpointings]
    assert space["attention"] == [a for a in ("sdpa", "eager") if a in stack.attentions]
    assert space["optimizer"] == list(stack.searched_optimizers)
    assert space["precision"] and set(space["precision"]) <= set(stack.precisions)
    assert space["compile"] == [False] or stack.compiles
    assert space["sharding"] == ["none"]
    setups = [c.setup for c in result.candidates] + [c.setup for c in result.ranked_fitting()]
    assert result.plan is not None and any(not c.fits for c in result.candidates)
    for s in setups:
        _checked(stack, s)  # raises where the stack's code does not run it
        assert s.checkpointing in stack.checkpointings and s.attention in stack.attentions
        assert s.precision in stack.precisions and s.optimizer in stack.searched_optimizers
    # each axis the stack has is searched: a configuration of each value was walked
    walked = {c.setup for c in result.configs}
    for axis in ("checkpointing", "attention", "precision", "optimizer"):
        assert {getattr(s, axis) for s in walked} == set(space[axis]), axis


def test_what_each_library_offers():
    tt, hf, lit = stack_for("torchtune"), stack_for("transformers"), stack_for("litgpt")
    assert "selective" not in search_axes(tt, H100)["checkpointing"]  # torchtune checkpoints whole layers
    assert search_axes(tt, H100)["precision"] == ("bf16", "tf32")  # no autocast: its recipes' dtype bf16
    assert "full" in search_axes(hf, H100)["checkpointing"]  # gradient_checkpointing=True
    assert "adamw8bit" in search_axes(hf, H100)["optimizer"]  # optim="adamw_bnb_8bit"
    assert search_axes(lit, H100)["checkpointing"] == ("none",)
    assert "adamw8bit" not in search_axes(lit, H100)["optimizer"]
    assert search_axes(hf, H100, world_size=4)["sharding"] == ("ddp",)  # its walk covers DDP, not FSDP
    assert search_axes(MEMPLAN, H100, world_size=4)["sharding"] == ("ddp", "fsdp")
    assert "adamw8bit" not in search_axes(hf, load_profile("m4-max"))["optimizer"]  # bitsandbytes: CUDA
    # memplan's own search as it always was
    assert search_axes(MEMPLAN, H100) == {"sharding": ("none",), "precision": ("bf16-mixed", "tf32"),
                                          "checkpointing": ("none", "selective", "full"),
                                          "attention": ("sdpa", "eager"), "optimizer": ("adamw-fused", "adamw")}
    assert "selective" not in search_axes(MEMPLAN, H100, lora_rank=8)["checkpointing"]


@pytest.mark.parametrize("name", STACKS)
def test_the_plan_is_the_fastest_fitting_one_on_the_stacks_walk(name):
    """Brute force over the stack's axes and every micro-batch, memory walked anew with the stack's hooks."""
    stack = stack_for(name)
    result = autotune(SPEC, H100, ctx=CTX, global_batch=SEQUENCES, budget_bytes=_budget(stack), stack=stack)
    ev, space = result._evaluator, result.space
    fitting = []
    for precision, checkpointing, attention, optimizer, m in itertools.product(
            space["precision"], space["checkpointing"], space["attention"], space["optimizer"],
            divisors(SEQUENCES)):
        s = TrainSetup(ctx=CTX, micro_batch=m, grad_accum=SEQUENCES // m, precision=precision, attention=attention,
                       checkpointing=checkpointing, optimizer=optimizer)
        if memory_on(SPEC, s, H100, stack).peak_reserved <= result.limit_bytes:
            fitting.append(s)
    exact = [s for s in fitting if s.optimizer not in LOSSY_OPTIMIZERS] or fitting  # 8-bit only where needed
    best = max(_sig(ev.tokens_per_second(s)) for s in exact)
    assert _sig(result.chosen.tokens_per_second) == best
    assert result.chosen.setup in fitting
    assert result.chosen.peak_reserved == memory_on(SPEC, result.chosen.setup, H100, stack).peak_reserved


def test_eight_bit_adamw_is_chosen_only_where_nothing_exact_fits():
    hf = stack_for("transformers")
    roomy = autotune(SPEC, H100, ctx=CTX, global_batch=SEQUENCES, budget_bytes=_budget(hf), stack=hf)
    assert roomy.plan.setup.optimizer != "adamw8bit"
    big = from_size("1b")
    exact = TrainSetup(ctx=CTX, micro_batch=1, grad_accum=8, precision="bf16-mixed", checkpointing="full",
                       optimizer="adamw-fused")
    eight = exact.replace(optimizer="adamw8bit")
    low, high = (memory_on(big, s, H100, hf).peak_reserved for s in (eight, exact))
    assert low < high
    tight = autotune(big, H100, ctx=CTX, global_batch=8, budget_bytes=int((low + high) / 2 / 0.9), stack=hf)
    assert tight.plan is not None and tight.plan.setup.optimizer == "adamw8bit"


def test_the_advice_is_walked_on_the_stack():
    """litgpt's scripts have no checkpointing on one device: nothing fits, and the advice's lightest plan is litgpt's
    walk of its own setups, not memplan's (whose lightest, with full checkpointing, needs much less); more devices
    are litgpt's own FSDP1 (pretrain's, unsharded activations and gathered layers: it does not help here)."""
    lit = stack_for("litgpt")
    budget = 1 * GiB
    result = autotune(SPEC, H100, ctx=CTX, global_batch=SEQUENCES, budget_bytes=budget, stack=lit)
    assert result.plan is None
    axes = search_axes(lit, H100)
    lit_lightest = min(memory_on(SPEC, TrainSetup(ctx=CTX, micro_batch=1, grad_accum=SEQUENCES, precision=p,
                                                  attention="sdpa", checkpointing="none", optimizer=o),
                                 H100, lit).peak_reserved for p in axes["precision"] for o in axes["optimizer"])
    ours = min(memory_on(SPEC, TrainSetup(ctx=CTX, micro_batch=1, grad_accum=SEQUENCES, precision=p,
                                          attention="sdpa", checkpointing=c, optimizer="adamw-fused"),
                         H100).peak_reserved for p in axes["precision"] for c in CHECKPOINTINGS)
    assert format_bytes(lit_lightest) != format_bytes(ours)  # the hooks matter here
    assert f"needs {format_bytes(lit_lightest)}" in result.advice[0]
    text = " ".join(result.advice)
    assert "checkpointing none" in result.advice[0]
    assert "checkpointing full" not in text
    assert any(a.startswith("more devices do not help at this context: FSDP over") for a in result.advice)


def test_estimate_levers_are_walked_on_the_stack_and_only_what_it_takes():
    spec, device = from_size("1.1b"), load_profile("rtx-3060-12gb")
    for name in ("litgpt", "transformers", "torchtune"):
        stack = stack_for(name)
        setup = TrainSetup(ctx=2048, precision=stack.precisions[-1] if name == "torchtune" else "bf16-mixed")
        found = levers(spec, setup, device, stack)
        assert found
        # torchtune's walk has FSDP (its distributed recipes' shard_model), litgpt's its scripts' FSDP1;
        # transformers' has not
        assert any("--sharding fsdp" in lever.change for lever in found) == (name != "transformers")
        for lever in found:
            if lever.change.startswith("--checkpointing"):
                assert lever.change.split()[1] in stack.checkpointings
            if lever.change == "--optimizer adamw8bit":
                assert "adamw8bit" in stack.optimizers
        lora = next(lever for lever in found if lever.change.startswith("--lora-rank"))
        adapted = setup.replace(micro_batch=1, lora_rank=8)
        assert lora.peak_reserved == memory_on(spec, adapted, device, stack).peak_reserved
        if name == "litgpt":
            assert lora.peak_reserved != memory_on(spec, adapted, device).peak_reserved  # its hooks, not memplan's


def test_the_memplan_levers_and_the_stack_ones_differ_where_hooks_matter():
    spec, device = from_size("1.1b"), load_profile("rtx-3060-12gb")
    setup = TrainSetup(ctx=2048, precision="bf16-mixed")
    ours = {lever.change for lever in levers(spec, setup, device)}
    lit = {lever.change for lever in levers(spec, setup, device, stack_for("litgpt"))}
    # the device count is the walk's of each stack's own sharded step (litgpt's: its scripts' FSDP1)
    assert "--world-size 2 --sharding fsdp" in ours and "--world-size 3 --sharding fsdp" in lit


@pytest.mark.parametrize("args,needles", [
    (["--stack", "litgpt", "--checkpointing", "full"], ["--stack litgpt", "--checkpointing full", "accepted: none"]),
    (["--stack", "torchtune", "--checkpointing", "selective"], ["--checkpointing selective", "accepted: none, full"]),
    (["--stack", "torchtune", "--precision", "bf16-mixed"], ["--precision bf16-mixed", "fp32, tf32, bf16"]),
    (["--checkpointing", "sometimes"], ["--checkpointing", "none, selective, full"]),
])
def test_a_setting_the_stack_cannot_express_is_one_line(args, needles):
    done = CliRunner().invoke(app, ["autotune", "--params", "22m", "--device", "h100-sxm", "--ctx", "1024", *args])
    assert done.exit_code == 2, done.output
    lines = done.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.output, done.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_a_pinned_setting_the_stack_takes_is_the_only_one_searched():
    tt = stack_for("torchtune")
    result = autotune(SPEC, H100, ctx=CTX, global_batch=SEQUENCES, checkpointing="full", precision="bf16", stack=tt)
    assert result.space["checkpointing"] == ["full"] and result.space["precision"] == ["bf16"]
    assert all(c.setup.checkpointing == "full" and c.setup.precision == "bf16" for c in result.candidates)
    with pytest.raises(InputError, match="accepted: none, full"):
        autotune(SPEC, H100, ctx=CTX, global_batch=SEQUENCES, checkpointing="selective", stack=tt)


def test_the_stacks_lora_checks_hold_in_the_search():
    """torchtune's lora_llama3 needs an attention module: a search of MLP-only adapters is its one-line refusal."""
    with pytest.raises(InputError, match="lora_attn_modules"):
        autotune(SPEC, H100, ctx=CTX, global_batch=SEQUENCES, lora_rank=8, lora_targets="up,down",
                 stack=stack_for("torchtune"))
