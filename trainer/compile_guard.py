"""``torch.compile`` where it cannot run: refused up front with one line naming the eager fallback, and a compile
that fails inside a step falls back to the eager step with a warning line (trainer/loop.py).

Inductor compiles C++ on a CPU (a C++ compiler: ``torch._inductor.config.cpp.cxx``, found by
``cpp_builder.get_cpp_compiler``) and Triton kernels on an NVIDIA or AMD GPU (the ``triton`` package).
"""

from __future__ import annotations

import sys

import torch

EAGER_FALLBACK = "training the eager step instead (the plan's memory and time for --no-compile)"


def compile_unavailable(device_type: str) -> str | None:
    """Why torch.compile (inductor) cannot compile for ``device_type`` here, or None when it can."""
    if device_type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception as e:  # inductor raises its own error types for a missing or unusable compiler
            first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            return f"no C++ compiler for inductor on this CPU ({first})"
        return None
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "inductor needs the triton package on a GPU (pip install triton)"
    if device_type == "mps":
        return None
    return f"inductor does not compile for the {device_type!r} device"


def compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a failing compile raises (dynamo's, inductor's, a C++ compiler's), and no others: an error
    of the step itself (shapes, out of memory) is not taken for one."""
    import torch._dynamo.exc as dynamo_exc
    import torch._inductor.exc as inductor_exc

    return (dynamo_exc.TorchDynamoException, inductor_exc.InductorError, inductor_exc.CppCompileError)


def warn(line: str) -> None:
    """One warning line on stderr."""
    print(f"warning: {' '.join(line.split())}", file=sys.stderr, flush=True)


def step_model_for(wrapped: torch.nn.Module, compile: bool, device_type: str) -> torch.nn.Module:
    """``torch.compile(wrapped)`` where ``compile`` asks for it and inductor can compile here; else ``wrapped``,
    with one warning line saying why and naming the eager fallback."""
    if not compile:
        return wrapped
    why = compile_unavailable(device_type)
    if why is not None:
        warn(f"--compile: {why}; {EAGER_FALLBACK}")
        return wrapped
    return torch.compile(wrapped)
