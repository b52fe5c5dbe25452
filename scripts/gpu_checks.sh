#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one go: the GPU tests, then the benchmarks' GPU runs (docs/benchmarks.md,
# "On one GPU"). Each step has its own time limit and a failed step does not stop the next.
#
#     bash scripts/gpu_checks.sh [OUT_DIR]      # logs to OUT_DIR/gpu.log, each benchmark's JSON line to results.jsonl
#     ONLY="env pytest_gpu" bash scripts/gpu_checks.sh   # only the named steps
#
# Needs the project's dependencies importable (pip install -e '.[dev]', or PYTHONPATH) and one visible GPU: where
# torch sees none, no step but env runs (one error line; the summary's "error" says so; exit status 1).
# The last line of output is one JSON object: {"out", "results", "rc": {step: exit status}, "failed": [steps]};
# the exit status is 1 when a step failed.
set -u
case "${1:-}" in
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "gpu_checks.sh: unknown option $1 (usage: bash scripts/gpu_checks.sh [OUT_DIR]; --help)" >&2; exit 2 ;;
esac
out=${1:-outputs/gpu_checks}
mkdir -p "$out"
log="$out/gpu.log"
results="$out/results.jsonl"
: >"$log"
: >"$results"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 LIT_DTRAIN_CACHE=${LIT_DTRAIN_CACHE:-/tmp/lit_dtrain_cache}
py=${PYTHON:-python3}
statuses=()  # NAME=RC of every step run

step() {  # step NAME SECONDS CMD...: run CMD with a time limit, log it, keep its last JSON line
    local name=$1 limit=$2
    shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
    if [ "$name" != env ] && [ -z "${cuda_checked:-}" ]; then  # once, before the first step that needs the GPU
        cuda_checked=1
        "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" >/dev/null 2>&1 || \
            no_cuda="$py's torch sees no CUDA device (or cannot be imported); run this on a GPU machine"
        [ -n "${no_cuda:-}" ] && echo "gpu_checks.sh: error: $no_cuda; no GPU step was run" | tee -a "$log" >&2
    fi
    if [ -n "${no_cuda:-}" ] && [ "$name" != env ]; then return; fi
    echo "=== $name: $* (limit ${limit}s) $(date -u +%T)" | tee -a "$log"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$out/step.log" 2>&1
    local rc=$?
    cat "$out/step.log" >>"$log"
    tail -n 40 "$out/step.log"
    local json
    json=$(grep -E '^\{.*\}$' "$out/step.log" | tail -n 1)
    [ -n "$json" ] && echo "{\"step\": \"$name\", \"rc\": $rc, \"result\": $json}" >>"$results"
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$log"
    statuses+=("$name=$rc")
    rm -f "$out/step.log"
}

step env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $py -c \"import torch, \
lightning, hydra, bitsandbytes; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), \
'lightning', lightning.__version__, 'bitsandbytes', bitsandbytes.__version__)\""
step pytest_gpu 240 "$py" -m pytest -q tests/gpu tests/unit/test_configs_*.py -p no:cacheprovider --timeout 200 -rfE \
    --durations 15
# FourierSampler per-step overhead (issue #5's <= 3 %) on the benchmark's tiny model and on two larger ones,
# with lag 0 (the brief's) and lag 1 (observe does not wait for the GPU)
step fourier_overhead_tiny 120 "$py" scripts/bench_fourier.py --device cuda --variants uniform --seeds 0 --steps 2 \
    --eval-every 2 --block-sizes 256 --timing-steps 30 --timing-rounds 5
step fourier_overhead_d512 160 "$py" scripts/bench_fourier.py --device cuda --variants uniform --seeds 0 --steps 2 \
    --eval-every 2 --block-sizes 256 --timing-steps 20 --timing-rounds 5 --d-model 512 --n-layer 8 --n-head 8 \
    --n-kv-head 4 --tokens-per-step 16384
step fourier_overhead_d768 180 "$py" scripts/bench_fourier.py --device cuda --variants uniform --seeds 0 --steps 2 \
    --eval-every 2 --block-sizes 256 --timing-steps 10 --timing-rounds 5 --d-model 768 --n-layer 12 --n-head 12 \
    --n-kv-head 4 --tokens-per-step 32768
step actckpt 120 "$py" scripts/bench_activation_ckpt.py --device cuda --tokens 16384 --shapes small,deep --seqs 2048 \
    --repeats 3 --plot "$out/actckpt_memory_vs_time_cuda.png"
step actckpt_bf16 120 "$py" scripts/bench_activation_ckpt.py --device cuda --dtype bf16 --tokens 16384 \
    --shapes small,deep --seqs 2048 --repeats 3 --plot "$out/actckpt_memory_vs_time_cuda_bf16.png"
step bench_step_nano 90 "$py" scripts/bench_step.py --steps 40 --rounds 3 trainer=gpu
step bench_step_125m 120 "$py" scripts/bench_step.py --steps 30 --rounds 2 trainer=gpu model=llama_125m
step train_default_gpu 120 "$py" train.py trainer=gpu run_name=gpu_default
step train_compiled_gpu 150 "$py" train.py trainer=gpu module.compile=true run_name=gpu_compiled

# the summary line (json.dumps: any OUT_DIR is quoted correctly); "error" when no GPU step could run
GPU_CHECKS_ERROR=${no_cuda:-} "$py" - "$out" "$results" "${statuses[@]}" <<'EOF'
import json
import os
import sys

out, results, *statuses = sys.argv[1:]
rc = {name: int(code) for name, _, code in (s.rpartition("=") for s in statuses)}
summary = {"out": out, "results": results, "rc": rc, "failed": [name for name, code in rc.items() if code]}
error = os.environ.get("GPU_CHECKS_ERROR")
print(json.dumps({**summary, "error": error} if error else summary))
sys.exit(1 if any(rc.values()) or error else 0)
EOF
