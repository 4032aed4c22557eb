"""Run one validation config: the analytic prediction, the exact trace, and a real measured step on the local device."""

from __future__ import annotations

import time

from memplan.hardware import Device
from memplan.memory import (COLLECTIVES_OF_FAMILY, ddp_bucket_bytes, fsdp_all_sharded_grad_bytes,
                            fsdp_optimizer_state_bytes, fsdp_sharded_weight_bytes, gradient_bytes, optimizer_state_bytes,
                            peak_memory, peak_memory_of_rank, rope_buffer_bytes, weight_bytes)
from memplan.validate import MatrixConfig, ValidationRow
from trainer.measure import local_family, measure_step, trace_step


def predicted_terms(config: MatrixConfig) -> dict[str, int]:
    """The analytic counterparts of what ``trainer.measure._TermProbe`` reads off a real step."""
    spec, setup = config.spec, config.setup
    walk_marks = {m.name: m.total for m in peak_memory(spec, setup).moments}
    return {
        "weights": weight_bytes(spec, setup) + rope_buffer_bytes(spec, setup),
        "gradients": gradient_bytes(spec, setup),
        "optimizer": optimizer_state_bytes(spec, setup),
        "forward_saved": walk_marks["end of forward"] - walk_marks["start of forward"],
    }


def run_config(config: MatrixConfig, device: Device, trace: bool = True) -> ValidationRow:
    """Predict, trace and measure one config on the local device."""
    t0 = time.perf_counter()
    family = local_family()
    predicted = peak_memory(config.spec, config.setup, device.runtime_context_bytes, device.allocator_overhead)
    measured = measure_step(config.spec, config.setup, family)
    traced = trace_step(config.spec, config.setup, "cpu" if family == "cpu" else "cuda") if trace else None
    rss_delta = (measured.peak_rss - measured.baseline_rss) if measured.peak_rss is not None else None
    return ValidationRow(
        name=config.name, spec=config.spec, setup=config.setup,
        predicted_allocated=predicted.peak_allocated, measured_allocated=measured.peak_allocated,
        trace_allocated=traced.peak_allocated if traced else None,
        predicted_reserved=predicted.peak_reserved,
        measured_reserved=measured.peak_reserved, driver_used=measured.driver_used, measured_rss_delta=rss_delta,
        peak_moment=predicted.peak_moment, predicted_terms=predicted_terms(config), measured_terms=measured.terms,
        seconds=time.perf_counter() - t0,
    )



def predicted_rank_terms(config: MatrixConfig, rank: int, collectives: str) -> dict[str, int]:
    """``predicted_terms`` of one rank of a DDP or FSDP step: the sharded (FSDP) or whole
    parameters, DDP's buckets or FSDP's sharded gradients, the rank's optimizer state."""
    spec, setup = config.spec, config.setup
    walk_marks = {m.name: m.total for m in peak_memory_of_rank(spec, setup, rank, collectives=collectives).moments}
    if setup.sharding == "fsdp":
        from memplan.memory import fsdp_compute_setup

        terms = {"weights": fsdp_sharded_weight_bytes(spec, setup) + rope_buffer_bytes(spec, fsdp_compute_setup(setup)),
                 "gradients": fsdp_all_sharded_grad_bytes(spec, setup),
                 "optimizer": fsdp_optimizer_state_bytes(spec, setup, rank)}
    else:
        terms = {"weights": weight_bytes(spec, setup) + rope_buffer_bytes(spec, setup),
                 "gradients": ddp_bucket_bytes(spec, setup), "optimizer": optimizer_state_bytes(spec, setup)}
    terms["forward_saved"] = walk_marks["end of forward"] - walk_marks["start of forward"]
    return terms


def run_distributed(configs: list[MatrixConfig], device: Device, world_size: int) -> list[ValidationRow]:
    """Predict every rank of every config and measure them for real: ``world_size`` gloo processes
    on this machine, each measuring its own steady-state step with MemTracker. One row per rank."""
    from trainer.distributed import measure_ranks

    t0 = time.perf_counter()
    collectives = COLLECTIVES_OF_FAMILY["cpu"]  # the ranks run on this machine's CPU, over gloo
    measured = measure_ranks([(c.spec, c.setup) for c in configs], world_size)
    seconds = (time.perf_counter() - t0) / max(1, len(configs) * world_size)
    rows = []
    for config, ranks in zip(configs, measured):
        for rank, m in enumerate(ranks):
            predicted = peak_memory_of_rank(config.spec, config.setup, rank, device.runtime_context_bytes,
                                            device.allocator_overhead, collectives=collectives)
            rows.append(ValidationRow(
                name=f"{config.name} rank {rank}", spec=config.spec, setup=config.setup,
                predicted_allocated=predicted.peak_allocated, measured_allocated=m.peak_allocated,
                predicted_reserved=predicted.peak_reserved, peak_moment=predicted.peak_moment,
                predicted_terms=predicted_rank_terms(config, rank, collectives), measured_terms=m.terms,
                seconds=seconds, rank=rank))
    return rows
