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
//   pipedream:          original PipeDream (1F1B, no flush, weight stashing), one microbatch per
//                       step (m = 1). Stage s runs step t's forward and backward on version
//                       max(t - d_s, 0) with d_s = S-1-s (stage 0 the stalest, the last stage not
//                       stale at all); OPTIMIZER_STEP(t) right after the stage's backward of step t
//                       creates version t+1. Program order is the 2bw stream with m = 1, so each
//                       forward runs on the newest version and its backward on the stashed one; at
//                       most S-s versions (t-d_s .. t) are alive on stage s.
// Stage 0 has no RECV_ACT/SEND_GRAD (it reads the batch); stage S-1 has no SEND_ACT/RECV_GRAD
// (it computes the loss).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace asyncpp::core {

enum class ScheduleKind : uint8_t { gpipe, one_f_one_b, two_bw, pipedream };

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
  int32_t version;     // weights used (compute/send/recv) or produced (optimizer_step); a
                       // send/recv carries its own stage's version of that step
  int32_t peer;        // neighbour stage for send/recv; -1 otherwise
};

struct Schedule {
  ScheduleKind kind;
  int stages;
  int microbatches;
  int steps;
  std::vector<std::vector<Instruction>> programs;  // programs[s] is stage s's stream
};

// Parses "gpipe" | "1f1b" | "2bw" | "pipedream"; throws ArgumentError naming the valid choices
// otherwise.
ScheduleKind parse_schedule_kind(const std::string& name);
const char* schedule_kind_name(ScheduleKind kind);
const char* op_name(Op op);

// One row per schedule kind, in enum order: the source of the Python schedule table
// (asyncpp_ext/schedule/table.py), which adds nothing but Python-side spellings.
struct ScheduleTraits {
  ScheduleKind kind;
  const char* name;     // as parse_schedule_kind spells it
  const char* summary;  // one line for --help and the docs' table
};
const std::vector<ScheduleTraits>& schedule_table();

// Steps by which stage `stage` of `stages` computes behind the newest weights: 0 for sync, 1 for
// 2bw, stages-1-stage for pipedream. Every version rule below derives from it. Throws
// ArgumentError for stages < 1 or a stage outside 0..stages-1.
int stage_lag(ScheduleKind kind, int stage, int stages);

// The weight version step `step` runs with on stage `stage` of `stages`:
// max(step - stage_lag, 0). Throws ArgumentError as stage_lag.
int version_for(ScheduleKind kind, int step, int stage, int stages);

// The same for the kinds whose version does not depend on the stage (gpipe, 1f1b, 2bw); throws
// ArgumentError for pipedream, whose version needs the stage (use version_for).
int version_for_step(ScheduleKind kind, int step);

// Most weight versions a stage may hold at once: 1 for sync, 2 for 2bw, stages - stage for
// pipedream (the validator's limit).
int versions_alive_limit(ScheduleKind kind, int stage, int stages);

// Largest stages*microbatches*steps a schedule may have (bounds the memory of build and validate).
constexpr long long kMaxScheduleWork = 2'000'000;

// The one check of a schedule's shape: throws ArgumentError for S < 1, m < 1, 2bw with m < S or
// pipedream with m != 1 (the message says why and the fix). build_schedule, the Python table and
// through it the run config, Pipeline and simulator all call it.
void check_schedule_shape(ScheduleKind kind, int stages, int microbatches);

// Throws ArgumentError as check_schedule_shape, for K < 1, or for more than kMaxScheduleWork
// (stage, microbatch, step) triples (message says why and the fix).
Schedule build_schedule(ScheduleKind kind, int stages, int microbatches, int steps);

}  // namespace asyncpp::core
