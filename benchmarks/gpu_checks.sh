#!/usr/bin/env bash
# The checks only a GPU can show, as one command. On a machine with a CUDA GPU and a CUDA build
# of torch, from the repository root:
#
#     bash benchmarks/gpu_checks.sh                  # results in /tmp/gpu_checks
#     OUT=results PYTHON=.venv/bin/python bash benchmarks/gpu_checks.sh
#
# It needs torch with CUDA, nvidia-ml-py, psutil, pytest and pytest-timeout; not Ray (no check
# here starts a cluster). It installs the repository editable with --no-deps (PYTHONPATH as a
# fallback), so it downloads nothing. The step timeouts below add up to 8 minutes (expect about
# 4). Each step's output lands in $OUT/<step>.txt, even when a step times out; the last lines
# printed are the summary table, which docs/benchmarks.md records.
#
# The steps:
#   pytest_gpu        the CUDA / NVML tests that skip without a GPU
#   planner_accuracy  estimate() vs torch.cuda.max_memory_allocated, 4 model families, 1 rank
#   gate_overhead     StepGuard (CUDA events + CudaMemoryProbe) and GuardedDataLoader on CUDA
#   loader_sizing     data-wait fraction with batches delivered to the GPU
# Locally (no GPU) every step but the first reports that CUDA is missing; OUT defaults to
# /tmp/gpu_checks there.
set -u -o pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the fallback if the install fails
: > "$OUT/summary.txt"

step() {  # step NAME TIMEOUT_S COMMAND...: run, keep going whatever the exit status
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    echo "== $name (timeout ${limit} s): $*" | tee "$OUT/$name.txt"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.txt"
    rc=$?
    [ "$rc" -eq 124 ] && echo "== $name: TIMED OUT after $limit s" | tee -a "$OUT/$name.txt"
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt"
    printf '%-17s exit %3d  %4d s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$OUT/summary.txt"
}

setup() {
    echo "--- python, torch, CUDA"
    "$PY" -c "import sys, torch; print(sys.version.split()[0], sys.executable); \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', \
torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
    echo "--- host memory, cores"
    grep -E 'MemTotal|MemAvailable' /proc/meminfo; nproc
    echo "--- packages"
    "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|ray|nvidia-ml-py|psutil|pytest|pytest-timeout|setuptools|numpy) '
    if (cd / && PYTHONPATH= "$PY" -c "import raytrain_guard" 2>/dev/null); then
        echo "--- raytrain_guard already installed: no install"
    else
        echo "--- pip install -e . (no index, no deps: nothing can be downloaded there)"
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation \
            --disable-pip-version-check -e . || echo "pip install failed: using PYTHONPATH"
    fi
    "$PY" -c "import ray" 2>/dev/null && echo "ray: installed" \
        || echo "ray: not installed (none of these checks imports it)"
    "$PY" -c "import raytrain_guard, pynvml, psutil, pytest, pytest_timeout; \
print('imports ok: raytrain_guard from', raytrain_guard.__file__)"
}

nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm \
    --format=csv >> "$OUT/nvidia_smi.txt" 2>&1
echo "nvidia-smi: exit $? (full output in nvidia_smi.txt)"

export PY
export -f setup
step setup 45 bash -c setup
step pytest_gpu 120 "$PY" -m pytest -q -p no:cacheprovider --timeout 100 -rA \
    tests/test_loader_cuda.py tests/test_cuda_card.py \
    tests/test_probes.py::test_cuda_probe_reads_allocator_counters \
    tests/test_timing.py::test_cuda_events_come_back_a_step_later \
    tests/test_timing.py::test_cuda_events_are_pooled \
    tests/test_monitor.py::test_nvml_probe_reads_every_gpu_when_nvml_exists \
    tests/test_lockstep_gloo.py::test_exchange_on_nccl_runs_beside_it
echo "pytest_gpu: $(grep -E '^[0-9]+ [a-z]+.* in [0-9.]+s' "$OUT/pytest_gpu.txt" | tail -1) \
(expect no skip on the GPU)" >> "$OUT/summary.txt"
step planner_accuracy 120 "$PY" benchmarks/planner_accuracy.py --device cuda --ranks 1
step gate_overhead 120 "$PY" benchmarks/gate_overhead.py --device cuda --blocks 80
step loader_sizing 75 "$PY" benchmarks/loader_sizing.py --device cuda

echo
echo "step              exit  time (files in \$OUT: nvidia_smi.txt summary.txt <step>.txt)"
cat "$OUT/summary.txt"
