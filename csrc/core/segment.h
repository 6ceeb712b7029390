// A run is executed as segments of consecutive steps (a segment ends where every stage must be
// quiet: an evaluation, a checkpoint, the end of training). Inside a segment 2bw streams with no
// drain; across segments the weight-version rule continues unchanged because versions are a
// function of the global step (and of the stage, for pipedream). The host therefore keeps, across
// a boundary at step T, the versions the next segment starts on: 2bw's W(T-1), and on pipedream's
// stage s the versions max(T-(S-1-s), 0) .. T (its first S-s forwards run on them).
#pragma once
#include <vector>

#include "core/schedule.h"

namespace asyncpp::core {

// Stage `stage`'s program for global steps [first_step, first_step + steps).
std::vector<Instruction> segment_program(ScheduleKind kind, int stages, int microbatches, int steps,
                                         int stage, int first_step);

}  // namespace asyncpp::core
