#!/usr/bin/env bash
# GPU check for gefen-kernels, one command (run on a machine with a CUDA GPU):
#   bash tools/device_check.sh [OUT_DIR]
# 1. the Triton parity tests, compiled on CUDA (the same tests run under TRITON_INTERPRET=1 on CPU);
# 2. the fused modes through Gefen and the CPU parity (sanity on that machine);
# 3. the step benchmark on the GPU (`gefen bench step --device cuda`: table, JSON, plot) and
#    GefenMuon's fp8 Newton-Schulz check (`gefen bench muon --device-check`).
# Results go to OUT_DIR (default: $OUT or ./device-check); paste the table into the README.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-device-check}}"
mkdir -p "$out"
unset TRITON_INTERPRET
status=0
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
uv run python -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())" \
    | tee "$out/versions.txt" || status=1
uv run pytest -q tests/test_kernels_triton_parity.py tests/test_kernels_signatures.py 2>&1 | tee "$out/parity_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
uv run pytest -q tests/test_kernels_fused_modes.py tests/test_kernels_cpu_parity.py -x 2>&1 | tail -3 | tee "$out/parity_cpu.txt"
uv run gefen bench step --device cuda --threads 2 --out "$out/bench_step_cuda" 2>&1 | tee "$out/bench_step_cuda.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
uv run gefen bench muon --device-check --out "$out/muon_fp8" 2>&1 | tee "$out/muon_fp8.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "device check finished with status $status; results in $out"
exit "$status"
