// Python bindings of the schedule engine: instruction/schedule types, build, validate, simulate.
// Programs cross as Python lists of Instruction (copies), so a test can take
// `sched.programs`, edit the lists and assign them back to hand-break a schedule.
#include <pybind11/stl.h>

#include <sstream>

#include "bindings/bindings.h"
#include "core/schedule.h"
#include "core/simulator.h"
#include "core/validator.h"

namespace py = pybind11;

namespace asyncpp::bindings {

namespace {

std::string instruction_repr(const core::Instruction& ins) {
  std::ostringstream os;
  os << "Instruction(" << core::op_name(ins.op) << ", step=" << ins.step
     << ", microbatch=" << ins.microbatch << ", version=" << ins.version << ", peer=" << ins.peer
     << ")";
  return os.str();
}

py::dict sim_result_to_dict(const core::SimResult& r) {
  py::dict d;
  d["makespan"] = r.makespan;
  d["busy"] = r.busy;
  d["idle"] = r.idle;
  d["bubble_fraction"] = r.bubble_fraction;
  d["peak_inflight"] = r.peak_inflight;
  d["max_versions"] = r.max_versions;
  py::list timeline;
  for (const core::TimelineEntry& e : r.timeline)
    timeline.append(py::make_tuple(e.stage, core::op_name(e.op), e.step, e.microbatch, e.version,
                                   e.start, e.end));
  d["timeline"] = timeline;
  return d;
}

}  // namespace

void bind_schedule(py::module_& m) {
  m.attr("MAX_SCHEDULE_WORK") = core::kMaxScheduleWork;
  using core::Instruction;
  using core::Op;
  using core::Schedule;
  using core::ScheduleKind;

  py::enum_<ScheduleKind>(m, "ScheduleKind", "Pipeline schedule family")
      .value("gpipe", ScheduleKind::gpipe)
      .value("one_f_one_b", ScheduleKind::one_f_one_b)
      .value("two_bw", ScheduleKind::two_bw)
      .value("pipedream", ScheduleKind::pipedream);

  py::enum_<Op>(m, "Op", "Instruction kind of a stage program")
      .value("recv_act", Op::recv_act)
      .value("forward", Op::forward)
      .value("send_act", Op::send_act)
      .value("recv_grad", Op::recv_grad)
      .value("backward", Op::backward)
      .value("send_grad", Op::send_grad)
      .value("optimizer_step", Op::optimizer_step);

  py::class_<Instruction>(m, "Instruction", "One instruction of a stage program")
      .def(py::init([](Op op, int step, int microbatch, int version, int peer) {
             return Instruction{op, step, microbatch, version, peer};
           }),
           py::arg("op"), py::arg("step"), py::arg("microbatch"), py::arg("version"),
           py::arg("peer") = -1)
      .def_readwrite("op", &Instruction::op)
      .def_readwrite("step", &Instruction::step)
      .def_readwrite("microbatch", &Instruction::microbatch)
      .def_readwrite("version", &Instruction::version)
      .def_readwrite("peer", &Instruction::peer)
      .def("__eq__", [](const Instruction& a, const Instruction& b) {
        return a.op == b.op && a.step == b.step && a.microbatch == b.microbatch &&
               a.version == b.version && a.peer == b.peer;
      })
      .def("__repr__", &instruction_repr);

  py::class_<Schedule>(m, "Schedule",
                       "K steps of m microbatches on S stages; programs[s] is stage s's stream")
      .def(py::init([](ScheduleKind kind, int stages, int microbatches, int steps,
                       std::vector<std::vector<Instruction>> programs) {
             return Schedule{kind, stages, microbatches, steps, std::move(programs)};
           }),
           py::arg("kind"), py::arg("stages"), py::arg("microbatches"), py::arg("steps"),
           py::arg("programs"))
      .def_readwrite("kind", &Schedule::kind)
      .def_readwrite("stages", &Schedule::stages)
      .def_readwrite("microbatches", &Schedule::microbatches)
      .def_readwrite("steps", &Schedule::steps)
      .def_property(
          "programs", [](const Schedule& s) { return s.programs; },
          [](Schedule& s, std::vector<std::vector<Instruction>> p) { s.programs = std::move(p); },
          "Per-stage instruction lists (a copy; assign a new list of lists to change them)")
      .def_property_readonly("kind_name",
                             [](const Schedule& s) { return core::schedule_kind_name(s.kind); })
      .def("__copy__", [](const Schedule& s) { return s; })
      .def("__deepcopy__", [](const Schedule& s, py::dict) { return s; }, py::arg("memo"))
      .def("__repr__", [](const Schedule& s) {
        std::ostringstream os;
        os << "Schedule(" << core::schedule_kind_name(s.kind) << ", stages=" << s.stages
           << ", microbatches=" << s.microbatches << ", steps=" << s.steps << ")";
        return os.str();
      });

  m.def("parse_schedule_kind", &core::parse_schedule_kind, py::arg("name"),
        "'gpipe' | '1f1b' | '2bw' | 'pipedream' -> ScheduleKind (ValueError otherwise)");
  m.def("schedule_kind_name", &core::schedule_kind_name, py::arg("kind"));
  m.def("op_name", &core::op_name, py::arg("op"));
  m.def("version_for_step", &core::version_for_step, py::arg("kind"), py::arg("step"),
        "Weight version of step `step` for a stage-independent kind (ValueError for pipedream)");
  m.def("version_for", &core::version_for, py::arg("kind"), py::arg("step"), py::arg("stage"),
        py::arg("stages"), "Weight version stage `stage` of `stages` runs step `step` with");
  m.def("stage_lag", &core::stage_lag, py::arg("kind"), py::arg("stage"), py::arg("stages"),
        "Steps by which stage `stage` of `stages` computes behind the newest weights");
  m.def("check_schedule_shape", &core::check_schedule_shape, py::arg("kind"), py::arg("stages"),
        py::arg("microbatches"), "ValueError naming the fix when (stages, microbatches) cannot run `kind`");
  m.def("schedule_table", [] {
        py::list rows;
        for (const core::ScheduleTraits& row : core::schedule_table())
          rows.append(py::make_tuple(row.kind, row.name, row.summary));
        return rows;
      }, "(kind, name, summary) per schedule the core builds, in enum order");
  m.def("versions_alive_limit", &core::versions_alive_limit, py::arg("kind"), py::arg("stage"),
        py::arg("stages"), "Most weight versions the validator lets stage `stage` hold at once");
  m.def(
      "build_schedule",
      [](const std::string& kind, int stages, int microbatches, int steps) {
        return core::build_schedule(core::parse_schedule_kind(kind), stages, microbatches, steps);
      },
      py::arg("kind"), py::arg("stages"), py::arg("microbatches"), py::arg("steps") = 1,
      "Build a gpipe / 1f1b / 2bw / pipedream schedule (ValueError for bad sizes, with the fix)");
  m.def(
      "validate_schedule",
      [](const Schedule& sched) {
        Schedule copy = sched;  // the caller may mutate `sched` from another thread
        py::gil_scoped_release release;
        return core::validate(copy).errors;
      },
      py::arg("schedule"), "Problems found in the schedule, one line each (empty when valid)");
  m.def(
      "simulate_schedule",
      [](const Schedule& sched, std::vector<double> forward, std::vector<double> backward,
         std::vector<double> optimizer, double p2p_latency) {
        Schedule copy = sched;
        core::SimCosts costs{std::move(forward), std::move(backward), std::move(optimizer),
                             p2p_latency};
        core::SimResult r;
        {
          py::gil_scoped_release release;
          r = core::simulate(copy, costs);
        }
        return sim_result_to_dict(r);
      },
      py::arg("schedule"), py::arg("forward"), py::arg("backward"), py::arg("optimizer"),
      py::arg("p2p_latency") = 0.0,
      "Discrete-event simulation; costs are per-stage lists. Returns a dict (makespan, busy, idle,"
      " bubble_fraction, peak_inflight, max_versions, timeline)");
  m.def("peak_inflight", &core::peak_inflight, py::arg("program"),
        "Most microbatches forwarded but not yet backwarded over one stage program");
  m.def("max_versions_alive", &core::max_versions_alive, py::arg("program"),
        "Most weight versions alive at once over one stage program");
}

}  // namespace asyncpp::bindings
