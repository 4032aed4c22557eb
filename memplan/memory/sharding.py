"""Data parallelism's memory: DDP's gradient buckets, and FSDP2's shards, all-gathers and reduce-scatters."""

from __future__ import annotations

from memplan.model import ModelSpec
from memplan.setup import FP32_BYTES, HALF_BYTES, TrainSetup
from memplan.memory.terms import (ADAM_STEP_BYTES, ADAMW_STATES_PER_PARAM, SGD_STATES_PER_PARAM, _qkv_width, _up_width,
                                  trainable_params)

COLLECTIVES = ("nccl", "gloo")  # process-group backends: NCCL (RCCL on ROCm), gloo (CPU)
COLLECTIVES_OF_FAMILY = {"cuda": "nccl", "rocm": "nccl", "cpu": "gloo", "mps": "gloo"}


# ---- data parallel: DDP's buckets -------------------------------------------------------

def ddp_bucket_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """DDP's gradient buckets, N·p: one flat tensor per bucket in the gradients' dtype, made
    when DDP wraps the model and kept for the whole run. With ``gradient_as_bucket_view`` (and
    ``zero_grad(set_to_none=False)``) every ``.grad`` is a view into them, so under DDP the
    gradients exist for the whole step, all-reduced in place; each new weight gradient of a
    backward is a temporary that is added into its view and freed, as under accumulation."""
    return spec.params * setup.param_bytes


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
    return {"block": block, "root": root}


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
    """pad(G) of a block or of the root."""
    return padded_shard_numel(param_shapes(spec)[group], setup.world_size)


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
    """A group's gradients packed for the reduce-scatter in the reduce dtype, W·pad(G)·g. FSDP2
    keeps it until the next group's reduce-scatter is issued (one in flight), the root's until
    the end of the backward."""
    return setup.world_size * fsdp_group_numel(spec, setup, group) * fsdp_reduce_bytes(setup)


def fsdp_sharded_grad_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """A group's reduce-scatter output, pad(G)·g: the sharded ``.grad`` of its parameters are
    views into it (under accumulation the next micro-batches' outputs are added in and freed)."""
    return fsdp_group_numel(spec, setup, group) * fsdp_reduce_bytes(setup)


def fsdp_all_sharded_grad_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """All sharded gradients, (L·pad(block) + pad(root))·g."""
    return (spec.layers * fsdp_sharded_grad_bytes(spec, setup, "block")
            + fsdp_sharded_grad_bytes(spec, setup, "root"))


def fsdp_local_params(spec: ModelSpec, setup: TrainSetup, rank: int, decay_only: bool = False) -> int:
    """Parameters whose shard ``rank`` holds (all, or only the weight-decay group: tensors of 2 dims)."""
    shapes = param_shapes(spec)
    pick = (lambda s: [t for t in s if t[1] > 1]) if decay_only else (lambda s: s)
    return (spec.layers * local_shard_numel(pick(shapes["block"]), setup.world_size, rank)
            + local_shard_numel(pick(shapes["root"]), setup.world_size, rank))


def fsdp_optimizer_state_bytes(spec: ModelSpec, setup: TrainSetup, rank: int = 0) -> int:
    """The optimizer state of ``rank``'s shards: as ``optimizer_state_bytes`` with local(rank)
    parameters (AdamW's 0-dim ``step`` per tensor stays whole)."""
    n = fsdp_local_params(spec, setup, rank)
    if setup.optimizer in ("adamw", "adamw-fused"):
        return ADAMW_STATES_PER_PARAM * n * setup.param_bytes + spec.n_tensors * ADAM_STEP_BYTES
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
