#!/usr/bin/env bash
# The GPU measurements docs/gpu.md lists under "The next GPU run", as named steps, each with its
# own time limit, its output in OUT/<step>.log and the bench's numbers in OUT/<step>.json (written
# after every row), so that a machine lent for a few minutes keeps whatever it measured.
#
#   bench/gpu_runbook.sh [STEP ...]     default: build 135m tests p2p (about 10 minutes on one H100,
#                                       in the order of what they tell; a machine lent for less keeps
#                                       the steps and rows that finished)
#   OUT=dir bench/gpu_runbook.sh 360m quick
#
# Steps:
#   build   the extension for this GPU (TORCH_CUDA_ARCH_LIST, default 9.0), then asyncpp_ext.info
#   tests   cuda-marked tests of the paths not yet run on a GPU: CUDA-graph capture, ipc vs gloo
#           with two ranks on one GPU, one device wait per step, the gradient accumulate kernel,
#           flash attention with in-place grouped-query heads, compiled blocks and regions
#   135m    bench/gpu_throughput.py at smollm-135m / 1024, profiled: ours and its variants (graphs,
#           no-copies, stage-compile; bf16-params and graphs with stage-compile are left to the 360m
#           step), 2bw on one GPU over ipc (with and without graphs), the compiled Hugging Face model
#   p2p     bench/p2p.py --backend ipc-cuda: the ipc transport against gloo through the host
#   360m    ours (plain, graphs, bf16-params, stage-compile with and without graphs) and the
#           compiled Hugging Face model at smollm-360m / 2048, not profiled
#   quick   bench/gpu_throughput.py --quick, timed (its target: under 3 minutes)
#   cudnn   the attention kernel at 360m: TORCH_CUDNN_SDPA_PREFERRED=1, then =0, profiled
#   head    the fused head alone against plain, at the default and 2x / 4x chunks, profiled
#   autotune  ours at 360m with --compile-mode max-autotune against the default mode (its compile
#           benchmarks kernel configurations: minutes)
# PYTHON picks the interpreter (default python3). A step that fails or runs out of time is noted
# and the next one runs; the exit status is the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_runbook}
mkdir -p "$OUT"
failed=0

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s): $*" | tee -a "$OUT/steps.txt"
    local start=$SECONDS
    timeout --kill-after=20 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc $rc after $((SECONDS - start)) s" | tee -a "$OUT/steps.txt"
    tail -n 30 "$OUT/$name.log" | tee -a "$OUT/steps.txt"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

bench() {  # bench NAME SECONDS [ENV=VALUE ...] -- ARGS...: gpu_throughput.py, its JSON beside the log
    local name=$1 limit=$2
    shift 2
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    step "$name" "$limit" env "${envs[@]}" "$PY" bench/gpu_throughput.py --json "$OUT/$name.json" "$@"
}

ROWS_135M=(--models smollm-135m --seq-lens 1024 --skip "eager,bf16-params,graphs stage-compile,max-autotune"
           --only "ours sync adamw,ours 2bw 2st 1gpu adamw ipc,hf compile adamw")
ONLY_OURS=(--models smollm-360m --seq-lens 2048 --only "ours sync adamw"
           --skip "eager,no-copies,graphs,bf16-params,stage-compile" --profile)

run_step() {
    case $1 in
        build) step build 240 env TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" \
                   "$PY" -m pip install -q --disable-pip-version-check --no-index --no-build-isolation --no-deps -e .
               step info 60 "$PY" -m asyncpp_ext.info ;;
        tests) step tests 240 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_graphs.py \
                   tests/test_ipc_transport.py tests/test_stage_host.py tests/test_compute_copies.py \
                   tests/test_stage_compute.py tests/test_compile.py ;;
        135m) bench 135m 400 -- "${ROWS_135M[@]}" --profile ;;
        p2p) step p2p 90 "$PY" bench/p2p.py --backend ipc-cuda ;;
        360m) bench 360m 480 -- --models smollm-360m --seq-lens 2048 --skip "eager,no-copies,max-autotune" \
                  --only "ours sync adamw,hf compile adamw" ;;
        quick) bench quick 300 -- --quick ;;
        cudnn) bench cudnn-1 240 TORCH_CUDNN_SDPA_PREFERRED=1 -- "${ONLY_OURS[@]}"
               bench cudnn-0 240 TORCH_CUDNN_SDPA_PREFERRED=0 -- "${ONLY_OURS[@]}" ;;
        head) bench head 150 -- --only head --profile --head-chunk-rows 1365,2730 ;;
        autotune) bench autotune 540 -- --models smollm-360m --seq-lens 2048 --only "ours sync adamw" \
                      --skip "eager,no-copies,graphs,bf16-params,stage-compile" ;;
        *) echo "unknown step $1: choose build, tests, 135m, p2p, 360m, quick, cudnn, head, autotune" \
               | tee -a "$OUT/steps.txt"
           failed=$((failed + 1)) ;;
    esac
}

[ $# -gt 0 ] || set -- build 135m tests p2p
for s in "$@"; do
    run_step "$s"
done
echo "== $failed step(s) failed; logs and JSON in $OUT" | tee -a "$OUT/steps.txt"
exit "$failed"
