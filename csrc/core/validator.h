// Checks that a schedule is complete, consistent between neighbours, deadlock-free under blocking
// (rendezvous) send/recv, and honours the weight-version rule of its kind (see schedule.h).
#pragma once
#include <string>
#include <vector>

#include "core/schedule.h"

namespace asyncpp::core {

struct ValidationReport {
  bool ok = true;
  // One line per problem, naming the stage, the instruction (op and index in the stage's program)
  // and the microbatch, e.g. "stage 2, instruction #17 send_act (step 0, mb 3): no matching
  // recv_act on stage 3".
  std::vector<std::string> errors;
};

// Never throws for a malformed schedule; every problem found is listed in the report.
ValidationReport validate(const Schedule& sched);

// "stage 2, instruction #17 send_act (step 0, mb 3)" (no microbatch for optimizer_step).
std::string describe_instruction(int stage, size_t index, const Instruction& ins);
// "instruction #17 send_act (step 0, mb 3)".
std::string describe_instruction(size_t index, const Instruction& ins);

// Most microbatches whose forward ran but whose backward has not yet, over the program.
int peak_inflight(const std::vector<Instruction>& program);

// Most weight versions alive at once on one stage. Version 0 exists from the start; version v+1
// is created by an optimizer_step. A version stays alive while a later forward or backward of the
// program still uses it (a send/recv's version only labels its data), and the newest version is
// always alive (the next optimizer step updates it).
int max_versions_alive(const std::vector<Instruction>& program);

}  // namespace asyncpp::core
