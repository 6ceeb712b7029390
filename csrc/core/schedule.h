// Pipeline schedules as per-stage instruction streams (torch-free).
//
// A schedule covers K steps (minibatches) of m microbatches on S stages. Stage s runs
// programs[s] in order. Microbatches are named by (step, microbatch); every compute instruction
// carries the weight version it runs with:
//   sync (gpipe, 1f1b): step t runs on version t, and OPTIMIZER_STEP at the end of step t (after
//                       a flush) produces version t+1.
//   2bw:                step t runs on version max(t-1, 0); OPTIMIZER_STEP for step t comes right
//                       after the stage's last BACKWARD of step t (no flush: step t+1's forwards
//                       may already be in flight) and produces version t+1 from the gradient of
//                       step t. At most two versions are alive per stage. Requires m >= S.
// Stage 0 has no RECV_ACT/SEND_GRAD (it reads the batch); stage S-1 has no SEND_ACT/RECV_GRAD
// (it computes the loss).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace asyncpp::core {

enum class ScheduleKind : uint8_t { gpipe, one_f_one_b, two_bw };

enum class Op : uint8_t {
  recv_act,        // receive the forward activation of (step, microbatch) from stage s-1
  forward,         // run the stage forward of (step, microbatch) with weights `version`
  send_act,        // send that forward's output to stage s+1
  recv_grad,       // receive d(loss)/d(output) of (step, microbatch) from stage s+1
  backward,        // run the stage backward of (step, microbatch) with weights `version`
  send_grad,       // send d(loss)/d(input) to stage s-1
  optimizer_step,  // apply step `step`'s accumulated gradient; creates weight version `version`
};

struct Instruction {
  Op op;
  int32_t step;        // minibatch index t, 0..K-1
  int32_t microbatch;  // 0..m-1; -1 for optimizer_step
  int32_t version;     // weights used (compute/send/recv) or produced (optimizer_step)
  int32_t peer;        // neighbour stage for send/recv; -1 otherwise
};

struct Schedule {
  ScheduleKind kind;
  int stages;
  int microbatches;
  int steps;
  std::vector<std::vector<Instruction>> programs;  // programs[s] is stage s's stream
};

// Parses "gpipe" | "1f1b" | "2bw"; throws ArgumentError naming the valid choices otherwise.
ScheduleKind parse_schedule_kind(const std::string& name);
const char* schedule_kind_name(ScheduleKind kind);
const char* op_name(Op op);

// The weight version step `step` runs with: sync -> step, 2bw -> max(step - 1, 0).
int version_for_step(ScheduleKind kind, int step);

// Largest stages*microbatches*steps a schedule may have (bounds the memory of build and validate).
constexpr long long kMaxScheduleWork = 2'000'000;

// Throws ArgumentError for S < 1, m < 1, K < 1, 2bw with m < S, or more than kMaxScheduleWork
// (stage, microbatch, step) triples (message says why and the fix).
Schedule build_schedule(ScheduleKind kind, int stages, int microbatches, int steps);

}  // namespace asyncpp::core
