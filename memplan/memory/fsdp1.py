"""FSDP1's flat parameters, as litgpt's scripts shard with several devices: ``FlatShard``, the walk's sharding hook
of one rank of torch's ``FullyShardedDataParallel`` as Lightning Fabric's ``FSDPStrategy`` wraps litgpt's ``GPT``.

litgpt/pretrain.py: ``FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy=
"HYBRID_SHARD")`` (on one node: sharded over the node's ranks, as FULL_SHARD); finetune/full.py (``--checkpointing
full``): ``FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, state_dict_type="full",
limit_all_gathers=True, cpu_offload=False)``. Fabric passes ``use_orig_params=True`` and the precision plugin's
``MixedPrecision(param_dtype=reduce_dtype=buffer_dtype=)`` bf16 under bf16-mixed and bf16-true, fp32 under 32-true
(lightning/fabric/plugins/precision/fsdp.py); torch's defaults: ``backward_prefetch=BACKWARD_PRE``,
``forward_prefetch=False``, ``limit_all_gathers=True``.

Notation: per group G (one ``Block``, or the root: ``lm_head``, ``wte``, ``ln_f``), flat(G) = the elements of its
``FlatParameter`` (its parameters flattened in registration order, each start aligned to 16 bytes:
``_get_aligned_numel``), s(G) = ceil(flat(G)/W) the shard every rank holds (``FlatParamHandle._get_shard``: the
flat tensor chunked into W, the last chunk padded), p = the shards' dtype (fp32 under bf16-mixed: the module is not
converted), c = the all-gathered dtype (``param_dtype``: 2 under bf16-mixed and bf16, else p), g = c the
reduce-scatter's (``reduce_dtype`` = ``param_dtype``). Torch-free.
"""

from __future__ import annotations

from memplan.memory.sharding import FullyShard, fsdp_compute_setup, fsdp_gather_bytes
from memplan.memory.terms import ADAM_STEP_BYTES, _layer_matrices
from memplan.model import ModelSpec
from memplan.setup import TrainSetup

FSDP1_ALIGNMENT = 16  # bytes: torch/distributed/fsdp/_flat_param.py, _get_aligned_numel (use_orig_params=True)


def lit_block_param_numels(spec: ModelSpec) -> list[int]:
    """The elements of each parameter of litgpt's ``Block``, in registration order: ``norm_1`` (weight, a
    LayerNorm's bias), ``attn.qkv`` (weight, bias), ``attn.proj``, ``norm_2``, then ``mlp``: ``fc_1``, ``fc_2``,
    ``proj`` (LLaMAMLP) or ``fc``, ``proj`` (GptNeoxMLP), each with its bias where the model has biases."""
    h, qkv, f = spec.hidden, spec.q_dim + 2 * spec.kv_dim, spec.ffn
    norm = [h, h] if spec.norm == "layernorm" else [h]
    out = [*norm, qkv * h] + ([qkv] if spec.bias or spec.qkv_bias else [])
    out += [h * spec.q_dim] + ([h] if spec.bias else []) + norm
    fcs = 2 if spec.mlp == "swiglu" else 1
    for _ in range(fcs):
        out += [f * h] + ([f] if spec.bias else [])
    return out + [h * f] + ([h] if spec.bias else [])


def lit_root_param_numels(spec: ModelSpec) -> list[int]:
    """The root's parameters (every one outside a ``Block``), in registration order: ``lm_head`` (V·H; litgpt's
    ``GPT`` registers it before ``transformer``), ``transformer.wte`` (V·H), ``transformer.ln_f``."""
    h = spec.hidden
    return [spec.vocab * h, spec.vocab * h] + ([h, h] if spec.norm == "layernorm" else [h])


def fsdp1_group_numels(spec: ModelSpec, group: str) -> list[int]:
    """A group's parameters' elements: a ``Block``'s or the root's."""
    return lit_block_param_numels(spec) if group == "block" else lit_root_param_numels(spec)


def fsdp1_aligned_offsets(numels: list[int], dtype_bytes: int) -> list[int]:
    """Where each parameter starts in its ``FlatParameter``: after the previous one, padded up to a multiple of
    16 bytes of the all-gathered dtype (``_init_flat_param_and_metadata``: a padding tensor of
    ``aligned_numel - total % aligned_numel`` elements before a parameter that would start unaligned)."""
    aligned, total, out = FSDP1_ALIGNMENT // dtype_bytes, 0, []
    for numel in numels:
        total += -total % aligned
        out.append(total)
        total += numel
    return out


def fsdp1_flat_numel(numels: list[int], dtype_bytes: int) -> int:
    """flat(G): the elements of a group's unpadded ``FlatParameter``, its parameters and alignment padding."""
    return fsdp1_aligned_offsets(numels, dtype_bytes)[-1] + numels[-1]


def fsdp1_shard_numel(numels: list[int], dtype_bytes: int, world_size: int) -> int:
    """s(G) = ceil(flat(G)/W): every rank's shard of a group, the last rank's padded (``_get_shard``)."""
    return -(-fsdp1_flat_numel(numels, dtype_bytes) // world_size)


def fsdp1_local_pieces(numels: list[int], dtype_bytes: int, world_size: int, rank: int) -> list[int]:
    """The elements of each parameter inside ``rank``'s shard [rank·s, (rank+1)·s) of the flat parameter: with
    ``use_orig_params`` each parameter's ``.grad`` and optimizer state are views or tensors of that piece's size
    (0: the parameter is not on this rank, no state)."""
    shard = fsdp1_shard_numel(numels, dtype_bytes, world_size)
    lo, hi = rank * shard, (rank + 1) * shard
    return [max(0, min(hi, start + n) - max(lo, start))
            for start, n in zip(fsdp1_aligned_offsets(numels, dtype_bytes), numels)]


def fsdp1_shard(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """s(G) of a ``Block`` or the root for ``setup``'s world size (aligned for the gathered dtype, c)."""
    return fsdp1_shard_numel(fsdp1_group_numels(spec, group), fsdp_gather_bytes(setup), setup.world_size)


def fsdp1_sharded_weight_bytes(spec: ModelSpec, setup: TrainSetup) -> int:
    """Every rank's sharded flat parameters, (L·s(block) + s(root))·p (the module's ``FlatParameter`` s, whose
    ``use_orig_params`` views are the model's parameters: no more bytes)."""
    return (spec.layers * fsdp1_shard(spec, setup, "block") + fsdp1_shard(spec, setup, "root")) * setup.param_bytes


def fsdp1_unsharded_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """A group's padded unsharded flat parameter, W·s(G)·c (``_full_param_padded``): the all-gather's output,
    whose views the forward and backward use; freed (its storage resized to 0) at reshard."""
    return setup.world_size * fsdp1_shard(spec, setup, group) * fsdp_gather_bytes(setup)


def fsdp1_low_precision_shard_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """Under bf16-mixed, the shard cast to ``param_dtype`` for the all-gather, s(G)·c (``_mp_shard``, freed in
    ``post_unshard``); 0 where the shard is already in it."""
    return fsdp1_shard(spec, setup, group) * fsdp_gather_bytes(setup) if setup.mixed else 0


def fsdp1_flat_grad_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """The unsharded flat gradient, flat(G)·c: with ``use_orig_params`` the parameters are ``split`` views of the
    flat parameter, whose backward (one node for the whole group) concatenates their gradients into the flat
    parameter's ``.grad`` once the last arrives; the views' own gradients are then freed."""
    return fsdp1_flat_numel(fsdp1_group_numels(spec, group), fsdp_gather_bytes(setup)) * fsdp_gather_bytes(setup)


def fsdp1_padded_grad_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """The reduce-scatter's input padded to W·s(G) (``_get_reduce_scatter_tensors``: ``F.pad``, a copy), W·s(G)·g;
    0 where flat(G) divides by W (the flat gradient is the input itself)."""
    flat = fsdp1_flat_grad_bytes(spec, setup, group)
    padded = setup.world_size * fsdp1_shard(spec, setup, group) * fsdp_gather_bytes(setup)
    return padded if padded != flat else 0


def fsdp1_reduced_grad_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """The reduce-scatter's output, s(G)·g (``new_sharded_grad``): the sharded gradient, in ``reduce_dtype``."""
    return fsdp1_shard(spec, setup, group) * fsdp_gather_bytes(setup)


def fsdp1_sharded_grad_bytes(spec: ModelSpec, setup: TrainSetup, group: str) -> int:
    """A group's sharded gradient as the optimizer gets it, s(G)·p: under bf16-mixed the reduced bf16 shard cast
    to the parameters' fp32 (``_cast_grad_to_param_dtype``, a new tensor; the bf16 one freed), else the reduced
    shard itself (``_saved_grad_shard``, then the flat parameter's ``.grad``)."""
    return fsdp1_shard(spec, setup, group) * setup.param_bytes


def fsdp1_local_numels(spec: ModelSpec, setup: TrainSetup, rank: int) -> list[int]:
    """Every parameter's piece on ``rank`` (``fsdp1_local_pieces``), the blocks' and the root's."""
    c, w = fsdp_gather_bytes(setup), setup.world_size
    block = fsdp1_local_pieces(lit_block_param_numels(spec), c, w, rank)
    return block * spec.layers + fsdp1_local_pieces(lit_root_param_numels(spec), c, w, rank)


def fsdp1_optimizer_state_bytes(spec: ModelSpec, setup: TrainSetup, rank: int = 0) -> int:
    """AdamW's state over ``rank``'s pieces: 2·Σ piece·p (exp_avg, exp_avg_sq), and a 4-byte ``step`` for every
    parameter with a piece on this rank (one with none gets no gradient, so no state)."""
    pieces = [n for n in fsdp1_local_numels(spec, setup, rank) if n]
    return 2 * sum(pieces) * setup.param_bytes + len(pieces) * ADAM_STEP_BYTES


def fsdp1_optimizer_scratch_bytes(spec: ModelSpec, setup: TrainSetup, rank: int, cpu: bool) -> int:
    """The AdamW step's scratch over ``rank``'s pieces (litgpt's optimizer, ``lit_walked_setup``): fused, 0; on
    the CPU torch's for-loop ``_single_tensor_adamw``, 2 × the largest piece: ``denom = (exp_avg_sq.sqrt() /
    bias_correction2_sqrt).add_(eps)``, the square root and the quotient alive together (every other update is
    in place on the piece's views: ``param.addcdiv_(exp_avg, denom, ...)``); foreach, every piece once (litgpt
    gives AdamW one parameter group)."""
    pieces = fsdp1_local_numels(spec, setup, rank)
    if setup.optimizer == "adamw-fused" and not cpu:
        return 0
    return (2 * max(pieces) if cpu else sum(pieces)) * setup.param_bytes


class FlatShard(FullyShard):
    """The sharding hook of one rank of FSDP1 as Fabric's ``FSDPStrategy`` wraps litgpt's ``GPT`` (FULL_SHARD; one
    node's HYBRID_SHARD), one micro-batch.

    The activations follow the compute setup (``fsdp_compute_setup``): Fabric's ``MixedPrecision`` gathers bf16
    parameters under bf16-mixed as under bf16 (its forward context, ``torch.autocast("cuda")``, does nothing to
    the CPU's ops). Forward: the root's pre-forward all-gathers the root's flat parameter (under bf16-mixed its
    shard cast first, ``_mp_shard``), which the root keeps until its post-backward (``_post_forward_reshard``
    frees no root's); each ``Block``'s pre-forward all-gathers its flat parameter straight into its padded
    unsharded buffer (no copy-out, unlike FSDP2), its post-forward frees it. Backward: the root's pre-backward
    (the logits' gradient) prefetches the last block (BACKWARD_PRE), each block's pre-backward the block before
    it; the first block's would prefetch the root, still unsharded. A block's post-backward (its flat
    parameter's gradient accumulated: its views' gradients concatenated, ``fsdp1_flat_grad_bytes``) frees its
    unsharded parameter, reduce-scatters the (padded) flat gradient into the sharded one (under gloo through a
    copy of the input, ``gloo_reduce_scatter_copy_bytes``), casts it to the parameters' dtype under
    bf16-mixed, and frees the flat gradient as it returns: nothing is held from one group to the next. The
    root's comes last: the head's gradient waits for the embedding's (the root's views share one backward
    node). The optimizer (litgpt's AdamW) gets every parameter's piece on this rank (``use_orig_params``)."""

    ends = 2
    lora_outside_blocks = False
    owns_stack_optimizer_scratch = True  # litgpt's own loop over its shards (fsdp1_optimizer_scratch_bytes)

    def __init__(self, spec: ModelSpec, setup: TrainSetup, rank: int = 0, collectives: str = "nccl",
                 stack=None) -> None:
        self.spec, self.setup, self.rank = spec, setup, rank
        self.compute_setup = fsdp_compute_setup(setup)
        self.accum = self.block_gradients_persist = False
        self.first_micro = True
        self.c = fsdp_gather_bytes(setup)
        self.cpu = bool(stack is not None and stack.cpu)
        groups = ("block", "root")
        self.gathered = {g: fsdp1_unsharded_bytes(spec, setup, g) for g in groups}
        self.mp_shard = {g: fsdp1_low_precision_shard_bytes(spec, setup, g) for g in groups}
        self.flat_grad = {g: fsdp1_flat_grad_bytes(spec, setup, g) for g in groups}
        self.padded = {g: fsdp1_padded_grad_bytes(spec, setup, g) for g in groups}
        self.reduced = {g: fsdp1_reduced_grad_bytes(spec, setup, g) for g in groups}
        self.sharded_grad = {g: fsdp1_sharded_grad_bytes(spec, setup, g) for g in groups}
        self.gloo_copy = {g: self.gathered[g] if collectives == "gloo" else 0 for g in groups}  # W·s(G)·g

    def weight_bytes(self) -> int:
        """This rank's sharded flat parameters (``fsdp1_sharded_weight_bytes``)."""
        return fsdp1_sharded_weight_bytes(self.spec, self.setup)

    def stack_adapter_bytes(self, extra_adapters: int) -> int:
        """No adapters: litgpt's LoRA is sharded otherwise (FSDP2, finetune/lora.py), refused before."""
        return 0

    def optimizer_state_bytes(self) -> int:
        """AdamW's state over this rank's pieces (``fsdp1_optimizer_state_bytes``)."""
        return fsdp1_optimizer_state_bytes(self.spec, self.setup, self.rank)

    def persistent_gradients(self, w, extra_adapters: int) -> None:
        """None: one micro-batch, whose sharded gradients are made by its backward."""

    def _all_gather(self, w, group: str) -> None:
        """A group's unshard: the low-precision shard (bf16-mixed), the padded unsharded flat parameter gathered
        into, the low-precision shard freed."""
        w.alloc("temporaries", self.mp_shard[group])
        w.alloc("weights", self.gathered[group])
        w.free("temporaries", self.mp_shard[group])

    def before_embedding(self, w) -> None:
        """The root's all-gather, kept to its post-backward."""
        w.where = "forward: root all-gather"
        self._all_gather(w, "root")

    def before_blocks_forward(self, w) -> None:
        """Block 0's all-gather."""
        w.where = "forward: block all-gather"
        self._all_gather(w, "block")

    def between_blocks_forward(self, w) -> None:
        """Blocks 0 … L-2: each all-gathered, run and freed alike; block 0's freed."""
        w.free("weights", self.gathered["block"])

    def before_last_block_forward(self, w) -> None:
        """The last block's all-gather."""
        self._all_gather(w, "block")

    def after_block_forward(self, w) -> None:
        """The last block's unsharded parameter freed (its post-forward)."""
        w.free("weights", self.gathered["block"])

    def after_head_forward(self, w) -> None:
        """Nothing: the root keeps its unsharded parameter."""

    def before_head_backward(self, w) -> None:
        """The root's pre-backward: its parameter still unsharded (under bf16-mixed its shard cast anew and freed),
        then the last block's all-gather (BACKWARD_PRE prefetch)."""
        w.where = "backward: last block's all-gather (prefetch)"
        w.alloc("temporaries", self.mp_shard["root"])
        w.free("temporaries", self.mp_shard["root"])
        self._all_gather(w, "block")

    def after_final_norm_backward(self, w) -> None:
        """The final norm's gradient, norm_params·c, held with the head's until the root's post-backward."""
        w.alloc("gradients", self.spec.norm_params * self.c)

    def before_block_backward(self, w, which: str, index: int) -> None:
        """The block before this one all-gathered (prefetch); before the first block's backward, the root's (still
        unsharded: its low-precision shard only)."""
        w.where = f"backward: all-gather of the block before the {which}"
        if index > 0:
            self._all_gather(w, "block")
        else:
            w.alloc("temporaries", self.mp_shard["root"])
            w.free("temporaries", self.mp_shard["root"])

    def _post_backward(self, w, group: str, unsharded_grad_bytes: int) -> None:
        """A group's post-backward: its views' gradients concatenated into the flat gradient (and freed); its
        unsharded parameter freed; the padded input, the reduce-scatter's output (and gloo's copy of the input),
        the cast to the parameters' dtype; the flat gradient freed when the hook returns."""
        w.alloc("gradients", self.flat_grad[group])
        w.free("gradients", unsharded_grad_bytes)
        w.free("weights", self.gathered[group])
        w.alloc("temporaries", self.padded[group])
        w.alloc("temporaries", self.reduced[group])
        w.alloc("temporaries", self.gloo_copy[group])
        w.free("temporaries", self.gloo_copy[group])
        w.alloc("gradients", self.sharded_grad[group])
        w.free("temporaries", self.reduced[group])
        w.free("temporaries", self.padded[group])
        w.free("gradients", self.flat_grad[group])

    def after_block_backward(self, w, which: str) -> None:
        """The block's norms' (and biases') gradients, then its post-backward."""
        spec = self.spec
        vectors = spec.layer_params - sum(_layer_matrices(spec).values())
        w.alloc("gradients", vectors * self.c)
        w.where = f"backward: the {which} block's reduce-scatter"
        self._post_backward(w, "block", spec.layer_params * self.c)

    def middle_gradients(self, w, middle: int, per_block: int) -> None:
        """Each block in between leaves its sharded gradient, s(block)·p."""
        w.alloc("gradients", middle * self.sharded_grad["block"])

    def after_embedding_backward(self, w) -> None:
        """The root's post-backward (the head's, the embedding's and the final norm's gradients concatenated)."""
        spec = self.spec
        w.where = "backward: the root's reduce-scatter"
        self._post_backward(w, "root", (spec.params - spec.layers * spec.layer_params) * self.c)

    def optimizer_temporary_bytes(self) -> int:
        """litgpt's AdamW over this rank's pieces (``fsdp1_optimizer_scratch_bytes``)."""
        return fsdp1_optimizer_scratch_bytes(self.spec, self.setup, self.rank, self.cpu)
