// Shared by the runtime and NCCL bindings: run one stage's program with a Python stage host and
// any C++ transport (buffers from the host's MessageBoard), with the GIL released while the
// executor runs.
#pragma once
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/message_board.h"
#include "core/executor.h"
#include "core/transport.h"

namespace asyncpp::bindings {

// Executes stage `stage`'s program for global steps [first_step, first_step+steps) and returns
// the trace as a list of (op, step, microbatch, version, start_ns, end_ns). Defined in
// runtime_bindings.cpp.
pybind11::list run_stage_program(const std::string& schedule, int stages, int microbatches, int steps, int stage,
                                 int first_step, pybind11::object host, MessageBoard& board, core::Transport& transport,
                                 const core::ExecutorOptions& options);

// The executor options of a run_stage call; `progress` is None or a Progress the watchdog reads
// (it must outlive the call: the Python caller holds it).
core::ExecutorOptions executor_options(int recv_ahead, int max_inflight_sends, double timeout_s,
                                       const pybind11::object& progress);

}  // namespace asyncpp::bindings
