"""Memory terms against hand-computed values, the walk's bookkeeping, and the peak against real steps."""

import pytest

from memplan import memory as m
from memplan.model import ModelSpec
from memplan.setup import TrainSetup

# 2 layers, hidden 128, 4 heads of 32, 2 kv heads (kv width 64), SwiGLU 256, vocab 512, tied.
SPEC = ModelSpec(arch="llama", layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=512, tied=True)
N_PARAMS = 512 * 128 + 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256 + 2 * 128) + 128  # 361,088
MIXED = TrainSetup(ctx=64, micro_batch=2, precision="bf16-mixed")  # n = 128 tokens
FP32 = MIXED.replace(precision="fp32")
PURE = MIXED.replace(precision="bf16")


def test_weights_gradients_and_optimizer_states():
    assert SPEC.params == N_PARAMS == 361_088
    assert m.weight_bytes(SPEC, MIXED) == N_PARAMS * 4  # fp32 master weights
    assert m.weight_bytes(SPEC, PURE) == N_PARAMS * 2
    assert m.gradient_bytes(SPEC, MIXED) == N_PARAMS * 4
    steps = SPEC.n_tensors * 4  # AdamW's 0-dim fp32 `step` per tensor; 14 tensors
    assert SPEC.n_tensors == 14
    assert m.optimizer_state_bytes(SPEC, MIXED) == 2 * N_PARAMS * 4 + steps
    assert m.optimizer_state_bytes(SPEC, PURE) == 2 * N_PARAMS * 2 + steps
    assert m.optimizer_state_bytes(SPEC, MIXED.replace(optimizer="sgd")) == N_PARAMS * 4
    decay = N_PARAMS - (2 * 2 * 128 + 128)  # norms have no weight decay
    eight_bit = 2 * (decay + -(-decay // 256) * 4) + 2 * (N_PARAMS - decay) * 4 + steps
    assert m.optimizer_state_bytes(SPEC, MIXED.replace(optimizer="adamw8bit")) == eight_bit


def test_optimizer_temporaries_foreach_holds_one_parameter_sized_buffer_fused_none():
    decay = N_PARAMS - (2 * 2 * 128 + 128)
    assert m.optimizer_temporary_bytes(SPEC, MIXED) == decay * 4
    assert m.optimizer_temporary_bytes(SPEC, MIXED.replace(optimizer="adamw-fused")) == 0
    assert m.optimizer_temporary_bytes(SPEC, MIXED.replace(optimizer="sgd")) == decay * 4


def test_autocast_weight_copies_are_bf16_copies_of_every_matmul_weight():
    per_layer = (128 * 256 + 128 * 128 + 128 * 512 + 256 * 128) * 2  # qkv, proj, gate|up, down
    assert m.layer_lowp_weight_bytes(SPEC, MIXED) == per_layer
    assert m.lowp_weight_copy_bytes(SPEC, MIXED) == 2 * per_layer + 512 * 128 * 2  # + the (tied) head
    assert m.lowp_weight_copy_bytes(SPEC, FP32) == 0 and m.lowp_weight_copy_bytes(SPEC, PURE) == 0


def test_activation_terms_of_one_block_by_hand():
    n = 128
    assert m.residual_stream_bytes(SPEC, MIXED) == 2 * n * 128 * 4  # fp32 residual under autocast
    assert m.residual_stream_bytes(SPEC, PURE) == 2 * n * 128 * 2
    assert m.norm_stat_bytes(SPEC, MIXED) == n * 4
    assert m.norm_output_bytes(SPEC, MIXED) == n * 128 * 2
    assert m.qkv_output_bytes(SPEC, MIXED) == n * (128 + 2 * 64) * 2
    assert m.rotated_q_bytes(SPEC, MIXED) == n * 128 * 2 and m.rotated_k_bytes(SPEC, MIXED) == n * 64 * 2
    assert m.sdpa_output_bytes(SPEC, MIXED) == n * 128 * 2
    assert m.sdpa_logsumexp_bytes(SPEC, MIXED) == n * 4 * 4
    assert m.attention_scores_bytes(SPEC, MIXED) == 2 * 4 * 64 * 64 * 2  # B · heads · T² · a
    assert m.eager_kv_bytes(SPEC, MIXED) == n * 128 * 2  # repeated to 4 heads under GQA
    assert m.eager_kv_bytes(SPEC.replace(kv_heads=4), MIXED) == n * 128 * 2
    assert m.eager_kv_bytes(SPEC, MIXED) == m.eager_kv_bytes(SPEC.replace(kv_heads=4), MIXED)
    assert m.mlp_up_bytes(SPEC, MIXED) == n * 512 * 2 and m.mlp_inner_bytes(SPEC, MIXED) == n * 256 * 2
    assert m.causal_mask_bytes(SPEC, MIXED.replace(attention="eager")) == 64 * 64
    sdpa = m.layer_activation_terms(SPEC, MIXED)
    assert sum(sdpa.values()) == (2 * n * 128 * 4 + 2 * n * 4 + 2 * n * 128 * 2 + n * 256 * 2 + n * 192 * 2
                                  + n * 128 * 2 + n * 16 + n * (512 + 2 * 256) * 2 + m.layer_lowp_weight_bytes(SPEC, MIXED))


def test_eager_attention_saves_the_t_squared_probabilities_and_sdpa_does_not():
    eager = m.layer_activation_terms(SPEC, MIXED.replace(attention="eager"))
    sdpa = m.layer_activation_terms(SPEC, MIXED)
    assert eager["attention"] == 2 * 4 * 64 * 64 * 2
    assert sdpa["attention"] == 128 * 128 * 2 + 128 * 4 * 4  # output and log-sum-exp only


def test_checkpointing_keeps_less():
    none = m.saved_per_layer_bytes(SPEC, MIXED)
    selective = m.saved_per_layer_bytes(SPEC, MIXED.replace(checkpointing="selective"))
    full = m.saved_per_layer_bytes(SPEC, MIXED.replace(checkpointing="full"))
    assert full == 128 * 128 * 4  # the block input only
    assert full < selective < none


def test_loss_terms_are_fp32_and_scale_with_vocab():
    assert m.logits_bytes(SPEC, MIXED) == 128 * 512 * 2
    assert m.fp32_logits_bytes(SPEC, MIXED) == 128 * 512 * 4
    assert m.input_bytes(SPEC, MIXED.replace(grad_accum=3)) == 3 * 2 * 128 * 8


@pytest.mark.parametrize("setup", [MIXED, FP32, PURE, MIXED.replace(attention="eager", checkpointing="full"),
                                   FP32.replace(checkpointing="selective", grad_accum=2)])
def test_the_walk_balances_its_books(setup):
    walk = m._walk_step(SPEC, setup)
    marks = {mk.name: mk.bytes for mk in walk.marks}
    end = marks["end of backward"]
    assert end["temporaries"] == 0 and end["logits"] == 0
    assert end["activations"] == m.input_bytes(SPEC, setup)  # only the token ids remain
    assert end["gradients"] == m.gradient_bytes(SPEC, setup)
    assert end["weights"] == m.weight_bytes(SPEC, setup) + m.rope_buffer_bytes(SPEC, setup)
    assert all(v >= 0 for mk in walk.marks for v in mk.bytes.values())


def test_peak_reserved_adds_the_runtime_context_and_allocator_reserve():
    peak = m.peak_memory(SPEC, MIXED, runtime_context_bytes=300 << 20, allocator_overhead=0.05)
    assert peak.runtime == int(peak.peak_allocated * 0.05) + (300 << 20)
    assert peak.peak_reserved == peak.peak_allocated + peak.runtime
    assert peak.peak_phase in ("forward", "backward", "optimizer")


def test_memory_grows_with_batch_and_context():
    peaks = [m.peak_memory(SPEC, MIXED.replace(micro_batch=b)).peak_allocated for b in (1, 2, 4, 8)]
    assert peaks == sorted(peaks) and len(set(peaks)) == 4


@pytest.mark.parametrize("spec,setup", [
    (SPEC, MIXED),
    (SPEC, FP32.replace(attention="eager", checkpointing="full", grad_accum=2)),
    (SPEC.replace(arch="gpt2", heads=4, kv_heads=4, max_positions=128), PURE.replace(checkpointing="selective")),
])
def test_the_analytic_peak_matches_a_real_step(spec, setup):
    """The claim of accuracy, measured: MemTracker on a real steady-state step on the CPU."""
    from trainer.measure import measure_step_cpu

    measured = measure_step_cpu(spec, setup).peak_allocated
    predicted = m.peak_memory(spec, setup).peak_allocated
    assert abs(predicted - measured) / measured < 0.01


def test_repeated_kv_where_no_flash_kernel_takes_gqa(monkeypatch):
    """GTX 1650, Apple, fp32 on CUDA: the model repeats K/V for SDPA; the plan counts them."""
    import trainer.model as model
    from memplan.estimate import memory_on
    from memplan.hardware import load_profile
    from trainer.measure import trace_step

    spec = SPEC.replace(heads=8, kv_heads=2, vocab=256)
    setup = FP32.replace(ctx=256, micro_batch=4)
    assert m.sdpa_gqa_repeats(spec, setup, flash_attention=False, family="cuda")
    assert not m.sdpa_gqa_repeats(spec, setup, flash_attention=True, family="cpu")
    assert not m.sdpa_gqa_repeats(spec, MIXED, flash_attention=True, family="cuda")
    assert m.sdpa_gqa_repeats(spec, setup, flash_attention=True, family="cuda")  # flash needs fp16/bf16
    monkeypatch.setattr(model, "sdpa_takes_gqa", lambda q, k, v: False)
    traced = trace_step(spec, setup, "cpu").peak_allocated
    assert abs(m.peak_memory(spec, setup, gqa_repeat=True).peak_allocated - traced) / traced < 0.001
    gtx = load_profile("gtx-1650")
    assert memory_on(spec, setup, gtx).peak_allocated == m.peak_memory(spec, setup, gqa_repeat=True).peak_allocated
