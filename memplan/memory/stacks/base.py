"""memplan's own step as the memory walk's stack, the base of every other (``memplan estimate --stack``): torch-free.

``memplan/memory/`` walks one training step op by op, exactly as memplan's own model and step
(``trainer/model.py``, ``trainer/step.py``) run it. Other code saves other tensors for the same
model. A ``Stack`` is the walk's hooks: the walk calls them at fixed points of the one walk
(``memplan.memory.walk``: ``_Step``, ``_BlockForward``, ``_block_backward``). ``Stack`` itself is
memplan's own step, and every hook of it adds nothing, so ``--stack memplan`` is the walk as it
always was; each other stack (``transformers.py``, ``litgpt.py``, ``torchtune.py`` beside this file)
is a subclass overriding the hooks its library changes, each a small pure function whose docstring
names the tensor it adds (or removes) and the line of the library that makes it.

``loss_dtype`` (``--loss-dtype``): ``fp32`` takes cross-entropy over an fp32 copy of the logits
(transformers' ``ForCausalLMLoss`` and memplan's step: ``logits.float()``); ``logits`` over the
logits in their own dtype, as a plain PyTorch loop calling ``F.cross_entropy(logits, targets)``
under autocast does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from memplan.errors import InputError
from memplan.memory.terms import LIBRARY_CODE_BYTES, library_code_resident_bytes
from memplan.setup import CHECKPOINTINGS, LORA_TARGET_NAMES, OPTIMIZERS, PRECISIONS, SHARDINGS
from memplan.units import possessive

LOSS_DTYPES = ("fp32", "logits")
FP32, HALF, MASK = 4, 2, 1


def _n(setup) -> int:
    return setup.micro_batch * setup.ctx


def _a(setup) -> int:
    return setup.compute_bytes


def _r(setup) -> int:
    return HALF if setup.precision == "bf16" else FP32


@dataclass(frozen=True)
class Stack:
    """The walk's hooks for one stack's code: memplan's own step, every hook adding nothing. A subclass
    (one module per library) names itself in ``name`` and overrides the hooks and attributes its code changes."""

    name: ClassVar[str] = "memplan"
    library: ClassVar[str | None] = None  # the library whose code the stack follows; None: memplan's own
    # what the stack's code has (``--precision``, ``--attention``, ``--checkpointing``, ``--sharding``)
    precisions: ClassVar[tuple[str, ...]] = PRECISIONS
    attentions: ClassVar[tuple[str, ...]] = ("sdpa", "eager")
    checkpointings: ClassVar[tuple[str, ...]] = CHECKPOINTINGS
    shardings: ClassVar[tuple[str, ...]] = SHARDINGS  # FSDP: memplan's own step, and torchtune's
    # FSDP2's root given reshard_after_forward=True by the stack's code (torchtune's shard_model): unlike
    # fully_shard's default (None: the root keeps its parameters from forward to backward), the root reshards
    # when its forward ends and all-gathers again at its pre-backward (``memory.sharding.FullyShard``)
    fsdp_root_reshards_after_forward: ClassVar[bool] = False
    # whose FSDP the stack's code runs: "fsdp2" (``memory.sharding.FullyShard``) or "fsdp1" (litgpt's Fabric
    # FSDPStrategy: ``memory.fsdp1.FlatShard``)
    fsdp_layout: ClassVar[str] = "fsdp2"
    lora_default_dropout: ClassVar[float] = 0.0  # the stack's own LoRA dropout (peft's and torchtune's configs: 0.0)
    # memplan's trainer and torchtune's ``lora_llama3_2`` do not adapt a head tied to the token embedding
    adapts_tied_head: ClassVar[bool] = False
    # memplan's selective checkpointing keeps each base matmul's output, which an adapter adds into in place
    lora_with_selective: ClassVar[bool] = False
    # memplan's ``LoRALinear`` adds the base's input gradient into the adapter's in place (terms.input_gradient_sum_bytes)
    sums_input_gradient_in_place: ClassVar[bool] = True
    # the trainer's compile is planned for memplan's own model only (memory.compiled.compiled_modelled)
    compiles: ClassVar[bool] = True
    # the optimizers the stack's code takes (``--optimizer``: what estimate's levers may offer)
    optimizers: ClassVar[tuple[str, ...]] = OPTIMIZERS
    # the optimizers ``memplan autotune`` tries for the stack, fused first (it wins the tie with foreach: same time,
    # less memory): memplan's own keeps exact AdamW; a stack whose config names bitsandbytes' 8-bit AdamW adds
    # ``adamw8bit`` (tried on CUDA devices, and chosen only where no exact AdamW plan fits)
    searched_optimizers: ClassVar[tuple[str, ...]] = ("adamw-fused", "adamw")
    # a plan for this stack trains transformers' model class (trainer.hf_model), not memplan's own
    trains_hf_model: ClassVar[bool] = False
    # memplan's SDPA repeats K and V where the kernel takes no grouped heads (memory.sdpa_gqa_repeats); the
    # libraries' own layouts are their hooks' (transformers passes enable_gqa to SDPA)
    walks_sdpa_gqa_repeat: ClassVar[bool] = True
    # the model's forward returns its logits converted to fp32 (Fabric's ``convert_output``): the low-precision
    # logits are freed before the loss reads the fp32 copy, which the loop keeps (``held_logits_bytes``)
    upcasts_output: ClassVar[bool] = False
    # the adapters have a dropout (--lora-dropout): memplan's own have none
    has_lora_dropout: ClassVar[bool] = False
    # estimate's Setup line: the step walked (", transformers' step"; "" for memplan's own) and its dropout's name
    step_words: ClassVar[str] = ""
    dropout_words: ClassVar[str] = "LoRA dropout"

    loss_dtype: str = "fp32"  # LOSS_DTYPES
    lora_dropout: float = 0.0  # the adapters' dropout (peft's LoraConfig.lora_dropout, ...)
    cpu: bool = False  # the step runs on the CPU (dropout's mask in the input's dtype)
    # memplan's own loop trains the stack's model class (``memplan train --stack transformers``, ``walked_for``):
    # the library's own training loop (transformers' ``Trainer``) and what it imports are not in the process
    own_loop: bool = False

    def describe(self) -> str:
        """estimate's Setup words for the step walked: "" for memplan's own, else the library's step and its
        adapters' dropout, and a loss on the logits' dtype."""
        words = self.step_words
        if words and self.lora_dropout:
            words += f" ({self.dropout_words} {self.lora_dropout:g})"
        if not self.fp32_loss:
            words += ", loss in the logits' dtype"
        return words

    # ---- checks: what the stack's code builds and runs ----------------------------------------

    def check_builds(self, spec, accepted: tuple[str, ...]) -> None:
        """The one-line InputError where the stack's code does not build ``spec``'s family: memplan's own
        trainer builds llama, gpt2 and gpt_neox only (``ModelSpec.memplan_builds``)."""
        if not spec.memplan_builds:
            others = [s for s in accepted if s != self.name]
            raise InputError(f"--stack {self.name}: memplan's own trainer does not build the {spec.arch} family "
                             f"(accepted for {spec.arch}: --stack {', '.join(others)})")

    def check_walked(self, setup) -> None:
        """The one-line InputError where the walk does not follow ``setup``'s checkpointing or sharding for the
        stack (checked before ``check_lora_targets``): memplan's own walk follows them all."""

    def check_setup(self, spec, setup) -> None:
        """The one-line InputError where the stack's code does not run ``setup``'s step for ``spec``, beyond
        ``check_lora_targets``: memplan's own runs every step it builds."""

    def check_lora_targets(self, spec, setup) -> None:
        """The one-line InputError where the stack's code cannot put adapters where ``--lora-targets`` says:
        the head of a tied model in memplan's trainer (the adapter could not be folded into the matrix the
        embedding shares; torchtune's too: ``adapts_tied_head``); memplan's selective checkpointing with any
        adapter: its policy keeps the base matmul's output (``trainer/model.py`` ``_SAVE_OPS``), which
        ``LoRALinear.forward`` adds into in place, so gpt2's and gpt_neox's recomputation fails ("Tensor cached
        during selective activation checkpoint has been mutated", their biased projections' addmm) and llama's
        walk was 16.5% over its trace (4 layers, hidden 256, ctx 128, micro-batch 2, rank 4)."""
        if not setup.lora_rank:
            return
        self._check_qkv_parts(spec, setup)
        if not self.lora_with_selective and setup.checkpointing == "selective":
            raise InputError("--checkpointing selective with --lora-rank: memplan's selective checkpointing keeps "
                             "each base matmul's output, which the adapter adds into in place (accepted with LoRA: "
                             "none, full)")
        if setup.lora_head and not self.adapts_tied_head and spec.tied:
            raise InputError(f"--lora-targets head: this model ties its LM head to the token embedding, and "
                             f"{possessive(self.name)} code does not adapt the one shared matrix (accepted for a tied "
                             f"model: {', '.join(t for t in LORA_TARGET_NAMES if t != 'head')})")

    def _check_qkv_parts(self, spec, setup) -> None:
        """q, k or v adapted alone: memplan's adapters sit on slices of the fused qkv matrix."""

    # ---- the walk's hooks: memplan's own step adds nothing ------------------------------------

    def block_saved_bytes(self, spec, setup) -> int:
        """Bytes one block saves for backward beyond memplan's own block (may be negative)."""
        return 0

    def first_block_unsaved_bytes(self, spec, setup) -> int:
        """Of ``block_saved_bytes``, what the first block does not save under LoRA (its input is frozen)."""
        return -self.first_block_saved_bytes(spec, setup)

    def adapter_saved_bytes(self, spec, setup, matrix: str) -> int:
        """Of ``block_saved_bytes``, what the adapters on ``matrix`` save, made where they run (peft's)."""
        return 0

    def norm_saved_bytes(self, spec, setup) -> int:
        """Of ``block_saved_bytes``, what each of the stack's block norms saves beyond memplan's, made where the
        norm runs (transformers' RMSNorm: its fp32 copy of the input)."""
        return 0

    def attention_saved_bytes(self, spec, setup) -> int:
        """Of ``block_saved_bytes``, what the stack's attention saves beyond memplan's, made where attention
        runs (transformers' fp32 softmax under eager attention; the fused qkv output its rotary does not keep)."""
        return 0

    def qk_norm_saved_bytes(self, spec, setup) -> int:
        """Of ``block_saved_bytes``, what the stack's per-head q/k norms save, made where attention runs (qwen3's)."""
        return 0

    def rotary_held_bytes(self, spec, setup) -> int:
        """Rotary outputs the stack's attention holds beyond the walk's from the rotary to the out-projection."""
        return 0

    def rotary_transient_bytes(self, spec, setup) -> int:
        """What the stack's qk norms and rotary hold at once beyond the walk's tensors (made and freed there)."""
        return 0

    def softmax_backward_bytes(self, spec, setup) -> int:
        """Temporaries the stack's eager softmax backward holds at once beyond the walk's (transformers' fp32 one)."""
        return 0

    def qk_norm_backward_bytes(self, spec, setup) -> int:
        """Temporaries the stack's qk norms' backward holds at once beyond the walk's attention gradients."""
        return 0

    def recompute_gradient_bytes(self, spec, setup) -> int:
        """Gradients alive through a checkpointed block's recomputation, made before it (peft's)."""
        return 0

    def recompute_reaches_down_adapter(self, setup) -> bool:
        """Whether a checkpointed block's recomputation runs on into down's adapter, up to lora_A's output;
        memplan's walk stops before down."""
        return False

    def recompute_stop_bytes(self, spec, setup) -> int:
        """What is alive, unsaved, where a checkpointed block's recomputation stops, beyond what the walk holds."""
        return 0

    def lora_forward_transient_bytes(self, spec, setup, matrix: str) -> int:
        """The adapter forward's transient beyond memplan's n·out·a, for ``matrix`` (may be negative)."""
        return 0

    def lora_input_release(self, spec, setup, matrix: str) -> tuple[int, int] | None:
        """Where a stack's adapter releases its saved input in its own backward (peft's ``lora_A``):
        (bytes saved beyond memplan's adapter input, the adapter's input-gradient bytes before the
        cast back); None where the walk's own order holds (memplan's)."""
        return None

    def lora_head_saved_bytes(self, spec, setup, frozen_input: bool = False) -> int:
        """What the stack's head adapter saves beyond memplan's (its input, x·Aᵀ) (may be negative);
        ``frozen_input``: the head's input needs no gradient (no block trains)."""
        return 0

    def lora_head_input_held_bytes(self, spec, setup) -> int:
        """The head's input the stack's model holds to the end of its forward beside the head adapter's saved
        input."""
        return 0

    def mlp_backward_scratch_bytes(self, spec, setup) -> int:
        """Temporaries a non-gated MLP's activation backward holds beyond memplan's one input gradient."""
        return 0

    def norm_backward_bytes(self, spec, setup, held: int, saved_held: bool = True) -> int:
        """Temporaries a norm's backward holds at once beyond the ``held`` bytes of memplan's fused norm's peak
        (and the norm's saved tensors, where the walk still holds them: ``saved_held``)."""
        return 0

    def final_norm_saved_bytes(self, spec, setup) -> int:
        """Bytes the final norm saves beyond memplan's."""
        return 0

    def head_weight_casts_bytes(self, spec, setup) -> int:
        """Autocast's copies of the LM head's weight beyond the walk's one, made in the head's forward and
        saved to its backward (a frozen head run in chunks: one per chunk)."""
        return 0

    def logits_grad_chunks(self, spec, setup) -> int:
        """How many pieces the logits' gradient comes in, each cast back to the logits' dtype as its own
        backward reaches it (a head run in chunks); 1: the whole gradient, cast back at once."""
        return 1

    def held_logits_bytes(self, spec, setup) -> int:
        """Logits the stack's loop keeps alive from the LM head's backward to the end of the step."""
        return 0

    def chunked_loss_backward_bytes(self, spec, setup) -> int:
        """Loss bytes (≤ 0) a chunked loss has freed by the moment its gradient is whole."""
        return 0

    def chunked_upcast_bytes(self, spec, setup) -> int:
        """Bytes (≤ 0) of the logits' fp32 copy a loss upcasting chunk by chunk never holds."""
        return 0

    def buffer_bytes_delta(self, spec, setup) -> int:
        """Buffers (rotary tables) the stack's model keeps beyond memplan's."""
        return 0

    def first_block_saved_bytes(self, spec, setup) -> int:
        """Bytes (≤ 0) the first block saves short of the others (LoRA: its input needs no gradient)."""
        return 0

    def chunked_head_grad_bytes(self, spec, setup) -> int:
        """Temporaries of a head run in chunks, summing its weight's gradients, at the head's backward."""
        return 0

    def optimizer_scratch_bytes(self, spec, setup) -> int:
        """Scratch of a stack's own optimizer loop at the optimizer step (beyond the walked optimizer's)."""
        return 0

    def model_code_bytes(self, setup, transformers_bytes: int | None = None, peft_bytes: int | None = None) -> int:
        """CPU: what the stack's model code keeps resident in the training process beyond the runtime context
        (memplan's own code is in the context; litgpt's and torchtune's: ``library_code_resident_bytes``,
        transformers' overrides it). ``transformers_bytes``/``peft_bytes``: the device's measured figures, None
        for the default."""
        return library_code_resident_bytes(self.library) if self.library in LIBRARY_CODE_BYTES else 0

    def walked_setup(self, setup):
        """The step the stack's code takes for ``setup`` (its own optimizer)."""
        return setup

    def walked_spec(self, spec):
        """The model the stack's code builds for ``spec``."""
        return spec

    def lora_bytes_delta(self, spec, setup) -> int:
        """Bytes of adapter weights beyond memplan's (their gradients alike; optimizer state follows)."""
        return 0

    def lora_tensors_delta(self, spec, setup) -> int:
        """Adapter parameter tensors beyond memplan's (AdamW keeps a ``step`` per tensor)."""
        return 0

    @property
    def checkpointed_input_needs_grad(self) -> bool:
        """Whether checkpointing makes the blocks' input require a gradient even where nothing below them
        trains (transformers' ``enable_input_require_grads()``)."""
        return False

    @property
    def ddp_gradient_as_bucket_view(self) -> bool:
        """Whether DDP's ``.grad`` are views into its buckets: memplan's trainer sets
        ``gradient_as_bucket_view=True`` (``trainer/distributed.py``)."""
        return True

    @property
    def fp32_loss(self) -> bool:
        """Whether the loss upcasts the logits (``logits.float()``)."""
        return self.loss_dtype == "fp32"

    def on_cpu(self, cpu: bool) -> "Stack":
        """The same hooks for a step on the CPU (True) or an accelerator."""
        return dataclasses.replace(self, cpu=cpu)
