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
# The control daemon gets pipe and log directories of its own (CUDA_MPS_PIPE_DIRECTORY and
# CUDA_MPS_LOG_DIRECTORY, exported to COMMAND): only COMMAND's processes are its clients, every
# other process on the machine runs as before. It is stopped when COMMAND ends, and when this
# script is stopped (SIGTERM or SIGINT: COMMAND gets SIGTERM and up to 3 s to end first). The
# daemon starts the MPS server at the first client's connection, and a client that cannot
# connect runs without MPS, silently; so after COMMAND the daemon is asked whether a server ran.
# Exit status: COMMAND's, except
#   3  MPS is not available here (no nvidia-cuda-mps-control, or its daemon does not start):
#      one line says which, COMMAND is not run;
#   4  COMMAND succeeded but no MPS server ran: its processes did not run under MPS.
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: bench/with_mps.sh COMMAND [ARG ...]" >&2; exit 2; }
if ! command -v nvidia-cuda-mps-control > /dev/null 2>&1; then
    echo "with_mps.sh: nvidia-cuda-mps-control is not on PATH: CUDA MPS is not available here" >&2
    exit 3
fi
CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) && CUDA_MPS_LOG_DIRECTORY=$(mktemp -d) || exit 3
export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY

child=
daemon=
stop_daemon() {
    [ -n "$daemon" ] && echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
    rm -rf "$CUDA_MPS_PIPE_DIRECTORY"
}
on_signal() {  # $1: the exit status; pass the signal on, give COMMAND 3 s, then stop the daemon
    if [ -n "$child" ]; then
        kill -TERM "$child" 2> /dev/null
        for _ in $(seq 30); do kill -0 "$child" 2> /dev/null || break; sleep 0.1; done
        kill -KILL "$child" 2> /dev/null
    fi
    stop_daemon
    exit "$1"
}
# Before the daemon starts, so that a signal at any point stops it (the caller's timeout may
# follow with SIGKILL a few seconds later, which nothing can catch).
trap 'on_signal 143' TERM
trap 'on_signal 130' INT

daemon=1  # before the start: a signal held until it returns must still stop it ("quit" to none is harmless)
if ! nvidia-cuda-mps-control -d; then
    echo "with_mps.sh: the MPS control daemon did not start (log: $CUDA_MPS_LOG_DIRECTORY)" >&2
    rm -rf "$CUDA_MPS_PIPE_DIRECTORY"
    exit 3
fi
echo "with_mps.sh: MPS control daemon started (pipe directory $CUDA_MPS_PIPE_DIRECTORY)" >&2

# In the background so that a signal is handled at once (bash defers traps while a foreground
# command runs).
"$@" &
child=$!
wait "$child"
rc=$?
child=
servers=$(echo get_server_list | nvidia-cuda-mps-control 2> /dev/null)
stop_daemon
if ! [[ $servers =~ ^[[:space:]]*[0-9][0-9[:space:]]*$ ]]; then  # server PIDs, nothing else
    echo "with_mps.sh: no MPS server ran: the command's processes did not run under MPS" >&2
    [ "$rc" -eq 0 ] && rc=4
else
    echo "with_mps.sh: MPS server(s) $(echo $servers) served the command" >&2
    rm -rf "$CUDA_MPS_LOG_DIRECTORY"
fi
exit "$rc"
