#!/usr/bin/env bash
# The whole GPU check in one run, within 8 minutes on one GPU: `memplan validate --quick` on the GPU
# (peak_allocated against torch.cuda.max_memory_allocated, the reserve against max_memory_reserved,
# peak_reserved against NVML's / ROCm SMI's peak), the same for every other training stack installed
# here, and a short `memplan train` (step time and memory against the prediction). One JSON file.
#
#   benchmarks/gpu_check.sh [OUT.json]          # default gpu_check.json
#
# Exit 0: complete, written to OUT. Exit 1: a stage failed or ran out of time; what ran is in
# OUT's NAME.incomplete.json and OUT is left as it was. Exit 2: no GPU here (one line), or a bad OUT.
# MEMPLAN_GPU_CHECK_REHEARSAL=1 runs the same stages on the CPU with a tiny model (the script's own
# check); MEMPLAN_GPU_CHECK_DEVICE=NAME|FILE passes --device to every stage. Details: benchmarks/gpu_check.py.
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" "$root/benchmarks/gpu_check.py" "$@"
