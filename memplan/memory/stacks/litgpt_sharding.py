"""litgpt's FSDP2 over several devices: finetune/lora.py's ``ModelParallelStrategy``, walked; torch-free.

``litgpt finetune_lora`` with ``devices > 1`` runs ``ModelParallelStrategy(parallelize_fn=parallelize_fn,
data_parallel_size=devices * num_nodes, tensor_parallel_size=1)``; Fabric's ``setup_module`` calls litgpt's
``parallelize_fn(model, device_mesh)`` (litgpt/finetune/lora.py) on a (W, 1) mesh named
("data_parallel", "tensor_parallel") (lightning/fabric/strategies/model_parallel.py, ``_setup_device_mesh``):

- ``model.transformer.h = ModuleList(checkpoint_wrapper(el, preserve_rng_state=False) for el in ...)``: every
  ``Block`` checkpointed (``activation_checkpointing=True``, its default: the strategy passes nothing else),
  non-reentrant, so ``--checkpointing full`` (``memory.stacks.litgpt.lit_check_checkpointing``);
- ``for m in reversed(list(model.modules()))``: ``fully_shard(m, mesh=dp_mesh)`` where ``m`` is an
  ``nn.Linear`` whose weight requires a gradient, a ``CheckpointWrapper`` or a ``Block``, innermost first, then
  ``fully_shard(model, mesh=dp_mesh)``. After ``mark_only_lora_as_trainable`` no ``nn.Linear`` has a trainable
  weight (litgpt's adapters are ``lora_A`` / ``lora_B`` parameters of ``LoRALinear``, its ``linear`` frozen), so
  no Linear is a group of its own; each ``Block`` is one group holding all of its parameters (frozen base and
  adapters), and each ``CheckpointWrapper``, sharded after the Block inside it, finds no parameter left: no
  group, nothing gathered. The root holds the embedding, the final norm and the head (its adapter under
  ``--lora-targets head``): memplan's own layout (``memory.sharding.FullyShard``), L + 1 groups;
- no ``mp_policy`` (no MixedPrecisionPolicy) and fully_shard's default ``reshard_after_forward`` (None: the
  blocks reshard after forward, the root keeps its parameters unsharded until its backward ends), as memplan's
  own trainer;
- Fabric's precision plugin applies as on one device: ``bf16-true`` (``--precision bf16``) builds the model in
  bf16 (``HalfPrecision.module_init_context``), so shards, all-gathers and reduce-scatters are bf16;
  ``bf16-mixed`` is autocast (``MixedPrecision``) around fp32 parameters, so FSDP2 gathers and reduces fp32
  (``lit_fsdp_collective_setup``) and the activations are autocast's (``lit_fsdp_compute_setup``), where
  memplan's own FSDP2 gives a MixedPrecisionPolicy the 16-bit gathers of ``memory.sharding.fsdp_compute_setup``.

A checkpointed block's recomputation runs inside its backward, after FSDP2's pre-backward hook has all-gathered
the block (``FSDPState._pre_forward`` returns at once in ``TrainingState.PRE_BACKWARD``: "the pre-backward hook is
responsible for the unshard"), so it gathers nothing again.
"""

from __future__ import annotations

from memplan.memory.sharding import FullyShard, fsdp_gather_bytes, fsdp_stack_adapter_block_numel


def lit_fsdp_collective_setup(setup):
    """The setup whose FSDP2 byte terms (``memory.sharding``: c, g, the copy-in) are those of litgpt's FSDP2:
    no MixedPrecisionPolicy, so c = g = p, the parameters' own dtype, and no copy-in cast (the shard itself is
    sent). Under ``bf16-mixed`` (fp32 parameters, autocast) that is fp32's (the same p, 4 bytes); every other
    precision is its own."""
    return setup.replace(precision="fp32") if setup.mixed else setup


def lit_fsdp_compute_setup(setup):
    """The setup the activations of litgpt's FSDP2 step follow: the step's own precision (autocast under
    bf16-mixed, Fabric's ``MixedPrecision``: no MixedPrecisionPolicy replaces it), one micro-batch walked."""
    return setup.replace(grad_accum=1, world_size=1, sharding="none")


class LitFullyShard(FullyShard):
    """The sharding hook of a rank of litgpt's finetune_lora over several devices (the module docstring): memplan's
    FSDP2 hook on the same L + 1 groups, with the parameters' own dtype gathered and reduced
    (``lit_fsdp_collective_setup``) and autocast's activations under bf16-mixed (``lit_fsdp_compute_setup``)."""

    def __init__(self, spec, setup, rank: int = 0, collectives: str = "nccl", stack=None) -> None:
        super().__init__(spec, setup, rank, collectives, stack)
        self.compute_setup = lit_fsdp_compute_setup(setup)
        if not setup.mixed:
            return
        coll = lit_fsdp_collective_setup(setup)
        self.c = fsdp_gather_bytes(coll)
        self.group_bytes(spec, coll, collectives)
        # a block's adapters beyond memplan's, in p (FullyShard counts them in its 16-bit compute setup's bytes)
        extra = stack.lora_bytes_delta(spec, setup) if stack is not None else 0
        self.extra_block = fsdp_stack_adapter_block_numel(spec, setup, extra)
        self.extra_shard = -(-self.extra_block // setup.world_size)  # ceil(e/W)
        self.extra_grad = self.extra_block * self.c
        if self.extra_block:  # gathered, packed and reduce-scattered with the block, in p
            self.extra_grad = self.extra_block * self.c
            self.gathered["block"] += setup.world_size * self.extra_shard * self.c
            self.rs_input["block"] += setup.world_size * self.extra_shard * self.c
            self.sharded_grad["block"] += self.extra_shard * self.c
            self.gloo_copy["block"] = self.gloo_copy["block"] and self.rs_input["block"]
