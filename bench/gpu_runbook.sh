#!/usr/bin/env bash
# The GPU measurements docs/gpu.md lists under "The next GPU run", as named steps, each with its
# own time limit, its output in OUT/<step>.log and the bench's numbers in OUT/<step>.json (written
# after every row), so that a machine lent for a few minutes keeps whatever it measured. A stopped
# step (its time limit, the caller's) takes its running row with it (gpu_throughput.py kills the
# row's process group on SIGTERM), and each row has a time limit below its step's.
#
#   bench/gpu_runbook.sh [STEP ...]     default: build 135m (at most 540 s: one call of a machine lent
#                                       for 10 minutes; the later calls, each <= 570 s, start with
#                                       build again on a fresh machine:
#                                         build 360m | build 360m-more | build blocks head
#                                         build quick code
#                                         build quick-serial | quick (at once, on the warm machine)
#                                         build mps | build profile | build attention pipeline-graphs
#                                         build tests p2p | build autotune | build clip
#                                         build ckpt | build docmask)
#   OUT=dir bench/gpu_runbook.sh build 360m     (OUT, RUNBOOK_PLAN: relative to the repository root)
#
# Steps (limits in seconds; the estimates are from the earlier H200 rows, docs/gpu.md):
#   build   (120 + 30) the extension for this GPU (TORCH_CUDA_ARCH_LIST, default 9.0), then
#           asyncpp_ext.info
#   135m    (390) bench/gpu_throughput.py at smollm-135m / 1024: ours without and with CUDA graphs
#           (on by default for sync on CUDA); the compiled Hugging Face model; 2bw on one GPU over
#           ipc without and with graphs (~5 min)
#   tests   (360) cuda-marked tests of the paths not yet run on a GPU: CUDA-graph capture, ipc vs
#           gloo with two ranks on one GPU, one device wait per step, the gradient accumulate
#           kernel, flash attention with in-place grouped-query heads, --attention cudnn and flash
#           each running its kernel, compiled blocks and regions, the optimizer's step skipped on
#           the device (the scan's flag read by the kernels, the losses read from pinned memory),
#           the metrics' MFU against the GPU's peak, sampling's key/value cache on the GPU
#   p2p     (60) bench/p2p.py --backend ipc-cuda: the ipc transport against gloo through the host
#   360m    (420) ours with graphs (the default), the same with inductor's horizontal fusion (the
#           combo-kernels row: fewer kernels per block, the one block_step form faster than the
#           default on the H100), with the weight gradients added into float32 by their products
#           (grad-accum-fusion: no accumulate kernel after each microbatch), with both, and the
#           compiled Hugging Face model at smollm-360m / 2048, profiled (~5 min; the Hugging Face
#           row 1.7 of them)
#   360m-more (330) ours with graphs (the default) beside programmatic dependent launch (the pdl
#           row: --inductor-option triton.enable_pdl=True, the gaps between the graphs' kernels),
#           pdl with combo-kernels, and the host reading the step's NaN/Inf scan before the
#           optimizer is queued (host-check: what the device-side skip is worth), profiled
#   attention (150) bench/attention_kernels.py: the attention kernel alone at the SmolLM shapes,
#           torch's own choice, --attention flash and cudnn: which runs, its time, its error against
#           a float32 reference; and within documents of 256 tokens, SDPA with the boolean mask
#           against flex_attention compiled with the BlockMask (--attention flex)
#   blocks  (200) bench/block_step.py: one smollm-360m block, forward + backward, compiled in each of
#           the bench's forms (rotary layouts, q/k/v and gate/up products, stacked or concatenated
#           weights, cat lowering, tuning, pdl, the norms' partial sums, the fused weight gradients), kernel time by
#           kind and the costliest kernels, each form's output against the float32 block
#   code    (120) bench/block_step.py's compiled form alone (one smollm-360m block) under
#           TORCH_LOGS=output_code: the code inductor generates for the block's forward and backward
#           in code.log, to read without a GPU (which of the block's ~36 kernels are inductor's, which
#           aten's: the two float32 sums per block the 360m profile shows among them)
#   pipeline-graphs (150) ours with graphs, and 2bw on one GPU over ipc with graphs, at smollm-135m
#           / 1024: whether graphs pay for a pipeline sharing one GPU (on the H100: no, 0.45x)
#   quick   (280) bench/gpu_throughput.py --quick on a cold inductor cache, timed (target: < 3 min;
#           on an H200 162 s, each row's process started while the row before ran: --prestart)
#   quick-serial (280) the same with --no-prestart, the rows' processes one after another: what
#           starting them ahead saves, and whether it slows the compiles it runs beside (in the
#           H200 run the compiled Hugging Face model's first step took 100 s beside the next
#           row's start-up, 83 s in an earlier run without it)
#   head    (120) the fused head alone against plain, at the default chunk (2048 rows), the eager
#           path's 682 and 4096, profiled
#   profile (150) ours with graphs (the default) at 135m / 1024, profiled: kernels per step, device
#           busy share, the costliest kernels by name (360m / 2048 is profiled in the 360m step)
#   autotune  (420) ours at 360m with the CLI's defaults and with --compile-mode max-autotune on top,
#           profiled (on the H100: 0.92x, Triton GEMM templates slower in the step than cuBLAS)
#   mps     (2 x 180) ours and 2bw with two stages on the GPU over ipc at 135m, first as they are
#           (mps-off), then with every process a client of one CUDA MPS server (bench/with_mps.sh):
#           the stages' kernels side by side instead of the GPU switching between the processes'
#           contexts; the same rows on the same machine, one after the other
#   clip    (420) ours with graphs at 360m / 2048 beside the same with --clip-grad-norm 1.0: what
#           clipping costs a step (its per-parameter norms, read in one copy, and the host's check)
#   ckpt    (150) bench/checkpoint_overlap.py on the GPU: a 24 x 1024 GPT checkpointed every 2 steps,
#           written in the loop against in the background (--async-checkpoints, on by default there)
#   docmask (420) ours without graphs at 360m / 2048 beside the same with --document-mask 10 (each
#           line of the built-in corpus a document): what attention within documents costs (SDPA
#           with a boolean mask: no flash kernel; graphs off under the mask), and the same with
#           --attention flex (FlexAttention's block-sparse kernel: other documents' blocks skipped)
# RUNBOOK_PLAN=FILE writes each step (name, limit, command; fields separated by the unit separator
# 0x1f) to FILE instead of running it, and nothing else (tests/test_gpu_runbook.py checks the plan).
# PYTHON picks the interpreter (default python3). A step that fails or runs out of time is noted
# and the next one runs; the exit status is the number of failed steps. An unknown step name stops
# the runbook before any step runs (one line, exit 2, OUT not made).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_runbook}
PLAN=${RUNBOOK_PLAN:-}
STEPS=(build 135m tests p2p 360m 360m-more attention blocks code pipeline-graphs quick quick-serial head profile
       autotune mps ckpt clip docmask)
[ $# -gt 0 ] || set -- build 135m
for s in "$@"; do
    if [[ " ${STEPS[*]} " != *" $s "* ]]; then
        echo "gpu_runbook.sh: unknown step '$s'; choose from ${STEPS[*]}" >&2
        exit 2
    fi
done
if [ -n "$PLAN" ]; then : > "$PLAN"; else mkdir -p "$OUT"; fi
failed=0

note() {  # a line for the caller and, when steps run, for OUT/steps.txt
    if [ -n "$PLAN" ]; then echo "$*"; else echo "$*" | tee -a "$OUT/steps.txt"; fi
}

fresh_dir() {  # an empty directory of its own (an inductor cache no earlier step warmed)
    if [ -n "$PLAN" ]; then echo "<fresh directory>"; else mktemp -d; fi
}

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    if [ -n "$PLAN" ]; then
        (IFS=$'\x1f'; echo "$name"$'\x1f'"$limit"$'\x1f'"$*") >> "$PLAN"
        return
    fi
    echo "== $name (limit ${limit} s): $*" | tee -a "$OUT/steps.txt"
    local start=$SECONDS
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
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

ROWS_135M=(--models smollm-135m --seq-lens 1024 --row-timeout 150
           --only "ours sync adamw,ours 2bw 2st 1gpu adamw ipc,hf compile adamw"
           --skip "clip,eager,no-copies,bf16-params,max-autotune,stage-compile,-attention,cat-fused,combo-kernels,pdl,mix-order,host-check,grad-accum-fusion,doc-mask")
# (combo-kernels left out: a first compile of unknown length before the Hugging Face row, the
# step's reason to be; block_step's combo-kernels form measures it first)
ROWS_360M=(--models smollm-360m --seq-lens 2048 --row-timeout 270 --profile --only "ours sync adamw graphs,hf compile adamw"
           --skip "clip,eager,no-copies,bf16-params,max-autotune,stage-compile,-attention,cat-fused,mix-order,pdl,host-check")
# the launch-side variants, each beside the default row of the same run (ratios side by side)
ROWS_360M_MORE=(--models smollm-360m --seq-lens 2048 --row-timeout 200 --profile --only "ours sync adamw graphs"
                --skip "clip,eager,no-copies,bf16-params,max-autotune,stage-compile,-attention,cat-fused,mix-order,combo-kernels smollm,grad-accum-fusion")
ROWS_PIPELINE_GRAPHS=(--models smollm-135m --seq-lens 1024 --row-timeout 80
                      --only "ours sync adamw graphs,ours 2bw 2st 1gpu adamw ipc graphs"
                      --skip "clip,eager,no-copies,bf16-params,max-autotune,stage-compile,-attention,cat-fused,combo-kernels,pdl,mix-order,host-check,grad-accum-fusion")
# clipping's cost: ours with graphs beside the same clipping at 1.0 (the norms, the host's check)
ROWS_CLIP=(--models smollm-360m --seq-lens 2048 --row-timeout 200 --only "ours sync adamw graphs"
           --skip "eager,no-copies,bf16-params,max-autotune,stage-compile,-attention,cat-fused,combo-kernels,pdl,mix-order,host-check,grad-accum-fusion")
# --document-mask's cost: ours without graphs (refused under the mask) beside the same with the mask,
# by SDPA and by --attention flex
ROWS_DOCMASK=(--models smollm-360m --seq-lens 2048 --row-timeout 200 --only "ours sync adamw"
              --skip "graphs,clip,eager,no-copies,bf16-params,max-autotune,stage-compile,cudnn-attention,flash-attention,cat-fused,combo-kernels,pdl,mix-order,host-check,grad-accum-fusion")
ROWS_MPS=(--models smollm-135m --seq-lens 1024 --row-timeout 80 --only "ours sync adamw,ours 2bw 2st 1gpu adamw ipc"
          --skip "eager,no-copies,bf16-params,max-autotune,stage-compile,graphs,pdl,mix-order,grad-accum-fusion,doc-mask")

run_step() {
    case $1 in
        build) step build 120 env TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" \
                   "$PY" -m pip install -q --disable-pip-version-check --no-index --no-build-isolation --no-deps -e .
               step info 30 "$PY" -m asyncpp_ext.info ;;
        135m) bench 135m 390 -- "${ROWS_135M[@]}" ;;
        # test_cuda_graphs last: its three end-to-end comparisons (4 CLI runs each, two compiled)
        # are the step's longest, and a step cut by its limit then loses only their tail
        tests) step tests 360 "$PY" -m pytest -v -rA --durations=15 -m cuda -p no:cacheprovider \
                   tests/test_ipc_transport.py tests/test_stage_host.py tests/test_compute_copies.py \
                   tests/test_stage_compute.py tests/test_compile_cuda.py tests/test_head_loss.py \
                   tests/test_attention.py tests/test_optim_api.py tests/test_step_boundary.py \
                   tests/test_main_grad.py tests/test_flops.py tests/test_sample.py tests/test_eval.py \
                   tests/test_clipping.py tests/test_z_loss.py tests/test_document_mask.py tests/test_flex_attention.py \
                   tests/test_choice_eval.py tests/test_stream_stop.py tests/test_cuda_graphs.py ;;
        p2p) step p2p 60 "$PY" bench/p2p.py --backend ipc-cuda ;;
        clip) bench clip 420 -- "${ROWS_CLIP[@]}" ;;
        docmask) bench docmask 420 -- "${ROWS_DOCMASK[@]}" ;;
        ckpt) step ckpt 150 "$PY" bench/checkpoint_overlap.py --device cuda --n-embd 1024 --n-layer 24 --seq-len 512 \
                  --steps 12 --repeats 1 --json ;;
        360m) bench 360m 420 -- "${ROWS_360M[@]}" ;;
        360m-more) bench 360m-more 330 -- "${ROWS_360M_MORE[@]}" ;;
        attention) step attention 150 "$PY" bench/attention_kernels.py --documents 256 --json "$OUT/attention.json" ;;
        blocks) step blocks 200 "$PY" bench/block_step.py --json "$OUT/blocks.json" ;;
        code) step code 120 env TORCH_LOGS=output_code "$PY" bench/block_step.py --variants compiled --no-profile \
                  --iters 3 --json "$OUT/code.json" ;;
        pipeline-graphs) bench pipeline-graphs 150 -- "${ROWS_PIPELINE_GRAPHS[@]}" ;;
        quick) bench quick 280 TORCHINDUCTOR_CACHE_DIR="$(fresh_dir)" -- --quick ;;
        quick-serial) bench quick-serial 280 TORCHINDUCTOR_CACHE_DIR="$(fresh_dir)" -- --quick --no-prestart ;;
        head) bench head 120 -- --only head --row-timeout 100 --profile --head-chunk-rows 682,4096 ;;
        profile) bench profile 150 -- --models smollm-135m --seq-lens 1024 --row-timeout 110 --profile \
                     --only "ours sync adamw graphs" --skip "clip,eager,no-copies,bf16-params,max-autotune,stage-compile,-attention,cat-fused,combo-kernels,pdl,mix-order,host-check,grad-accum-fusion" ;;
        autotune) bench autotune 420 -- --models smollm-360m --seq-lens 2048 --row-timeout 330 --profile \
                      --only "ours sync adamw graphs" --skip "clip,eager,no-copies,bf16-params,stage-compile,-attention,cat-fused,combo-kernels,pdl,mix-order,host-check,grad-accum-fusion" ;;
        mps) bench mps-off 180 -- "${ROWS_MPS[@]}"
             step mps 180 bash bench/with_mps.sh "$PY" bench/gpu_throughput.py --json "$OUT/mps.json" "${ROWS_MPS[@]}" ;;
    esac
}

for s in "$@"; do
    run_step "$s"
done
[ -n "$PLAN" ] || echo "== $failed step(s) failed; logs and JSON in $OUT" | tee -a "$OUT/steps.txt"
exit "$failed"
