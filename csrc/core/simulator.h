// Discrete-event simulation of a schedule under given per-stage compute costs.
//
// The model follows the runtime executor: sends never block the sender (they complete when
// issued), receives are posted at their place in the program and complete at
// max(post time, matching send's time + p2p latency), and a stage waits only when a compute
// instruction needs data that has not arrived. Compute instructions take their cost.
#pragma once
#include <vector>

#include "core/schedule.h"

namespace asyncpp::core {

struct SimCosts {
  std::vector<double> forward;    // per stage, length S
  std::vector<double> backward;   // per stage, length S
  std::vector<double> optimizer;  // per stage, length S (may be all zero)
  double p2p_latency = 0.0;       // added to every message
};

struct TimelineEntry {
  int stage;
  Op op;  // forward, backward or optimizer_step
  int step;
  int microbatch;  // -1 for optimizer_step
  int version;
  double start;
  double end;
};

struct SimResult {
  double makespan = 0.0;
  std::vector<double> busy;  // per stage: time spent in compute instructions
  std::vector<double> idle;  // per stage: makespan - busy
  double bubble_fraction = 0.0;  // 1 - sum(busy) / (S * makespan); 0 when makespan is 0
  std::vector<int> peak_inflight;  // per stage: most forwards done minus backwards done
  std::vector<int> max_versions;   // per stage: most weight versions alive at once
  std::vector<TimelineEntry> timeline;  // every compute instruction, in program order per stage
};

// Validates the schedule first (ArgumentError listing the problems if it is invalid) and the
// costs (ArgumentError for a wrong length, a negative or non-finite value).
SimResult simulate(const Schedule& sched, const SimCosts& costs);

}  // namespace asyncpp::core
