"""The transformers stack: a Hugging Face model and the step as transformers' ``Trainer`` runs it.

- the model: ``AutoModelForCausalLM.from_config`` with ``attn_implementation`` "sdpa" or "eager",
  stored in fp32 (mixed precision: ``torch.autocast`` around the forward, as ``Trainer`` does with
  ``bf16=True``) or in bf16 (pure bf16: ``dtype=torch.bfloat16``);
- the loss: ``model(input_ids=ids, labels=ids).loss``, which is transformers' ``ForCausalLMLoss``
  (``transformers/loss/loss_utils.py``): it upcasts the logits to fp32 (``logits.float()``), pads
  and shifts the labels, and takes ``cross_entropy`` over the flattened fp32 logits;
- ``Trainer.training_step``: the outputs are dropped before ``backward`` (``compute_loss`` returns
  the loss alone), the loss is divided by the accumulation steps, the gradients are clipped to 1.0
  (``max_grad_norm``) and ``optimizer.zero_grad()`` frees them;
- checkpointing ``full``: ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable()``
  before transformers 5.2x), with the library's own defaults;
- LoRA: peft's ``LoraConfig(r, lora_alpha, lora_dropout, target_modules)`` and ``get_peft_model``
  (a peft ``Linear`` saves its dropout's output as the input of ``lora_A``; with a dropout above 0
  also the dropout's mask).
"""

from __future__ import annotations

import contextlib

import torch

from memplan.emit import hf_lora_modules
from memplan.errors import InputError
from memplan.setup import TrainSetup
from trainer.stacks import StackModel, converting_fake_parameters, require

STACK = "transformers"
LIBRARY = "transformers"
LORA_LIBRARY = "peft"  # its LoRA: peft's LoraConfig and get_peft_model
DEFAULT_LORA_ALPHA = 16.0
PEFT_DEFAULT_DROPOUT = 0.0  # peft's LoraConfig.lora_dropout default


def config_dict(model: StackModel, setup: TrainSetup) -> dict:
    """config.json's contents for the model: the user's own file, else the config of memplan's
    spec in that family (``trainer.export.hf.spec_config``), its context at least ``setup.ctx``."""
    if model.hf_config is not None:
        return dict(model.hf_config)
    from trainer.export.hf import spec_config

    spec = model.spec
    context = max(setup.ctx, spec.max_positions)
    if spec.pos == "learned" and setup.ctx > spec.max_positions:
        raise InputError(f"--ctx {setup.ctx}: longer than the {spec.max_positions} learned positions of this model")
    cfg = family_config(spec, context) if not spec.memplan_builds else spec_config(spec, context)
    return {**cfg, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


_ACT_NAMES = {"gelu_new": "gelu_new", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu", "silu": "silu"}


def family_config(spec, context: int) -> dict:
    """config.json's contents for a spec of a family memplan's trainer does not build (phi, gemma,
    stablelm, qwen3: ``memplan.model.STACK_ARCHS``), as ``memplan.model.from_hf_config`` reads them
    back: the family's own keys, the spec's dropout in the family's fields (``memplan.model.DROPOUT_KEYS``)."""
    common = {"model_type": spec.arch, "hidden_size": spec.hidden, "intermediate_size": spec.ffn,
              "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads,
              "num_key_value_heads": spec.kv_heads, "vocab_size": spec.vocab, "tie_word_embeddings": spec.tied,
              "max_position_embeddings": context, "rope_theta": spec.rope_theta, "hidden_act": _ACT_NAMES[spec.act],
              "attention_dropout": spec.attn_dropout, "initializer_range": 0.02}
    if spec.arch in ("gemma", "qwen3"):
        extra = {"head_dim": spec.head_dim, "rms_norm_eps": spec.norm_eps, "attention_bias": False}
        if spec.arch == "gemma":
            extra["hidden_activation"] = _ACT_NAMES[spec.act]
        return {**common, **extra}
    extra = {"layer_norm_eps": spec.norm_eps, "partial_rotary_factor": spec.rotary_pct, "qk_layernorm": False}
    if spec.arch == "phi":
        return {**common, **extra, "resid_pdrop": spec.resid_dropout, "embd_pdrop": spec.embd_dropout}
    return {**common, **extra, "use_qkv_bias": spec.qkv_bias, "use_parallel_residual": spec.parallel_residual,
            "hidden_dropout": spec.resid_dropout}


@contextlib.contextmanager
def _quiet(transformers):
    """transformers' and peft's notes about the config off while they build the model: token ids,
    their own deprecations (FutureWarning) and peft's fan_in_fan_out for GPT-2's Conv1D."""
    import warnings

    logging = transformers.utils.logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
            yield
    finally:
        logging.set_verbosity(level)


def build_model(model: StackModel, setup: TrainSetup, lora_dropout: float | None = None,
                lora_alpha: float = DEFAULT_LORA_ALPHA, before_lora=None) -> torch.nn.Module:
    """transformers' model for ``model`` in ``setup``'s precision, attention, checkpointing and LoRA;
    ``before_lora(net)`` (memplan's training of this class, ``trainer.hf_model``) loads weights into the
    plain model before checkpointing and peft's adapters are applied."""
    transformers = require("transformers", STACK)
    from trainer.step import param_dtype

    cfg = config_dict(model, setup)
    model_type = cfg.get("model_type")
    try:
        config = transformers.AutoConfig.for_model(**cfg)
    except Exception as e:  # a hostile config.json: transformers' (and huggingface_hub's) validators raise their own
        if isinstance(e, (KeyboardInterrupt, MemoryError)):
            raise
        raise InputError(f"--model: transformers cannot build model_type {model_type!r} "
                         f"({' '.join(str(e).split())[:200]})") from None
    config.use_cache = False
    config.loss_type = "ForCausalLM"  # what from_config's models take by default, named (no warning)
    if setup.checkpointing == "selective":
        raise InputError("--stack transformers: checkpointing 'selective' is memplan's own; transformers "
                         "checkpoints whole layers (accepted: none, full)")
    try:
        with _quiet(transformers):
            net = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=setup.attention,
                                                                dtype=param_dtype(setup.precision))
    except (ValueError, AssertionError, TypeError, KeyError) as e:
        raise InputError(f"--model: transformers could not build this {model_type} model for attention "
                         f"{setup.attention!r} ({' '.join(str(e).split())[:240]})") from None
    if before_lora is not None:
        before_lora(net)
    if setup.checkpointing == "full":
        enable = getattr(net, "activation_checkpointing_enable", None) or net.gradient_checkpointing_enable
        enable()
    if setup.lora_rank:
        with _quiet(transformers):
            net = _with_peft_lora(net, model_type, setup, lora_alpha,
                                  PEFT_DEFAULT_DROPOUT if lora_dropout is None else lora_dropout)
    net.train()
    return net


def lora_target_modules(model_type: str, targets: str) -> str:
    """peft's ``target_modules``: a regex matching the modules of memplan's ``targets``
    (``memplan.emit.hf_lora_modules``)."""
    modules = hf_lora_modules(model_type, targets)
    return r"(?:.*\.)?(" + "|".join(m.replace(".", r"\.") for m in modules) + ")$"  # lm_head: a top-level name


def _with_peft_lora(net, model_type: str, setup: TrainSetup, alpha: float, dropout: float):
    peft = require(LORA_LIBRARY, STACK)
    config = peft.LoraConfig(r=setup.lora_rank, lora_alpha=alpha, lora_dropout=dropout,
                             target_modules=lora_target_modules(model_type, setup.lora_targets),
                             fan_in_fan_out=model_type == "gpt2",  # GPT-2's Conv1D stores W transposed
                             task_type="CAUSAL_LM")

    try:
        with converting_fake_parameters():
            return peft.get_peft_model(net, config)
    except ImportError as e:  # peft 0.19+ refuses a torchao older than 0.16 (torchtune 0.6 needs one older than 0.15)
        raise InputError(f"--stack transformers --lora-rank: peft cannot load its adapters here "
                         f"({' '.join(str(e).split())[:200]}); memplan[torchtune] needs an environment of its own") from None


def train_step(model, optimizer, micro_batches, setup: TrainSetup, device_type: str, clip: float | None = 1.0,
               before_forward=None, after_forward=None) -> None:
    """One optimizer step as ``transformers.Trainer`` takes it (``training_step``, then the clip and
    the optimizer step of its loop); ``micro_batches`` are (input_ids, unused) pairs whose labels
    are the inputs themselves, shifted by the loss."""
    from trainer.step import autocast

    n = len(micro_batches)
    for i, (ids, _) in enumerate(micro_batches):
        if before_forward is not None:
            before_forward(i)
        with autocast(setup.precision, device_type):
            loss = model(input_ids=ids, labels=ids).loss  # compute_loss: the outputs go, the loss stays
        loss = loss / n
        if after_forward is not None:
            after_forward(i)
        loss.backward()
        del loss
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@contextlib.contextmanager
def as_on_real_tensors():
    """Within a trace, transformers takes the paths it takes on real tensors.

    transformers reads a FakeTensor as a sign of graph tracing (``is_tracing`` in
    ``transformers/utils/import_utils.py``: torch.export hands it fake tensors) and then keeps an
    explicit causal mask (``masking_utils._ignore_causal_mask_sdpa``) instead of SDPA's
    ``is_causal``, which also turns off ``enable_gqa`` and repeats K and V to every query head
    (``repeat_kv``). Eagerly, with no padding, it passes no mask. Here a fake tensor is not a
    traced graph: the trace runs the model eagerly, as ``measure_stack`` does.

    Taken eagerly, the mask code reads one value: whether the position ids hold several packed
    sequences (``masking_utils.find_packed_sequence_indices``), which a fake tensor cannot answer.
    The trace's micro-batches are single unpacked windows (positions 0..ctx-1, made by the model),
    for which that function returns None on real tensors: it returns None here too."""
    from transformers import masking_utils
    from transformers.utils import import_utils

    saved = import_utils.is_fake_tensor, masking_utils.find_packed_sequence_indices
    import_utils.is_fake_tensor = lambda x: False
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        import_utils.is_fake_tensor, masking_utils.find_packed_sequence_indices = saved


def trial_steps(model: StackModel, setup: TrainSetup, run_setup: TrainSetup, steps: int, device, seed: int = 0,
                emitted: dict | None = None, on_step=None) -> None:
    """``steps`` optimizer steps of ``transformers.Trainer`` itself (``autotune --verify --stack transformers``),
    with the ``TrainingArguments`` ``autotune --emit`` writes for the plan (``emitted``: its files, by name;
    peft's ``LoraConfig`` from ``lora_config.json`` where LoRA is planned); ``on_step(seconds)`` after each
    step, its seconds from ``on_step_begin`` to ``on_step_end``.

    The model is built as the emitted ``train.py`` builds it, from the config instead of weights: the dtype
    (bf16 for pure bf16), ``attn_implementation``, ``use_cache=False``, then peft's adapters; checkpointing
    is the arguments' ``gradient_checkpointing``, which ``Trainer`` applies. The arguments are the emitted ones
    but for what a trial must change: ``output_dir`` (a temporary directory), ``max_steps``,
    ``gradient_accumulation_steps`` (``run_setup``'s: the plan's, capped), no checkpoint saved, no progress
    bar, ``seed``. The data: ``micro_batch × accumulation × steps`` random windows of ``ctx`` tokens, each its
    own labels, in memory (``default_data_collator``), as ``train.py``'s ``text_dataset`` makes them."""
    import json
    import tempfile
    import time

    transformers = require("transformers", STACK)
    from trainer import device as devices

    emitted = emitted or {}
    if "training_args.json" not in emitted:
        raise InputError("--verify --stack transformers: the trial needs the emitted training_args.json")
    kwargs = json.loads(emitted["training_args.json"])
    lora = json.loads(emitted["lora_config.json"]) if "lora_config.json" in emitted else None
    net = build_model(model, setup.replace(checkpointing="none", lora_rank=0))  # Trainer checkpoints, peft adapts
    if lora is not None:
        peft = require(LORA_LIBRARY, STACK)
        with _quiet(transformers):
            net = peft.get_peft_model(net, peft.LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    vocab = config_dict(model, setup)["vocab_size"]
    dataset = []
    for _ in range(setup.micro_batch * run_setup.grad_accum * steps):
        ids = torch.randint(0, vocab, (setup.ctx,), generator=gen)
        dataset.append({"input_ids": ids, "labels": ids})
    sync = devices.synchronizer(device)

    class Timer(transformers.TrainerCallback):
        started = 0.0

        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            if on_step is not None:
                on_step(time.perf_counter() - self.started)

    with tempfile.TemporaryDirectory(prefix="memplan-verify-") as out, _quiet(transformers):
        kwargs.update(output_dir=out, max_steps=steps, gradient_accumulation_steps=run_setup.grad_accum,
                      save_strategy="no", disable_tqdm=True, seed=seed, use_cpu=device.type == "cpu")
        args = transformers.TrainingArguments(**kwargs)
        trainer = transformers.Trainer(model=net, args=args, train_dataset=dataset,
                                       data_collator=transformers.default_data_collator, callbacks=[Timer()])
        trainer.train()


def for_fake_tensors(net: torch.nn.Module, setup: TrainSetup) -> None:
    """Within a trace, the model's rotary embeddings with dynamic NTK scaling (``rope_type`` "dynamic") make
    the tensors their forward makes on real tensors without reading a value.

    ``dynamic_rope_update`` (transformers/modeling_rope_utils.py) wraps each rotary embedding's forward:
    ``seq_len = torch.max(position_ids) + 1``; ``if seq_len > max_seq_len_cached`` it recomputes
    ``inv_freq`` for that length (``ROPE_INIT_FUNCTIONS["dynamic"]`` with the tensor ``seq_len``), registers
    it as the buffer and keeps ``seq_len`` as ``max_seq_len_cached``; ``if seq_len < original_max_seq_len``
    after growth it restores the original. A fake tensor has no value for the ``if``s (the trace raised
    DataDependentOutputException). The trace's micro-batches are single unpacked windows (positions
    0..ctx-1, made by the model), so ``seq_len`` is ``ctx`` at every forward: each forward here makes
    ``seq_len`` as the library does and takes the branches that ``ctx`` takes (growth at the first forward
    past max_position_embeddings, then nothing), then runs the unwrapped forward (``__wrapped__``)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for module in net.modules():
        rope_type = getattr(module, "rope_type", None)
        forward = getattr(type(module).forward, "__wrapped__", None)
        if isinstance(rope_type, str) and "dynamic" in rope_type and forward is not None:
            module.forward = _dynamic_forward(module, forward, ROPE_INIT_FUNCTIONS[rope_type], setup.ctx)


def _dynamic_forward(module, forward, rope_init_fn, ctx: int):
    """``module``'s forward as ``dynamic_rope_update`` runs it for positions 0..ctx-1 (``for_fake_tensors``)."""
    cached = [int(module.max_seq_len_cached)]  # the length the module's inv_freq is for

    def run(x, position_ids, *args, **kwargs):
        seq_len = torch.max(position_ids) + 1  # dynamic_frequency_update's; its value is ctx
        if ctx > cached[0]:  # growth
            inv_freq, module.attention_scaling = rope_init_fn(module.config, x.device, seq_len=seq_len)
            module.register_buffer("inv_freq", inv_freq, persistent=False)
            module.max_seq_len_cached, cached[0] = seq_len, ctx
        if ctx < module.original_max_seq_len < cached[0]:  # reset (not reached: every forward is ctx long)
            module.register_buffer("inv_freq", module.original_inv_freq.to(x.device), persistent=False)
            module.max_seq_len_cached, cached[0] = module.original_max_seq_len, module.original_max_seq_len
        del seq_len
        return forward(module, x, position_ids, *args, **kwargs)

    return run
