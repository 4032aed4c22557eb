"""Run one validation config: the analytic prediction, the exact trace, and a real measured step on the local device."""

from __future__ import annotations

import time

from memplan.hardware import Device
from memplan.memory import gradient_bytes, optimizer_state_bytes, peak_memory, rope_buffer_bytes, weight_bytes
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

