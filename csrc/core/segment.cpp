#include "core/segment.h"

#include "core/error.h"

namespace asyncpp::core {

std::vector<Instruction> segment_program(ScheduleKind kind, int stages, int microbatches, int steps,
                                         int stage, int first_step) {
  ASYNCPP_ARG_CHECK(stage >= 0 && stage < stages, "stage ", stage, " is out of range for ", stages,
                    " stages");
  ASYNCPP_ARG_CHECK(first_step >= 0, "first_step must be >= 0 (got ", first_step, ")");
  Schedule schedule = build_schedule(kind, stages, microbatches, steps);
  std::vector<Instruction> program = std::move(schedule.programs[stage]);
  for (Instruction& ins : program) {
    ins.step += first_step;
    ins.version = ins.op == Op::optimizer_step ? ins.step + 1
                                               : version_for(kind, ins.step, stage, stages);
  }
  return program;
}

}  // namespace asyncpp::core
