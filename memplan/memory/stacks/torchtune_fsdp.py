"""torchtune's ``custom_sharded_layers``: the embedding and the LM head as FSDP2 groups of their own, torch-free.

The 8B and 70B full-finetune configs of llama3, llama3_1 and llama3_3 set ``custom_sharded_layers:
['tok_embeddings', 'output']``; the recipes pass it to ``training.shard_model`` as
``get_shard_conditions(names_to_match=...)``, which ``fully_shard``s each named module (bottom-up, with the
``layers.i``) before the root: three groups where memplan's layout has one root. Their terms are FSDP2's
(``memory.sharding``: pad(G), c, g) over the groups ``param_shapes`` names ``embedding``, ``head`` and
``root_rest`` (the final norm); ``TorchtuneShard`` places them in the step, in the order FSDP2's group hooks ran
on two gloo ranks of torchtune's model (``unshard``, ``reshard``, ``foreach_reduce``, with the allocator's bytes
in use at each), and is held to those ranks' peaks (``tests/runs/test_walk_matrices.py``,
docs/commands/estimate.md).
"""

from __future__ import annotations

from memplan.errors import InputError
from memplan.memory.sharding import (FullyShard, fsdp_copy_in_bytes, fsdp_reduce_scatter_input_bytes,
                                     fsdp_sharded_grad_bytes, fsdp_trained_shapes, fsdp_unsharded_bytes,
                                     gloo_reduce_scatter_copy_bytes)

CUSTOM_SHARDED_LAYERS = ("auto", "none", "tok_embeddings,output")  # --custom-sharded-layers


def tt_custom_sharded_layers(spec, setup, choice: str) -> tuple[str, ...]:
    """The modules ``custom_sharded_layers`` names for ``choice``: ``auto`` is what torchtune's published
    distributed configs set for the model: ``['tok_embeddings', 'output']`` in the full-finetune configs of the
    untied llama3 builders (llama3/8B_full.yaml, llama3_1/70B_full.yaml, ...), unset in every LoRA config (commented
    out) and in the tied llama3_2 configs; ``none``: unset; ``tok_embeddings,output``: both. A tied head is
    refused (``tt_check_custom_sharded_layers``)."""
    if choice == "auto":
        return () if spec.tied or setup.lora_rank else ("tok_embeddings", "output")
    return () if choice == "none" else tuple(choice.split(","))


def tt_check_custom_sharded_layers(spec, choice: str) -> None:
    """The one-line InputError for a value not taken, or ``tok_embeddings`` with a tied head: torchtune's
    ``TiedLinear`` reads the embedding's weight after its group resharded it (``aten.mm ... mixed torch.Tensor and
    DTensor``, measured on two gloo ranks), which is why the llama3_2 configs leave it unset."""
    if choice not in CUSTOM_SHARDED_LAYERS:
        raise InputError(f"--custom-sharded-layers {choice}: accepted: {', '.join(CUSTOM_SHARDED_LAYERS)}")
    if spec.tied and choice == "tok_embeddings,output":
        raise InputError("--custom-sharded-layers tok_embeddings,output: torchtune's TiedLinear head reads the "
                         "embedding's resharded weight and fails (accepted for a tied model: auto, none)")


def tt_head_call_logits_bytes(spec, setup, chunks: int) -> int:
    """One output chunk's logits, n·V·a/chunks: ``self.output(chunk)`` for each of the ``chunks`` slices of the
    final norm's output (``TransformerDecoder.chunked_output``), made while the head is gathered for that call."""
    return setup.micro_batch * setup.ctx * spec.vocab * setup.compute_bytes // chunks


class TorchtuneShard(FullyShard):
    """``FullyShard`` with ``custom_sharded_layers: ['tok_embeddings', 'output']``: the root keeps the final norm.

    Forward: the root's all-gather (the norm), then the embedding's; the embedding resharded after its forward
    (``reshard_after_forward=True``) before block 0's all-gather. The head is called once per output chunk
    (``TransformerDecoder.chunked_output``: 8), each call all-gathering it and resharding it after; its last
    all-gather output is released when the root's forward ends. Backward: the root's pre-backward all-gathers
    the norm and prefetches the head; each chunk's backward all-gathers the head again (its post-backward of the
    chunk before resharded it); autograd sums its weight gradient over the chunks (``tt_chunked_head_grad_bytes``)
    and makes ``.grad`` once, so only the last chunk's post-backward has one to reduce-scatter, before the last block's
    backward. The first block's pre-backward prefetches the embedding's all-gather; its copy-out comes before the
    embedding's backward; the root's reduce-scatter (the norm's gradient) then the embedding's end the backward.
    Under LoRA the embedding and head are frozen: gathered, never reduce-scattered (the head's adapter, where
    there is one, is)."""

    def __init__(self, spec, setup, rank: int = 0, collectives: str = "nccl", stack=None) -> None:
        super().__init__(spec, setup, rank, collectives, stack)
        for group in ("embedding", "head", "root_rest"):
            self.gathered[group] = fsdp_unsharded_bytes(spec, setup, group)
            self.copy_in[group] = fsdp_copy_in_bytes(spec, setup, group)
            self.rs_input[group] = fsdp_reduce_scatter_input_bytes(spec, setup, group)
            self.sharded_grad[group] = fsdp_sharded_grad_bytes(spec, setup, group)
            self.gloo_copy[group] = gloo_reduce_scatter_copy_bytes(spec, setup, group, collectives)
        self.gathered["root"] = self.gathered["root_rest"]  # the root's group: the final norm
        self.chunks = 8  # the loss's num_output_chunks: the head's forward calls

    def before_embedding(self, w) -> None:
        """The root's all-gather and copy-out (the norm), then the embedding's; the root's output released at the
        embedding's copy-out, the embedding's kept until block 0's."""
        super().before_embedding(w)
        w.where = "forward: embedding all-gather"
        self._all_gather(w, "embedding")
        w.alloc("weights", self.gathered["embedding"])
        w.free("temporaries", self.gathered["root"])

    def before_blocks_forward(self, w) -> None:
        """The embedding resharded after its forward; block 0's all-gather and copy-out, the embedding's output
        released."""
        w.free("weights", self.gathered["embedding"])
        w.where = "forward: block all-gather"
        self._all_gather(w, "block")
        w.alloc("weights", self.gathered["block"])
        w.free("temporaries", self.gathered["embedding"])

    def after_block_forward(self, w) -> None:
        """The last block resharded; the head's calls, one per output chunk: each all-gathers it and copies it out
        (the output before released at the copy-out), makes its chunk of the logits, n·V·a/8
        (``tt_head_call_logits_bytes``), and but the last reshards it after. The walk makes the whole logits after
        this hook: the chunks the calls made before the last are released here for them."""
        super().after_block_forward(w)
        w.where = "forward: the head's all-gathers"
        previous, chunk = self.gathered["block"], tt_head_call_logits_bytes(self.spec, self.compute_setup, self.chunks)
        for call in range(self.chunks):
            self._all_gather(w, "head")
            w.alloc("weights", self.gathered["head"])
            w.free("temporaries", previous)
            previous = self.gathered["head"]
            if call < self.chunks - 1:
                w.alloc("logits", chunk)
                w.free("weights", self.gathered["head"])
        w.free("logits", (self.chunks - 1) * chunk)

    def after_head_forward(self, w) -> None:
        """The root's forward ends: the head's last all-gather output released, the head and the root resharded."""
        w.free("temporaries", self.gathered["head"])
        w.free("weights", self.gathered["head"])
        if self.root_reshards:
            w.free("weights", self.gathered["root"])

    def before_head_backward(self, w) -> None:
        """The root's all-gather (the norm) and the head's, each copied out (the head's pre-backward prefetches
        nothing but itself until its last chunk: ``after_head_chunks``)."""
        if self.root_reshards:
            w.where = "backward: root all-gather"
            self._all_gather(w, "root")
            self._copy_out(w, "root")
        w.where = "backward: the head's all-gather"
        self._all_gather(w, "head")
        self._copy_out(w, "head")

    def after_head_chunks(self, w, sums: int) -> None:
        """The head's last chunk: its pre-backward prefetches the last block's all-gather (the post-forward order's
        group before the head's first call), and its weight gradient is added into the running sum (``sums``: the
        sum's temporaries), the logits' gradient released by then (as measured on two gloo ranks: the walk's peak
        here is theirs within 188 bytes in fp32; the walk's head backward before it holds the whole gradient, as
        one device's trace does at its sums)."""
        w.where = "backward: the head's last chunk, the last block's all-gather (prefetch)"
        self._all_gather(w, "block")
        w.alloc("temporaries", sums)
        w.free("temporaries", sums)

    def after_final_norm_backward(self, w) -> None:
        """The final norm's gradient; the head's reduce-scatter (its summed gradient, V·H·c, or its adapter's)."""
        super().after_final_norm_backward(w)
        w.where = "backward: the head's reduce-scatter"
        self._reduce_scatter(w, "head", self._own_grad_bytes("head"))

    def before_block_backward(self, w, which: str, index: int) -> None:
        """As ``FullyShard``'s; before the first block's backward the embedding's all-gather (prefetch)."""
        super().before_block_backward(w, which, index)
        if index == 0:
            w.where = "backward: the embedding's all-gather (prefetch)"
            self._all_gather(w, "embedding")

    def after_blocks_backward(self, w, lora: bool, extra_adapters: int) -> None:
        """The embedding's copy-out (its output released); under LoRA (frozen: no gradient reaches it, so no
        pre-backward) its prefetched output is taken to stay until the backward ends (not seen at a peak: the
        LoRA rows measured peak in the forward, at the head's all-gathers)."""
        if not self.trained_shapes("embedding"):
            return
        self._copy_out(w, "embedding")

    def after_embedding_backward(self, w) -> None:
        """The root's reduce-scatter (the norm's gradient), then the embedding's; the last input released."""
        w.where = "backward: the root's reduce-scatter"
        self._reduce_scatter(w, "root_rest", self.spec.norm_params * self.c if not self.setup.lora_rank else 0)
        w.where = "backward: the embedding's reduce-scatter"
        if self.trained_shapes("embedding"):
            self._reduce_scatter(w, "embedding", self._own_grad_bytes("embedding"))
        else:
            w.free("temporaries", self.gathered["embedding"])  # the prefetched output
        w.free("temporaries", self.held)

    def trained_shapes(self, group: str) -> list[tuple[int, int]]:
        """The tensors of a group that get gradients (``fsdp_trained_shapes``: none of the embedding's under LoRA)."""
        return fsdp_trained_shapes(self.spec, self.setup, group)

    def _own_grad_bytes(self, group: str) -> int:
        """The unsharded gradient a group of its own reduce-scatters: its trained tensors' elements times c."""
        return sum(rows * length for rows, length in self.trained_shapes(group)) * self.c


class KeptAfterForward(FullyShard):
    """``FullyShard`` with ``fsdp_reshard_after_forward: False`` (FSDP1's SHARD_GRAD_OP), every group and the root:
    each group's parameters, all-gathered before its forward, stay unsharded until its post-backward reshards
    them, so at the end of the forward every block's, L·W·pad(block)·p, and the root's are held; in the backward
    nothing is all-gathered again (the pre-backward's unshard and the prefetch find them unsharded)."""

    def __init__(self, spec, setup, rank: int = 0, collectives: str = "nccl", stack=None) -> None:
        super().__init__(spec, setup, rank, collectives, stack)
        self.root_reshards = False

    def between_blocks_forward(self, w) -> None:
        """Blocks 0 … L-2 kept: block 0's parameters stay, blocks 1 … L-2 are all-gathered and kept alike."""
        w.alloc("weights", max(0, self.spec.layers - 2) * self.gathered["block"])

    def after_block_forward(self, w) -> None:
        """The last block's parameters kept."""

    def before_head_backward(self, w) -> None:
        """Nothing: the last block, whose prefetch this was, is unsharded."""

    def before_block_backward(self, w, which: str, index: int) -> None:
        """Nothing: the block and the one before it are unsharded."""
        w.where = f"backward: the {which} block"

    def middle_gradients(self, w, middle: int, per_block: int) -> None:
        """The blocks in between resharded at their post-backward, and their sharded gradients."""
        w.free("weights", middle * self.gathered["block"])
        super().middle_gradients(w, middle, per_block)


def tt_fsdp_sharding(spec, setup, rank: int, collectives: str, stack) -> FullyShard:
    """torchtune's FSDP2 hook for ``stack.custom_sharded_layers`` and ``stack.fsdp_reshard_after_forward``:
    ``TorchtuneShard`` where the embedding and the head are groups of their own, ``KeptAfterForward`` where the
    groups keep their parameters from forward to backward, else memplan's ``FullyShard`` with torchtune's root."""
    if tt_custom_sharded_layers(spec, setup, stack.custom_sharded_layers):
        return TorchtuneShard(spec, setup, rank, collectives, stack)
    if not stack.fsdp_reshard_after_forward:
        return KeptAfterForward(spec, setup, rank, collectives, stack)
    return FullyShard(spec, setup, rank, collectives, stack)

