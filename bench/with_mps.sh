#!/usr/bin/env bash
# Run a command whose CUDA processes share the GPU through a private CUDA MPS server
# (Multi-Process Service): the processes' kernels then run side by side in one GPU context
# instead of taking turns between contexts, which is what pipeline stages sharing one GPU want
# (each stage's kernels are small and its host is the pace; without MPS the GPU switches
# between the processes' contexts).
#
#   bench/with_mps.sh COMMAND [ARG ...]
#   bench/with_mps.sh python bench/gpu_throughput.py --only "ours 2bw 2st 1gpu adamw ipc"
#
# The server gets pipe and log directories of its own (CUDA_MPS_PIPE_DIRECTORY and
# CUDA_MPS_LOG_DIRECTORY, exported to COMMAND): only COMMAND's processes are its clients, every
# other process on the machine runs as before. The server is stopped when COMMAND ends, and when
# this script is stopped (SIGTERM/SIGINT: COMMAND gets the signal first). Exit status: COMMAND's;
# 3 when MPS is not available here (no nvidia-cuda-mps-control, or the server does not start),
# with one line saying which, and COMMAND not run.
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: bench/with_mps.sh COMMAND [ARG ...]" >&2; exit 2; }
if ! command -v nvidia-cuda-mps-control > /dev/null 2>&1; then
    echo "with_mps.sh: nvidia-cuda-mps-control is not on PATH: CUDA MPS is not available here" >&2
    exit 3
fi
CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) && CUDA_MPS_LOG_DIRECTORY=$(mktemp -d) || exit 3
export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
if ! nvidia-cuda-mps-control -d; then
    echo "with_mps.sh: the MPS server did not start (log: $CUDA_MPS_LOG_DIRECTORY)" >&2
    exit 3
fi
echo "with_mps.sh: MPS server started (pipe directory $CUDA_MPS_PIPE_DIRECTORY)" >&2

child=
stop_server() {
    echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
    rm -rf "$CUDA_MPS_PIPE_DIRECTORY"
}
on_signal() {  # pass the signal on, wait for COMMAND to clean up after itself, then stop the server
    [ -n "$child" ] && kill -TERM "$child" 2> /dev/null && wait "$child"
    stop_server
    exit 143
}
trap on_signal TERM INT
# In the background so that a signal is handled at once (bash defers traps while a foreground
# command runs).
"$@" &
child=$!
wait "$child"
rc=$?
child=
stop_server
exit "$rc"
