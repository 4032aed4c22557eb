"""Data parallelism's memory: DDP's gradient buckets, FSDP2's shards, all-gathers and reduce-scatters, and the
walk's sharding hooks that place them in a step (``Replicated``: one process or DDP; ``FullyShard``: an FSDP2 rank)."""

from __future__ import annotations

from memplan.memory.terms import (ADAM_STEP_BYTES, ADAMW_STATES_PER_PARAM, SGD_STATES_PER_PARAM, _layer_matrices,
                                  _qkv_width, _up_width, gradient_bytes, lora_adapter_shapes, lora_tensors,
                                  optimizer_state_bytes,
                                  optimizer_temporary_bytes, trainable_params, weight_bytes)
from memplan.model import ModelSpec
from memplan.setup import FP32_BYTES, HALF_BYTES, TrainSetup

COLLECTIVES = ("nccl", "gloo")  # process-group backends: NCCL (RCCL on ROCm), gloo (CPU)
COLLECTIVES_OF_FAMILY = {"cuda": "nccl", "rocm": "nccl", "cpu": "gloo", "mps": "gloo"}


# ---- data parallel: DDP's buckets -------------------------------------------------------

def ddp_bucket_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """DDP's gradient buckets, T·p (T = trainable_params: all N, under LoRA the adapters only, since
    ``Reducer`` buckets only the parameters that require a gradient): one flat tensor per bucket in the
    gradients' dtype, made when DDP wraps the model and kept for the whole run. With
    ``gradient_as_bucket_view`` (and ``zero_grad(set_to_none=False)``) every ``.grad`` is a view into
    them, so under DDP the gradients exist for the whole step, all-reduced in place; each new weight
    gradient of a backward is a temporary that is added into its view and freed, as under accumulation.
    The step's all-reduce moves the same bytes (``memplan.comm``)."""
    return trainable_params(spec, setup) * setup.param_bytes


def ddp_separate_bucket_bytes(spec: ModelSpec, setup: TrainSetup, extra_gradient_bytes: int = 0) -> int:
    """DDP's buckets where ``.grad`` is not a view into them (PyTorch's default,
    ``DistributedDataParallel(gradient_as_bucket_view=False)``, as transformers' Trainer wraps the
    model): a second gradient-sized buffer, one flat tensor per bucket of the trainable parameters
    (T·p, T = trainable_params, LoRA: the adapters, plus a stack's extra adapter bytes), kept for
    the whole run; each ``.grad`` is copied into its bucket for the all-reduce and copied back
    (``Reducer::copy_bucket_to_grad``)."""
    return trainable_params(spec, setup) * setup.param_bytes + extra_gradient_bytes


def gradients_persist(setup: TrainSetup) -> bool:
    """Whether ``.grad`` exists before a micro-batch's backward: under gradient accumulation (the
    earlier micro-batches') and under DDP (its buckets)."""
    return setup.grad_accum > 1 or setup.sharding == "ddp"



# ---- FSDP2: shards, all-gathers and reduce-scatters ------------------------------------------
#
# trainer/distributed.py applies ``fully_shard`` to every block and then to the root (embedding,
# position table, final norm, untied head): L + 1 parameter groups, each sharded on dim 0 across
# the W ranks. Notation: c = bytes of an all-gathered parameter (FSDP2's param_dtype: 2 under
# bf16-mixed / fp16-mixed, else p), g = bytes of a reduced gradient (reduce_dtype: 4 under mixed
# precision, else p), pad(G) = Σ over G's tensors of ceil(rows/W)·row_length, the padded shard
# every rank stores, and local(G, rank) = the rows that rank really holds (rank 0 holds the
# most: ceil(rows/W); the last may hold fewer, even none).

def param_shapes(spec: ModelSpec) -> dict[str, list[tuple[int, int]]]:
    """(rows, row length) of every parameter tensor of one block and of the root, as
    trainer/model.py makes them: nn.Linear weights are (out, in), 1-D tensors are (n, 1)."""
    h = spec.hidden
    norm = [(h, 1)] * (2 if spec.norm == "layernorm" else 1)
    qkv, up = _qkv_width(spec), _up_width(spec)
    block = [*norm, (qkv, h)]
    if spec.bias or spec.qkv_bias:
        block.append((qkv, 1))
    block.append((h, h))
    if spec.bias:
        block.append((h, 1))
    block += [*norm, (up, h)]
    if spec.bias:
        block.append((up, 1))
    block.append((h, spec.ffn))
    if spec.bias:
        block.append((h, 1))
    root = [(spec.vocab, h)]
    if spec.pos == "learned":
        root.append((spec.max_positions, h))
    root += norm
    if not spec.tied:
        root.append((spec.vocab, h))
    # torchtune's custom_sharded_layers (memory.stacks.torchtune_fsdp): the embedding and the untied head
    # each a group of their own, the root keeping the rest
    groups = {"embedding": [(spec.vocab, h)], "head": [] if spec.tied else [(spec.vocab, h)],
              "root_rest": root[1:] if spec.tied else root[1:-1]}
    return {"block": block, "root": root} | groups


# ---- FSDP2 + LoRA: frozen base shards beside the adapters' -------------------------------------------
#
# trainer/finetune.py builds the base model, puts the adapters on it (trainer/lora.py ``apply_lora``: every
# base weight ``requires_grad_(False)``, each adapter's A (r × in) and B (out × r) a parameter of its
# LoRALinear, in the base weight's dtype) and only then ``fully_shard``s each block and the root: a group's
# parameters are its frozen base tensors and its adapters, all sharded on dim 0 and all all-gathered, but
# FSDP2's post-backward reduce-scatters only the parameters that got a gradient (``FSDPParamGroup
# .post_backward``: ``fsdp_params_with_grad``), the adapters; the root has none but the head's adapter.

def lora_adapter_param_shapes(spec: ModelSpec, setup: TrainSetup) -> dict[str, list[tuple[int, int]]]:
    """(rows, row length) of the adapters' parameters of one block and of the root, in the order FSDP2 holds
    them (``LoRALinear`` registers ``lora_a``, ``lora_b`` before its child ``base``; matrices in the block's
    order): A is (r, in), B is (out, r); the root holds the head's adapter (``--lora-targets head``) only."""
    r = setup.lora_rank

    def adapters(matrix: str) -> list[tuple[int, int]]:
        return [t for fan_in, fan_out in lora_adapter_shapes(spec, setup, matrix) for t in ((r, fan_in), (fan_out, r))]

    return {"block": [t for mm in ("qkv", "proj", "up", "down") for t in adapters(mm)], "root": adapters("head"),
            "embedding": [], "head": adapters("head"), "root_rest": []}


def fsdp_trained_shapes(spec: ModelSpec, setup: TrainSetup, group: str) -> list[tuple[int, int]]:
    """The tensors of a group that get gradients (reduce-scattered, optimizer state): all of them, or under
    LoRA only the adapters (``lora_adapter_param_shapes``)."""
    if setup.lora_rank:
        return lora_adapter_param_shapes(spec, setup)[group]
    return param_shapes(spec)[group]


def fsdp_held_shapes(spec: ModelSpec, setup: TrainSetup, group: str) -> list[tuple[int, int]]:
    """Every tensor a group shards and all-gathers: the base model's, plus under LoRA the adapters (the
    frozen base weights are sharded and all-gathered all the same)."""
    extra = lora_adapter_param_shapes(spec, setup)[group] if setup.lora_rank else []
    return param_shapes(spec)[group] + extra


def shard_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of a dim-0 shard on ``rank``: torch.chunk's split, ceil(rows/W) each, the last ones short."""
    per = -(-rows // world_size)
    return max(0, min(per, rows - rank * per))


def padded_shard_numel(shapes: list[tuple[int, int]], world_size: int) -> int:
    """pad(G): the elements of a group's padded shard, Σ ceil(rows/W)·row_length; what every
    rank stores as its sharded parameters and what each rank sends to an all-gather."""
    return sum(-(-rows // world_size) * length for rows, length in shapes)


def local_shard_numel(shapes: list[tuple[int, int]], world_size: int, rank: int) -> int:
    """local(G, rank): the elements a rank's shard really holds (no padding); optimizer states
    are made like the sharded parameters' local tensors, so they have this size."""
    return sum(shard_rows(rows, world_size, rank) * length for rows, length in shapes)


def fsdp_gather_bytes(setup: TrainSetup) -> int:
    """c: bytes per all-gathered parameter element (FSDP2's param_dtype)."""
    return HALF_BYTES if setup.mixed else setup.param_bytes


def fsdp_reduce_bytes(setup: TrainSetup) -> int:
    """g: bytes per reduce-scattered gradient element (reduce_dtype fp32 under mixed precision)."""
    return FP32_BYTES if setup.mixed else setup.param_bytes


def fsdp_group_numel(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """pad(G) of a block or of the root (under LoRA its frozen base tensors and its adapters: ``fsdp_held_shapes``)."""
    return padded_shard_numel(fsdp_held_shapes(spec, setup, group), setup.world_size)


def fsdp_trained_numel(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """pad(T): the padded shard of a group's tensors that get gradients (``fsdp_trained_shapes``: under LoRA the
    adapters' only), what FSDP2's ``foreach_reduce`` packs and reduce-scatters; 0 for a group with none."""
    return padded_shard_numel(fsdp_trained_shapes(spec, setup, group), setup.world_size)


def fsdp_sharded_weight_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Every rank's sharded parameters (fp32 master weights under mixed precision), padded:
    (L·pad(block) + pad(root))·p."""
    return (spec.layers * fsdp_group_numel(spec, setup, "block")
            + fsdp_group_numel(spec, setup, "root")) * setup.param_bytes


def fsdp_unsharded_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """A group's all-gathered parameters, W·pad(G)·c: once as the all-gather's output buffer,
    once more as the unsharded parameters copied out of it (each its own tensor)."""
    return setup.world_size * fsdp_group_numel(spec, setup, group) * fsdp_gather_bytes(setup)


def fsdp_copy_in_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """Under mixed precision, the shard cast to param_dtype for the all-gather, pad(G)·c (FSDP2's
    foreach copy-in); 0 otherwise (the shard itself is sent)."""
    return fsdp_group_numel(spec, setup, group) * fsdp_gather_bytes(setup) if setup.mixed else 0


def fsdp_reduce_scatter_input_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """A group's gradients packed for the reduce-scatter in the reduce dtype, W·pad(T)·g (T: the tensors with a
    gradient, ``fsdp_trained_numel``; all of G without LoRA). FSDP2 keeps it until the next group's
    reduce-scatter is issued (one in flight), the root's until the end of the backward."""
    return setup.world_size * fsdp_trained_numel(spec, setup, group) * fsdp_reduce_bytes(setup)


def fsdp_sharded_grad_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """A group's reduce-scatter output, pad(T)·g: the sharded ``.grad`` of its trained parameters are
    views into it (under accumulation the next micro-batches' outputs are added in and freed)."""
    return fsdp_trained_numel(spec, setup, group) * fsdp_reduce_bytes(setup)


def fsdp_all_sharded_grad_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """All sharded gradients, (L·pad(block) + pad(root))·g."""
    return (spec.layers * fsdp_sharded_grad_bytes(spec, setup, "block")
            + fsdp_sharded_grad_bytes(spec, setup, "root"))


def fsdp_local_params(spec: ModelSpec, setup: TrainSetup, rank: int, decay_only: bool = False) -> int:
    """Trained parameters whose shard ``rank`` holds (all, or only the weight-decay group: tensors of 2 dims;
    under LoRA the adapters only, ``fsdp_trained_shapes``: the optimizer is given nothing else)."""
    shapes = {g: fsdp_trained_shapes(spec, setup, g) for g in ("block", "root")}
    pick = (lambda s: [t for t in s if t[1] > 1 or setup.lora_rank]) if decay_only else (lambda s: s)
    return (spec.layers * local_shard_numel(pick(shapes["block"]), setup.world_size, rank)
            + local_shard_numel(pick(shapes["root"]), setup.world_size, rank))


def fsdp_optimizer_state_bytes(spec: ModelSpec, setup: TrainSetup, rank: int = 0) -> int:
    """The optimizer state of ``rank``'s shards: as ``optimizer_state_bytes`` with local(rank)
    parameters (AdamW's 0-dim ``step`` per tensor stays whole; under LoRA one per adapter tensor, ``lora_tensors``)."""
    n = fsdp_local_params(spec, setup, rank)
    if setup.optimizer in ("adamw", "adamw-fused"):
        tensors = lora_tensors(spec, setup) if setup.lora_rank else spec.n_tensors
        return ADAMW_STATES_PER_PARAM * n * setup.param_bytes + tensors * ADAM_STEP_BYTES
    if setup.optimizer == "sgd":
        return SGD_STATES_PER_PARAM * n * setup.param_bytes
    raise ValueError("adamw8bit does not run under FSDP2")  # TrainSetup refuses the combination


def fsdp_optimizer_temporary_bytes(spec: ModelSpec, setup: TrainSetup, rank: int = 0) -> int:
    """The foreach optimizer's parameter-sized scratch over ``rank``'s shards of the weight-decay
    group (see ``optimizer_temporary_bytes``); 0 for the fused kernel."""
    if setup.optimizer in ("adamw", "sgd"):
        return fsdp_local_params(spec, setup, rank, decay_only=True) * setup.param_bytes
    return 0


def gloo_reduce_scatter_copy_bytes(spec: ModelSpec, setup: TrainSetup, group: str, collectives: str) -> int:
    """gloo (CPU) reduce-scatters a copy of its input, W·pad(G)·g, made and freed within the
    call; NCCL/RCCL work on the buffers they are given (their own staging is outside PyTorch's
    allocator). 0 unless ``collectives`` is gloo."""
    return fsdp_reduce_scatter_input_bytes(spec, setup, group) if collectives == "gloo" else 0


def fsdp_compute_setup(setup: TrainSetup) -> TrainSetup:
    """The setup the activations of an FSDP2 step follow. Under bf16-mixed / fp16-mixed the
    MixedPrecisionPolicy replaces autocast: the gathered parameters are 16-bit, so the embedding,
    the residual stream and every activation and unsharded gradient are too, as in a pure bf16
    step (fp16's sizes are bf16's). Walked as one micro-batch, without accumulation."""
    return setup.replace(precision="bf16" if setup.mixed else setup.precision, grad_accum=1, world_size=1,
                         sharding="none")


# ---- the sharding hooks of the walk ------------------------------------------------------------
#
# The walk (memplan.memory.walk) is one sequence of a step's ops; a sharding hook adds what the
# processes' layout makes beside them, at fixed points: the persistent state (whole or sharded),
# the parameters' all-gathers before each group's forward and backward, the gradients' placement
# (allocated by the backward, held in DDP's buckets, or reduce-scattered into shards), and the
# optimizer's scratch. Each method names the tensors it allocates and frees.

class Replicated:
    """The sharding hook of a step whose every process holds the whole model: one process, or DDP.

    Gradients are made by the backward as ``.grad``; they exist before it under gradient accumulation
    (the earlier micro-batches') and under DDP with ``gradient_as_bucket_view`` (its buckets,
    ``ddp_bucket_bytes``), where each new weight gradient is added into its view and freed. Where
    ``.grad`` is not a view into the buckets (``Stack.ddp_gradient_as_bucket_view``: transformers'
    Trainer), the buckets are a second buffer (``ddp_separate_bucket_bytes``) and ``.grad`` is made as
    without DDP. Nothing is gathered: the methods for FSDP2's collectives do nothing."""

    ends = 1  # blocks walked one by one at each end of the stack (the last and the first)
    lora_outside_blocks = True  # LoRA freezes the head and the embedding, and the first block saves less

    def __init__(self, spec: ModelSpec, setup: TrainSetup, stack) -> None:
        self.spec, self.setup = spec, setup
        self.compute_setup = setup  # the setup the activations follow
        self.separate_buckets = setup.sharding == "ddp" and not stack.ddp_gradient_as_bucket_view
        self.accum = setup.grad_accum > 1 if self.separate_buckets else gradients_persist(setup)
        self.block_gradients_persist = self.accum  # the matmuls' backward adds into an existing .grad

    def weight_bytes(self) -> int:
        """Every parameter, whole (``terms.weight_bytes``)."""
        return weight_bytes(self.spec, self.setup)

    def stack_adapter_bytes(self, extra_adapters: int) -> int:
        """This process's copy of a stack's adapters beyond memplan's (``Stack.lora_bytes_delta``): all of them."""
        return extra_adapters

    def optimizer_state_bytes(self) -> int:
        """The optimizer state of every parameter (``terms.optimizer_state_bytes``)."""
        return optimizer_state_bytes(self.spec, self.setup)

    def persistent_gradients(self, w, extra_adapters: int) -> None:
        """Gradients alive before the step's last backward: DDP's separate buckets; the earlier micro-batches'
        ``.grad`` or DDP's bucket views (a stack's extra adapters' gradients included)."""
        if self.separate_buckets:
            w.alloc("gradients", ddp_separate_bucket_bytes(self.spec, self.setup, extra_adapters))
        if not self.accum:
            return
        if self.setup.sharding == "ddp" and not self.separate_buckets:
            w.alloc("gradients", ddp_bucket_bytes(self.spec, self.setup))
        else:
            w.alloc("gradients", gradient_bytes(self.spec, self.setup) + extra_adapters)

    def before_embedding(self, w) -> None:
        """FSDP2's root all-gather; nothing here."""

    def before_blocks_forward(self, w) -> None:
        """FSDP2's first block all-gather; nothing here."""

    def between_blocks_forward(self, w) -> None:
        """FSDP2's reshard of the first block; nothing here."""

    def before_last_block_forward(self, w) -> None:
        """FSDP2's last block all-gather; nothing here."""

    def after_block_forward(self, w) -> None:
        """FSDP2's reshard after the forward; nothing here."""

    def after_head_forward(self, w) -> None:
        """FSDP2's last all-gather output released; nothing here."""

    def before_head_backward(self, w) -> None:
        """FSDP2's prefetch of the last block; nothing here."""

    def after_head_chunks(self, w, sums: int) -> None:
        """A stack's own FSDP2 layout at its head's last chunk (``TorchtuneShard``); nothing here."""

    def after_final_norm_backward(self, w) -> None:
        """FSDP2's final norm gradient; here it is added with the blocks' vectors (``after_blocks_backward``)."""

    def before_block_backward(self, w, which: str, index: int) -> None:
        """FSDP2's copy-out and prefetch; nothing here."""

    def after_block_backward(self, w, which: str) -> None:
        """FSDP2's reduce-scatter; nothing here."""

    def middle_gradients(self, w, middle: int, per_block: int) -> None:
        """The gradients the blocks between the walked ones leave: ``per_block`` bytes each, as ``.grad``
        (nothing new where ``.grad`` persists: each was added into)."""
        if not self.accum:
            w.alloc("gradients", middle * per_block)

    def after_blocks_backward(self, w, lora: bool, extra_adapters: int) -> None:
        """Gradients of every block's norm weights and biases and of the final norm, N_vectors·p (not under LoRA:
        they are frozen), and of a stack's adapters beyond memplan's, unless ``.grad`` persists."""
        if self.accum:
            return
        spec, p = self.spec, self.setup.param_bytes
        if not lora:
            vectors = spec.layer_params - sum(_layer_matrices(spec).values())
            w.alloc("gradients", spec.layers * vectors * p + spec.norm_params * p)
        w.alloc("gradients", extra_adapters)

    def after_embedding_backward(self, w) -> None:
        """FSDP2's root reduce-scatter; nothing here."""

    def optimizer_temporary_bytes(self) -> int:
        """The optimizer's scratch over every parameter (``terms.optimizer_temporary_bytes``)."""
        return optimizer_temporary_bytes(self.spec, self.setup)


class FullyShard(Replicated):
    """The sharding hook of an FSDP2 step of ``rank`` (``trainer/distributed.py``'s ``fully_shard``).

    The activations follow the compute setup (``fsdp_compute_setup``): one micro-batch in the
    MixedPrecisionPolicy's dtype, no autocast. Forward: the root's parameters are all-gathered first
    and stay unsharded until the end of the backward. Before each block: its shard cast for the
    all-gather (mixed precision), the all-gather's output, then the unsharded parameters copied out of
    it (the previous group's output is released only then); after the block, the unsharded parameters
    are freed but the output is kept until the next block's copy-out (the root frees the last one when
    its forward ends). Backward: the loss's gradient reaching the logits all-gathers the last block
    (prefetch); before each block's backward its parameters are copied out (the output freed) and the
    block before it is all-gathered (but before the first block's: the root is unsharded); after it, the
    unsharded parameters are freed, the previous reduce-scatter input released, the block's gradients
    packed into this reduce-scatter input (the unsharded gradients freed) and reduce-scattered into the
    sharded gradients. The root's reduce-scatter ends the backward. Categories: sharded and unsharded
    parameters are weights; all-gather and reduce-scatter buffers, temporaries; unsharded and sharded
    gradients, gradients.

    The last block prefetches the one before it and holds no reduce-scatter input yet; the first
    prefetches nothing; the blocks in between do both and are alike, so the walk takes two blocks at
    each end (``ends``) and the peak over the rest is at the second block from either end. The walk
    follows LoRA inside the blocks only (``lora_outside_blocks``): the root's parameters and the first
    block are walked as without adapters; under LoRA (``lora_outside_blocks`` then True, as for one process)
    the embedding, norms and base matrices are frozen: the ``*_lora`` methods say what that changes.
    """

    ends = 2
    lora_outside_blocks = False

    def __init__(self, spec: ModelSpec, setup: TrainSetup, rank: int = 0, collectives: str = "nccl",
                 stack=None) -> None:
        self.spec, self.setup, self.rank = spec, setup, rank
        self.compute_setup = fsdp_compute_setup(setup)
        self.accum = False  # the walked micro-batch makes unsharded gradients; the sharded ones are added into
        # each micro-batch's unsharded gradients are new: FSDP2's post-backward takes every unsharded ``.grad``
        # for its reduce-scatter and sets it to None (``FSDPParamGroup.post_backward``), so a matmul's weight
        # gradient is allocated as ``.grad`` in every micro-batch, never added into one
        self.block_gradients_persist = False
        self.first_micro = setup.grad_accum == 1  # no sharded gradients before this micro-batch
        self.c = fsdp_gather_bytes(setup)
        self.lora_outside_blocks = lora_freezes_root(setup)
        self.group_bytes(spec, setup, collectives)
        self.held = 0  # the reduce-scatter input FSDP2 keeps in flight
        # another stack's FSDP2 (``Stack.fsdp_root_reshards_after_forward``, its extra adapters in each block)
        self.root_reshards = bool(stack is not None and stack.fsdp_root_reshards_after_forward)
        extra = stack.lora_bytes_delta(spec, self.compute_setup) if stack is not None else 0
        self.extra_block = fsdp_stack_adapter_block_numel(spec, setup, extra)
        self.extra_grad = self.extra_block * self.c  # their unsharded gradients
        self.extra_shard = -(-self.extra_block // setup.world_size)  # ceil(e/W)
        if self.extra_block:  # gathered, packed and reduce-scattered with the block
            self.gathered["block"] += setup.world_size * self.extra_shard * self.c
            self.rs_input["block"] += setup.world_size * self.extra_shard * fsdp_reduce_bytes(setup)
            self.sharded_grad["block"] += self.extra_shard * fsdp_reduce_bytes(setup)
            self.gloo_copy["block"] = gloo_reduce_scatter_copy_bytes(spec, setup, "block", collectives) and \
                self.rs_input["block"]

    def group_bytes(self, spec: ModelSpec, setup: TrainSetup, collectives: str) -> None:
        """Each group's (a block's, the root's) all-gather output, copy-in, reduce-scatter input, sharded
        gradients and gloo's reduce-scatter copy, in ``setup``'s dtypes."""
        groups = ("block", "root")
        self.gathered = {g: fsdp_unsharded_bytes(spec, setup, g) for g in groups}
        self.copy_in = {g: fsdp_copy_in_bytes(spec, setup, g) for g in groups}
        self.rs_input = {g: fsdp_reduce_scatter_input_bytes(spec, setup, g) for g in groups}
        self.sharded_grad = {g: fsdp_sharded_grad_bytes(spec, setup, g) for g in groups}
        self.gloo_copy = {g: gloo_reduce_scatter_copy_bytes(spec, setup, g, collectives) for g in groups}

    def weight_bytes(self) -> int:
        """This rank's sharded parameters, padded (``fsdp_sharded_weight_bytes``)."""
        return fsdp_sharded_weight_bytes(self.spec, self.setup)

    def stack_adapter_bytes(self, extra_adapters: int) -> int:
        """This rank's shard of a stack's adapters beyond memplan's: L·ceil(e/W)·p, e = a block's
        (``fsdp_stack_adapter_block_numel``), sharded with the block they are in."""
        return self.spec.layers * self.extra_shard * self.setup.param_bytes if extra_adapters else 0

    def optimizer_state_bytes(self) -> int:
        """The optimizer state of this rank's shards (``fsdp_optimizer_state_bytes``)."""
        return fsdp_optimizer_state_bytes(self.spec, self.setup, self.rank)

    def persistent_gradients(self, w, extra_adapters: int) -> None:
        """The sharded gradients of the earlier micro-batches (``fsdp_all_sharded_grad_bytes``)."""
        if not self.first_micro:
            w.alloc("gradients", self.spec.layers * self.sharded_grad["block"] + self.sharded_grad["root"])

    def _all_gather(self, w, group: str) -> None:
        """A group's all-gather: the copy-in (the shard cast to param_dtype), the output buffer."""
        w.alloc("temporaries", self.copy_in[group])
        w.alloc("temporaries", self.gathered[group])
        w.free("temporaries", self.copy_in[group])

    def _copy_out(self, w, group: str) -> None:
        """The unsharded parameters copied out of the all-gather's output, which is released."""
        w.alloc("weights", self.gathered[group])
        w.free("temporaries", self.gathered[group])

    def before_embedding(self, w) -> None:
        """The root's all-gather, its parameters copied out; the output is kept until block 0's copy-out."""
        w.where = "forward: root all-gather"
        self._all_gather(w, "root")
        w.alloc("weights", self.gathered["root"])

    def before_blocks_forward(self, w) -> None:
        """Block 0's all-gather and copy-out; the root's all-gather output released when the copy-out returns."""
        w.where = "forward: block all-gather"
        self._all_gather(w, "block")
        w.alloc("weights", self.gathered["block"])
        w.free("temporaries", self.gathered["root"])

    def between_blocks_forward(self, w) -> None:
        """Blocks 0 … L-2: each forward, reshard and the next all-gather alike; block 0's parameters resharded."""
        w.free("weights", self.gathered["block"])

    def before_last_block_forward(self, w) -> None:
        """The last block's all-gather (the one before still held) and copy-out."""
        self._all_gather(w, "block")
        self._copy_out(w, "block")

    def after_block_forward(self, w) -> None:
        """The last block's unsharded parameters freed (resharded after forward)."""
        w.free("weights", self.gathered["block"])

    def after_head_forward(self, w) -> None:
        """The root's forward ends: the last all-gather output released; where the root reshards after forward
        (``root_reshards``), its unsharded parameters freed too."""
        w.free("temporaries", self.gathered["block"])
        if self.root_reshards:
            w.free("weights", self.gathered["root"])

    def before_head_backward(self, w) -> None:
        """The loss's gradient reaching the logits: where the root resharded after forward, its pre-backward
        all-gathers it again and copies it out (in the backward the output is released at once); then the
        last block's all-gather (prefetch)."""
        if self.root_reshards:
            w.where = "backward: root all-gather"
            self._all_gather(w, "root")
            self._copy_out(w, "root")
        w.where = "backward: last block's all-gather (prefetch)"
        self._all_gather(w, "block")

    def after_final_norm_backward(self, w) -> None:
        """The final norm's unsharded gradient, norm_params·c (none under LoRA: ``frozen_vector_grad_bytes``)."""
        w.alloc("gradients", frozen_vector_grad_bytes(self.setup, self.spec.norm_params * self.c))

    def before_block_backward(self, w, which: str, index: int) -> None:
        """The block's parameters copied out, then (but before the first block's: the root is unsharded)
        the block before it all-gathered."""
        w.where = f"backward: the {which} block's copy-out"
        self._copy_out(w, "block")
        if index > 0:
            w.where = f"backward: all-gather of the block before the {which}"
            self._all_gather(w, "block")

    def _reduce_scatter(self, w, group: str, unsharded_grad_bytes: int) -> None:
        """A group's post-backward: reshard, release the held input, pack, free, reduce-scatter.

        FSDP2's foreach_reduce frees the unsharded gradients once they are packed, all but its
        last tensor's, which a loop variable keeps until the function returns. A group none of whose
        parameters got a gradient (LoRA's frozen root) is resharded only (``lora_reduces``)."""
        w.free("weights", self.gathered[group])  # unsharded parameters
        if not lora_reduces(self.spec, self.setup, group):
            return
        last_rows, last_length = fsdp_trained_shapes(self.spec, self.setup, group)[-1]
        last = last_rows * last_length * self.c
        w.free("temporaries", self.held)  # the previous group's reduce-scatter input
        w.alloc("temporaries", self.rs_input[group])
        w.free("gradients", unsharded_grad_bytes - last)
        w.alloc("gradients" if self.first_micro else "temporaries", self.sharded_grad[group])
        w.alloc("temporaries", self.gloo_copy[group])  # gloo's flat copy of the input, while it reduces
        w.free("temporaries", self.gloo_copy[group])
        if not self.first_micro:  # added into the sharded gradients of the earlier micro-batches, then freed
            w.free("temporaries", self.sharded_grad[group])
        w.free("gradients", last)
        self.held = self.rs_input[group]

    def after_block_backward(self, w, which: str) -> None:
        """The block's norms' (and biases') unsharded gradients, then its reduce-scatter."""
        spec = self.spec
        vectors = spec.layer_params - sum(_layer_matrices(spec).values())  # a block's norms and biases
        w.alloc("gradients", frozen_vector_grad_bytes(self.setup, vectors * self.c))
        w.alloc("gradients", self.extra_grad)  # a stack's extra adapters' unsharded gradients
        w.where = f"backward: the {which} block's reduce-scatter"
        self._reduce_scatter(w, "block", unsharded_grad_numel(spec, self.setup, "block") * self.c + self.extra_grad)

    def middle_gradients(self, w, middle: int, per_block: int) -> None:
        """Each block in between leaves its sharded gradients (pad(block)·g; added into under accumulation)."""
        if self.first_micro:
            w.alloc("gradients", middle * self.sharded_grad["block"])

    def after_blocks_backward(self, w, lora: bool, extra_adapters: int) -> None:
        """Nothing: every block's vectors went with its reduce-scatter, the final norm's before the blocks."""

    def after_embedding_backward(self, w) -> None:
        """The root's reduce-scatter; its input is released when the backward ends."""
        spec = self.spec
        w.where = "backward: the root's reduce-scatter"
        self._reduce_scatter(w, "root", unsharded_grad_numel(spec, self.setup, "root") * self.c)
        w.free("temporaries", self.held)

    def optimizer_temporary_bytes(self) -> int:
        """The optimizer's scratch over this rank's shards (``fsdp_optimizer_temporary_bytes``)."""
        return fsdp_optimizer_temporary_bytes(self.spec, self.setup, self.rank)


def fsdp_stack_adapter_block_numel(spec: ModelSpec, setup: TrainSetup, extra_adapter_bytes: int) -> int:
    """e: the elements of one block's adapters beyond memplan's that a stack makes (``Stack.lora_bytes_delta``,
    L·e·p: torchtune's separate q_proj, k_proj, v_proj, w1, w3 adapters, each its own ``lora_a``). They are
    parameters of the block's module, so FSDP2 shards them (ceil(e/W) each rank), all-gathers them with the
    block (W·ceil(e/W)·c more in its all-gather), and reduce-scatters their gradients (e·c unsharded, then
    W·ceil(e/W)·g packed and ceil(e/W)·g sharded). (Taken as one tensor: a tensor's rows pad on their own.)"""
    return extra_adapter_bytes // (spec.layers * setup.param_bytes)


def frozen_vector_grad_bytes(setup: TrainSetup, vector_grad_bytes: int) -> int:
    """The unsharded gradients of a group's norms and biases (the final norm's; a block's), as FSDP2's backward
    makes them: ``vector_grad_bytes``, or none under LoRA, whose ``apply_lora`` froze them (trainer/lora.py:
    ``p.requires_grad_(False)`` for every parameter before the adapters are made)."""
    return 0 if setup.lora_rank else vector_grad_bytes


def unsharded_grad_numel(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """Elements of a group's unsharded gradients at its post-backward (``FSDPParamGroup.post_backward``'s
    ``unsharded_grads``): every parameter of a block (spec.layer_params) or of the root, or under LoRA the
    adapters' only (a block's targeted matrices', the head's on the root)."""
    if setup.lora_rank:
        return sum(rows * length for rows, length in fsdp_trained_shapes(spec, setup, group))
    return spec.layer_params if group == "block" else spec.params - spec.layers * spec.layer_params


def lora_reduces(spec: ModelSpec, setup: TrainSetup, group: str) -> bool:
    """Whether a group's post-backward reduce-scatters: FSDP2 returns after resharding when none of its
    parameters has a gradient (``fsdp_params_with_grad`` empty), as LoRA's root without a head adapter."""
    return bool(fsdp_trained_shapes(spec, setup, group))


def lora_freezes_root(setup: TrainSetup) -> bool:
    """Whether the walk takes the root's parameters as frozen (``_Step.lora``: no embedding, head or final norm
    gradient, the first block's input and what precedes its first adapter unsaved), as for one process: under
    LoRA, whose ``apply_lora`` freezes every parameter before it makes the adapters (trainer/lora.py), and the
    FSDP2 wrapping that follows changes no ``requires_grad``."""
    return bool(setup.lora_rank)
