"""The compiled training step, traced on fake tensors: what ``torch.compile`` (inductor) saves and allocates.

The trainer compiles the whole model (``torch.compile(model)``, trainer/loop.py); the loss, the backward's
gradient accumulation and the optimizer stay eager. ``trace_compiled_step`` compiles memplan's model the way
inductor does, on fake tensors, and traces two steps under MemTracker as ``trainer.measure.trace_step`` does:

- dynamo captures the model's forward (checkpointed blocks included, as higher-order ops);
- inductor's own ``compile_fx`` runs AOTAutograd on it: the joint graph, inductor's joint-graph passes and
  inductor's partitioner (``min_cut_rematerialization_partition``), which chooses what the forward saves
  for backward (the forward graph's outputs beyond the logits) and what the backward recomputes instead;
- the last stage, ``compile_fx_inner`` (post-grad passes, lowering, fusion, C++/Triton codegen), is replaced by
  ``_capture``: it keeps the partitioned forward and backward graphs and runs each op by op
  (``_BoxedGraph``), freeing every value, the graph's inputs included, after its last use, as inductor's
  generated code does (its boxed calling convention lets it drop the saved tensors as the backward goes).

So the saved tensors are exactly the compiled step's. The transients are those of the same graph run op by op:
an upper bound on inductor's, whose fusion never materialises the intermediates of a fused kernel (it fuses
pointwise chains into one loop; the matmuls, attention and reductions keep their buffers). Inductor's own
buffer plan is only made by its code generator, which needs a C compiler and real compile time, so it is not
run here; ``benchmarks/compile_memory.py`` measures a real compiled step's allocator peak to compare with.
"""

from __future__ import annotations

import functools
import re

import torch
import torch.fx

from memplan.model import ModelSpec
from memplan.setup import TrainSetup
from trainer.lora import lora_for
from trainer.measure import StepMemory, _random_batches, _tracked_steps
from trainer.model import build_model
from trainer.step import make_optimizer, param_dtype, set_matmul_precision, train_step


class _BoxedGraph:
    """Runs a partitioned FX graph op by op with inductor's calling convention: the arguments come as a list
    the callee empties, and each value (inputs too) is dropped after its last use; the outputs live on."""

    def __init__(self, gm: torch.fx.GraphModule):
        self._boxed_call = True  # AOTAutograd hands over its argument list (make_boxed_func's marker), on the
        self.gm = gm  # instance: functools.wraps (dynamo's disable wrapper of the backward) copies its __dict__
        self.nodes = list(gm.graph.nodes)
        last: dict[torch.fx.Node, int] = {}
        for i, node in enumerate(self.nodes):
            for used in node.all_input_nodes:
                last[used] = i
        self.frees: list[list[torch.fx.Node]] = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            if node.op != "output":
                self.frees[last.get(node, i)].append(node)

    def __call__(self, args: list):
        env: dict[torch.fx.Node, object] = {}
        placeholders = iter(args)
        out = None
        for i, node in enumerate(self.nodes):
            if node.op == "placeholder":
                env[node] = next(placeholders)
            else:
                if isinstance(args, list) and args:
                    args.clear()  # every placeholder is bound: the caller's references go
                a = torch.fx.node.map_arg(node.args, env.__getitem__)
                kw = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
                if node.op == "call_function":
                    env[node] = _call(node.target, a, kw)
                elif node.op == "get_attr":
                    env[node] = functools.reduce(getattr, node.target.split("."), self.gm)
                elif node.op == "call_module":
                    env[node] = self.gm.get_submodule(node.target)(*a, **kw)
                elif node.op == "call_method":
                    env[node] = getattr(a[0], node.target)(*a[1:], **kw)
                elif node.op == "output":
                    out = a[0]
            for dead in self.frees[i]:
                env.pop(dead, None)
        return out


def _root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage ``node`` views (itself when it is no view)."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.args \
            and isinstance(node.args[0], torch.fx.Node) and node.target.is_view:
        node = node.args[0]
    return node


def _call(target, args, kwargs):
    """One op of a partitioned graph. The generator-state operators that checkpointed blocks' graphs use to
    replay their randomness (higher-order operators, which MemTracker's dispatch mode does not take) run as
    their op, with a new state tensor of the generator's size: memplan's model draws no random numbers."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    if target is run_and_save_rng_state:
        return torch.empty(torch.get_rng_state().numel(), dtype=torch.uint8), args[0](*args[1:], **kwargs)
    if target is run_with_rng_state:
        return args[1](*args[2:], **kwargs)
    return target(*args, **kwargs)


class _Compiled(torch.nn.Module):
    """``model`` as the trainer steps it compiled: dynamo's graph of its forward through inductor's
    ``compile_fx`` (joint graph, partition), the last stage replaced by ``_BoxedGraph``.

    The first call compiles through ``torch.compile``. Later calls run the compiled function directly,
    its inputs looked up by dynamo's names for the model's parameters and buffers: under MemTracker (a
    dispatch mode) dynamo would otherwise not run its cache (ModTracker's global hooks fail its guards, and
    it does not compile under a dispatch mode)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.graphs: list[tuple[torch.fx.GraphModule, object]] = []
        self.inputs: list[torch.Tensor | None] | None = None
        self.partitioned: list[tuple[torch.fx.GraphModule, bool]] = []  # (graph, is_backward), as inductor got them

        def capture(gm, example_inputs, **kwargs):
            self.partitioned.append((gm, bool(kwargs.get("is_backward"))))
            return _BoxedGraph(gm)

        def backend(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx

            fn = compile_fx(gm, example_inputs, inner_compile=capture)
            self.graphs.append((gm, fn))
            return fn

        self.compiled = torch.compile(model, backend=backend)

    def _bind(self) -> list[torch.Tensor | None]:
        if len(self.graphs) != 1:
            raise RuntimeError(f"torch.compile made {len(self.graphs)} graphs of the model (graph breaks or "
                               "recompiles); the compiled trace replays exactly one")
        gm, _ = self.graphs[0]
        named: dict[str, torch.Tensor] = {}
        for kind, items in (("parameters", self.model.named_parameters(remove_duplicate=False)),
                            ("buffers", self.model.named_buffers(remove_duplicate=False))):
            for name, t in items:
                *mods, leaf = name.split(".")
                key = "l_self_" + "".join(f"modules_{m}_" for m in mods) + f"{kind}_{leaf}_"
                named[re.sub(r"[^0-9a-zA-Z_]", "_", key)] = t
        inputs: list[torch.Tensor | None] = []
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            if node.name in named:
                inputs.append(named[node.name])
            elif node.name == "l_idx_":
                inputs.append(None)
            else:
                raise RuntimeError(f"compiled trace: graph input {node.name} is none of the model's tensors")
        return inputs

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if not self.graphs:
            return self.compiled(idx)
        if self.inputs is None:
            self.inputs = self._bind()
        out = self.graphs[0][1](*[idx if t is None else t for t in self.inputs])
        return out[0]

    def saved_for_backward(self) -> dict[str, int]:
        """Bytes the partitioner's forward graph returns beyond the model's output, by kind: ``saved`` (made
        by the forward: what a compiled step holds for its backward) and ``inputs`` (parameters and the
        token ids, held anyway); distinct storages, each counted once."""
        from torch.multiprocessing.reductions import StorageWeakRef

        forward = next(gm for gm, backward in self.partitioned if not backward)
        outputs = list(forward.graph.nodes)[-1].args[0]
        placeholders = {n for n in forward.graph.nodes if n.op == "placeholder"}
        out = {"saved": 0, "inputs": 0}
        seen = set()
        for node in outputs[1:]:
            val = getattr(node, "meta", {}).get("val")
            if not isinstance(val, torch.Tensor):
                continue
            key = StorageWeakRef(val.untyped_storage())
            if key in seen:
                continue
            seen.add(key)
            kind = "inputs" if _root(node) in placeholders else "saved"
            out[kind] += val.untyped_storage().nbytes()
        return out


def trace_compiled_step(spec: ModelSpec, setup: TrainSetup, device: str = "cpu") -> StepMemory:
    """The live-tensor peak of a steady-state compiled step on fake tensors (nothing is allocated): the
    partitioner's saved tensors exactly, the transients op by op (see the module's docstring).

    A warm-up step compiles (dynamo does not trace under the tracker's dispatch mode); the two steps after it
    run the compiled graphs under MemTracker, as ``trace_step`` runs the eager ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch._dynamo.reset()
    set_matmul_precision(setup.precision)
    try:
        # non-fake inputs: checkpointed blocks' graphs save the generator's state (a real uint8 tensor) to replay
        with FakeTensorMode(allow_non_fake_inputs=True), torch.device(device):
            model = lora_for(build_model(spec, setup.attention, setup.checkpointing, param_dtype(setup.precision),
                                         device=device), setup)
            optimizer = make_optimizer(model, setup.optimizer)
            step_model = _Compiled(model)
            kind = torch.device(device).type

            def step_fn(m, opt, batches, s, device_type, **kw):
                return train_step(step_model, opt, batches, s, device_type, check_finite=False, **kw)

            for p in model.parameters():  # the warm-up compiles; its gradients do not stay into the trace
                p.grad = None
            step_fn(model, optimizer, _random_batches(spec, setup, device), setup, kind)
            optimizer.state.clear()  # the traced steps make their own state, as trace_step's first step does
            total, categories, _ = _tracked_steps(model, optimizer, setup,
                                                  lambda: _random_batches(spec, setup, device), kind,
                                                  step_fn=step_fn)
            saved = step_model.saved_for_backward()
            if len(step_model.partitioned) != 2:
                raise RuntimeError(f"torch.compile partitioned {len(step_model.partitioned)} graphs of the model's "
                                   "step; the compiled trace expects one forward and one backward")
    finally:
        torch._dynamo.reset()
    nodes = {f"{'backward' if backward else 'forward'}_nodes": len(gm.graph.nodes)
             for gm, backward in step_model.partitioned}  # the graphs' sizes: what inductor lowers and compiles
    return StepMemory(peak_allocated=total, breakdown=categories, terms={"forward_saved": saved["saved"], **nodes},
                      method=f"MemTracker under FakeTensorMode ({device}), inductor's partitioned graphs op by op")
