"""TrainSetup: how a ModelSpec is trained (context, batch, precision, attention, checkpointing, optimizer)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from memplan.errors import InputError
from memplan.units import choice_error

PRECISIONS = ("fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16")
ATTENTIONS = ("eager", "sdpa")
CHECKPOINTINGS = ("none", "selective", "full")
OPTIMIZERS = ("adamw", "adamw-fused", "sgd", "adamw8bit")
SHARDINGS = ("none", "ddp", "fsdp")
TRAIN_STACKS = ("memplan", "transformers")  # whose model class a run trains (memplan's own, or transformers')
LORA_TARGETS = ("qkv", "proj", "up", "down")  # the reference model's block matrices an adapter can sit on
QKV_PARTS = ("q", "k", "v")  # an adapter on one slice of the fused qkv matrix (qkv: all three, one adapter)
# what --lora-targets accepts, in the order a setup names them: q, k, v alone (qkv is their shorthand), the
# block's other matrices, and the LM head
LORA_TARGET_NAMES = ("qkv", *QKV_PARTS, "proj", "up", "down", "head")

# Bytes per element of each dtype.
FP32_BYTES = 4
HALF_BYTES = 2  # bf16 and fp16


def canonical_lora_targets(text) -> str:
    """``--lora-targets`` in the setup's order (``LORA_TARGET_NAMES``), q, k and v together written qkv; else
    the one-line InputError naming the accepted values."""
    targets = {t.strip() for t in str(text).split(",") if t.strip()}
    if not targets or not targets <= set(LORA_TARGET_NAMES):
        raise InputError(f"--lora-targets: {text!r} must be a comma-separated subset of "
                         f"{', '.join(LORA_TARGET_NAMES)}")
    if set(QKV_PARTS) <= targets or "qkv" in targets:
        targets = (targets - set(QKV_PARTS)) | {"qkv"}
    return ",".join(t for t in LORA_TARGET_NAMES if t in targets)


@dataclass(frozen=True, kw_only=True)
class TrainSetup:
    """One training configuration. Frozen; validates itself."""

    ctx: int = 1024  # tokens per sequence
    micro_batch: int = 1  # sequences per forward/backward
    grad_accum: int = 1  # micro-batches per optimizer step
    precision: str = "bf16-mixed"  # fp32 | tf32 | bf16-mixed | fp16-mixed | bf16 (pure)
    attention: str = "sdpa"  # eager (explicit T×T scores) | sdpa (fused scaled_dot_product_attention)
    checkpointing: str = "none"  # none | selective (recompute cheap ops) | full (recompute each layer)
    optimizer: str = "adamw"  # adamw (foreach) | adamw-fused | sgd (momentum) | adamw8bit
    world_size: int = 1  # data-parallel processes
    sharding: str = "none"  # none | ddp | fsdp
    compile: bool = False  # torch.compile the model
    lora_rank: int = 0  # > 0: LoRA finetuning, base weights frozen, rank-r adapters on lora_targets train
    lora_targets: str = "qkv,proj,up,down"  # comma-separated subset of LORA_TARGET_NAMES
    stack: str = "memplan"  # TRAIN_STACKS: whose model class trains (a plan of another is walked as it runs)

    def __post_init__(self) -> None:
        for field, choices in (("precision", PRECISIONS), ("attention", ATTENTIONS),
                               ("checkpointing", CHECKPOINTINGS), ("optimizer", OPTIMIZERS),
                               ("sharding", SHARDINGS), ("stack", TRAIN_STACKS)):
            if getattr(self, field) not in choices:
                raise choice_error(f"--{field}", str(getattr(self, field)), list(choices))
        for field in ("ctx", "micro_batch", "grad_accum", "world_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                flag = {"micro_batch": "batch"}.get(field, field).replace("_", "-")
                raise InputError(f"--{flag}: {value!r} must be a positive integer")
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 0:
            raise InputError(f"--lora-rank: {self.lora_rank!r} must be 0 (no LoRA) or a positive integer")
        object.__setattr__(self, "lora_targets", canonical_lora_targets(self.lora_targets))
        if self.world_size > 1 and self.sharding == "none":
            raise InputError(f"--world-size {self.world_size} needs --sharding ddp or fsdp")
        if self.world_size == 1 and self.sharding != "none":
            object.__setattr__(self, "sharding", "none")
        if self.sharding == "fsdp" and self.optimizer == "adamw8bit":
            raise InputError("--optimizer adamw8bit does not run under --sharding fsdp (bitsandbytes' 8-bit states "
                             "do not shard as FSDP2's DTensors); accepted with fsdp: adamw, adamw-fused, sgd")

    # ---- derived ---------------------------------------------------------------------------
    @property
    def tokens_per_micro_batch(self) -> int:
        return self.ctx * self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step across all processes."""
        return self.ctx * self.micro_batch * self.grad_accum * self.world_size

    @property
    def mixed(self) -> bool:
        """fp32 master weights with a low-precision autocast compute dtype."""
        return self.precision in ("bf16-mixed", "fp16-mixed")

    @property
    def param_bytes(self) -> int:
        """Bytes per stored weight (and gradient): 2 for pure bf16, else 4 (fp32 master weights)."""
        return HALF_BYTES if self.precision == "bf16" else FP32_BYTES

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of matmul inputs and outputs: 2 under bf16/fp16, else 4."""
        return HALF_BYTES if self.precision in ("bf16-mixed", "fp16-mixed", "bf16") else FP32_BYTES

    @property
    def compute_dtype(self) -> str:
        """The dtype matmuls run in: fp32, tf32, bf16 or fp16 (keys of a profile's peak table)."""
        return {"fp32": "fp32", "tf32": "tf32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16": "bf16"}[
            self.precision]

    def to_json(self) -> dict:
        """The ``setup`` object of the --json output (docs/json.md)."""
        return {
            "ctx": self.ctx, "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
            "precision": self.precision, "attention": self.attention, "checkpointing": self.checkpointing,
            "optimizer": self.optimizer, "world_size": self.world_size, "sharding": self.sharding,
        } | ({"lora_rank": self.lora_rank, "lora_targets": self.lora_targets} if self.lora_rank else {})

    @property
    def lora(self) -> tuple[str, ...]:
        """The block matrices (``LORA_TARGETS``) that carry adapters; () without LoRA. qkv where any of
        q, k, v does (``lora_adapters`` says which); the head is ``lora_head``."""
        if not self.lora_rank:
            return ()
        names = set(self.lora_targets.split(","))
        return tuple(m for m in LORA_TARGETS if m in names or (m == "qkv" and names & set(QKV_PARTS)))

    @property
    def lora_adapters(self) -> tuple[str, ...]:
        """The block's adapters, one per name: qkv (one adapter on the fused matrix), or q, k, v alone
        (each an adapter on its slice of it), proj, up, down; () without LoRA."""
        if not self.lora_rank:
            return ()
        return tuple(t for t in self.lora_targets.split(",") if t != "head")

    @property
    def lora_head(self) -> bool:
        """Whether the LM head carries an adapter."""
        return bool(self.lora_rank) and "head" in self.lora_targets.split(",")

    def to_dict(self) -> dict:
        """The fields as plan.toml's [setup] holds them; ``stack`` only where it is not memplan's own (a plan
        of memplan's model reads as it always did)."""
        data = dataclasses.asdict(self)
        if data["stack"] == TrainSetup.stack:  # the field's default: memplan's own model
            del data["stack"]
        return data

    def replace(self, **changes) -> "TrainSetup":
        return dataclasses.replace(self, **changes)


def setup_from_flags(ctx: str = "1024", batch: str = "1", grad_accum: str = "1", precision: str = "bf16-mixed",
                     attention: str = "sdpa", checkpointing: str = "none", optimizer: str = "adamw",
                     world_size: str = "1", sharding: str = "none", compile: bool = False) -> TrainSetup:
    """The SETUP flags as typed (``--ctx 8k``, ``--batch 4``: counts parsed by ``memplan.units.parse_count``) as
    a ``TrainSetup``, which validates the rest; one sharding of several processes kept, else none."""
    from memplan.units import parse_count

    ws = parse_count(world_size, "--world-size")
    return TrainSetup(
        ctx=parse_count(ctx, "--ctx", binary=True),
        micro_batch=parse_count(batch, "--batch"),
        grad_accum=parse_count(grad_accum, "--grad-accum"),
        precision=precision, attention=attention, checkpointing=checkpointing, optimizer=optimizer,
        world_size=ws, sharding=sharding if ws > 1 or sharding != "none" else "none", compile=compile,
    )
