#!/usr/bin/env bash
# GPU check for gefen-kernels, one command (run on a machine with a CUDA GPU):
#   bash tools/device_check.sh [OUT_DIR]
# 1. the Triton parity tests, compiled on CUDA (the same tests run under TRITON_INTERPRET=1 on CPU);
# 2. the fused modes through Gefen and the CPU parity (sanity on that machine);
# 3. the step benchmark on the GPU (`gefen bench step --device cuda`: table, JSON, plot) on the
#    default 23.6M decoder, on the demo's model (issue 17's demo figure) and on a 554M one
#    (bandwidth-bound), and GefenMuon's fp8
#    Newton-Schulz check (`gefen bench muon --device-check`).
# Results go to OUT_DIR (default: $OUT/device-check or ./device-check), and into one
# OUT_DIR.tar.gz beside it (or $GEFEN_DEVICE_CHECK_ARCHIVE; rewritten after every stage, so a run cut short keeps what
# finished). Paste the tables into docs/benchmarks.md.
# The interpreter is $GEFEN_PYTHON, else `uv run python` where uv is installed, else python3
# (a machine with torch and triton but no uv: install the packages' wheels first, e.g.
#  `pip install --no-deps --target /tmp/site dist/*.whl && export PYTHONPATH=/tmp/site`).
# GEFEN_DEVICE_CHECK_STAGE_TIMEOUT bounds each stage (seconds, default 900).
# GEFEN_DEVICE_CHECK_QUALITY=1 runs the quality protocol on the GPU instead (`gefen bench quality
# --device cuda`, docs/benchmarks.md "The protocol on a GPU"): char-mini and word-small with 8 seeds,
# then word-medium with 3, every arm of the protocol (torchao installed for adamw-4bit).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:+$OUT/device-check}}"
out="${out:-device-check}"
mkdir -p "$out"
if [ -n "${GEFEN_PYTHON:-}" ]; then
    read -r -a py <<< "$GEFEN_PYTHON"
elif command -v uv > /dev/null; then
    py=(uv run python)
else
    py=(python3)
fi
limit="${GEFEN_DEVICE_CHECK_STAGE_TIMEOUT:-900}"
stage() { timeout "$limit" "${py[@]}" "$@"; }
archive="${GEFEN_DEVICE_CHECK_ARCHIVE:-$out.tar.gz}"
pack() { tar -czf "$archive" -C "$(dirname "$out")" "$(basename "$out")"; }
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
status=0
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
stage -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee "$out/versions.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
pack
if [ "${GEFEN_DEVICE_CHECK_QUALITY:-0}" = 1 ]; then
    arms=adamw,gefen,adamw-4bit,muon-adamw,gefen-muon-hybrid
    workers=$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))
    for run in "char-mini 8" "word-small 8" "word-medium 3"; do
        set -- $run
        stage -m gefen bench quality --tasks "$1" --seeds "$2" --device cuda --workers "$workers" \
            --optimizers "$arms" --out "$out/quality_$1" > "$out/quality_$1.txt" 2>&1
        [ $? -eq 0 ] || status=1
        pack
    done
    echo "device quality run finished with status $status; results in $out" | tee "$out/status.txt"
    pack
    exit "$status"
fi
stage -m pytest -q -p no:randomly tests/test_kernels_triton_parity.py tests/test_kernels_signatures.py 2>&1 | tee "$out/parity_gpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
pack
stage -m gefen bench step --device cuda --threads 2 --out "$out/bench_step_cuda" 2>&1 | tee "$out/bench_step_cuda.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
pack
stage -m gefen bench step --device cuda --threads 2 --model demo --out "$out/bench_step_cuda_demo" 2>&1 \
    | tee "$out/bench_step_cuda_demo.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
pack
stage -m gefen bench step --device cuda --threads 2 --d-model 2048 --layers 8 --vocab 32768 --repeats 11 \
    --out "$out/bench_step_cuda_554m" 2>&1 | tee "$out/bench_step_cuda_554m.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
pack
stage -m gefen bench muon --device-check --out "$out/muon_fp8" 2>&1 | tee "$out/muon_fp8.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
pack
stage -m pytest -q -p no:randomly tests/test_kernels_fused_modes.py tests/test_kernels_cpu_parity.py -x 2>&1 | tail -3 | tee "$out/parity_cpu.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
pack
echo "device check finished with status $status; results in $out" | tee "$out/status.txt"
pack
exit "$status"
