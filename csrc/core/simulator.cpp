// Discrete-event schedule simulator (see simulator.h).
#include "core/simulator.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "core/error.h"
#include "core/validator.h"

namespace asyncpp::core {

namespace {

constexpr double kUnknown = std::numeric_limits<double>::quiet_NaN();

void check_costs(const std::vector<double>& v, const char* name, int S) {
  ASYNCPP_ARG_CHECK(static_cast<int>(v.size()) == S, name, " cost needs one value per stage (", S,
                    " values, got ", v.size(), "): pass a scalar or a list of length ", S);
  for (size_t s = 0; s < v.size(); ++s)
    ASYNCPP_ARG_CHECK(std::isfinite(v[s]) && v[s] >= 0, name, " cost of stage ", s, " is ", v[s],
                      ": costs must be finite and >= 0");
}

}  // namespace

SimResult simulate(const Schedule& sched, const SimCosts& costs) {
  const ValidationReport report = validate(sched);
  if (!report.ok) {
    std::string all;
    for (const std::string& e : report.errors) all += "\n  " + e;
    ASYNCPP_ARG_CHECK(false, "cannot simulate an invalid schedule:", all);
  }
  const int S = sched.stages;
  check_costs(costs.forward, "forward", S);
  check_costs(costs.backward, "backward", S);
  check_costs(costs.optimizer, "optimizer", S);
  ASYNCPP_ARG_CHECK(std::isfinite(costs.p2p_latency) && costs.p2p_latency >= 0, "p2p latency is ",
                    costs.p2p_latency, ": it must be finite and >= 0");

  const int64_t n_mb = int64_t{sched.microbatches} * sched.steps;
  auto key = [&](const Instruction& ins) { return int64_t{ins.step} * sched.microbatches + ins.microbatch; };
  // Send times per sending stage (activations go to s+1, gradients to s-1) and receive post times
  // per receiving stage, indexed by (step, microbatch).
  std::vector<std::vector<double>> act_sent(S, std::vector<double>(n_mb, kUnknown)),
      grad_sent(S, std::vector<double>(n_mb, kUnknown)),
      act_posted(S, std::vector<double>(n_mb, kUnknown)),
      grad_posted(S, std::vector<double>(n_mb, kUnknown));

  SimResult r;
  r.busy.assign(S, 0.0);
  std::vector<double> clock(S, 0.0);
  std::vector<size_t> pc(S, 0);
  std::vector<std::vector<TimelineEntry>> per_stage(S);

  // Time the data a compute instruction consumes is available, or NaN if the sender has not
  // reached its send yet.
  auto input_ready = [&](int s, const Instruction& ins) -> double {
    const int64_t g = key(ins);
    double posted = 0.0, sent = 0.0;
    if (ins.op == Op::forward && s > 0)
      posted = act_posted[s][g], sent = act_sent[s - 1][g];
    else if (ins.op == Op::backward && s < S - 1)
      posted = grad_posted[s][g], sent = grad_sent[s + 1][g];
    else
      return 0.0;
    if (std::isnan(sent)) return kUnknown;
    return std::max(posted, sent + costs.p2p_latency);
  };

  bool progress = true;
  while (progress) {
    progress = false;
    for (int s = 0; s < S; ++s) {
      const auto& prog = sched.programs[s];
      while (pc[s] < prog.size()) {
        const Instruction& ins = prog[pc[s]];
        double cost = 0.0;
        switch (ins.op) {
          case Op::send_act: act_sent[s][key(ins)] = clock[s]; break;
          case Op::send_grad: grad_sent[s][key(ins)] = clock[s]; break;
          case Op::recv_act: act_posted[s][key(ins)] = clock[s]; break;
          case Op::recv_grad: grad_posted[s][key(ins)] = clock[s]; break;
          case Op::forward: cost = costs.forward[s]; break;
          case Op::backward: cost = costs.backward[s]; break;
          case Op::optimizer_step: cost = costs.optimizer[s]; break;
        }
        if (ins.op == Op::forward || ins.op == Op::backward || ins.op == Op::optimizer_step) {
          const double ready = input_ready(s, ins);
          if (std::isnan(ready)) break;  // the sender has not got there yet
          const double start = std::max(clock[s], ready);
          clock[s] = start + cost;
          r.busy[s] += cost;
          per_stage[s].push_back({s, ins.op, ins.step, ins.microbatch, ins.version, start, clock[s]});
        }
        ++pc[s];
        progress = true;
      }
    }
  }
  for (int s = 0; s < S; ++s)
    ASYNCPP_CHECK(pc[s] == sched.programs[s].size(), "simulation stuck at ",
                  describe_instruction(s, pc[s], sched.programs[s][pc[s]]),
                  " although the schedule validated; please report this schedule");

  for (int s = 0; s < S; ++s) r.makespan = std::max(r.makespan, clock[s]);
  double total_busy = 0.0;
  for (int s = 0; s < S; ++s) {
    r.idle.push_back(r.makespan - r.busy[s]);
    total_busy += r.busy[s];
    r.peak_inflight.push_back(peak_inflight(sched.programs[s]));
    r.max_versions.push_back(max_versions_alive(sched.programs[s]));
    r.timeline.insert(r.timeline.end(), per_stage[s].begin(), per_stage[s].end());
  }
  r.bubble_fraction = r.makespan > 0 ? 1.0 - total_busy / (S * r.makespan) : 0.0;
  return r;
}

}  // namespace asyncpp::core
