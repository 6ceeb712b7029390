// Schedule validator: local completeness and ordering per stage, the weight-version rule, message
// matching per link, and a rendezvous simulation for deadlock freedom (see validator.h).
#include "core/validator.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <sstream>
#include <unordered_map>

#include "core/error.h"

namespace asyncpp::core {

std::string describe_instruction(int stage, size_t index, const Instruction& ins) {
  return "stage " + std::to_string(stage) + ", " + describe_instruction(index, ins);
}

std::string describe_instruction(size_t index, const Instruction& ins) {
  std::ostringstream os;
  os << "instruction #" << index << " " << op_name(ins.op) << " (step " << ins.step;
  if (ins.op != Op::optimizer_step) os << ", mb " << ins.microbatch;
  os << ")";
  return os.str();
}

int peak_inflight(const std::vector<Instruction>& program) {
  int now = 0, peak = 0;
  for (const Instruction& ins : program) {
    if (ins.op == Op::forward) peak = std::max(peak, ++now);
    if (ins.op == Op::backward) --now;
  }
  return peak;
}

namespace {

constexpr size_t kMaxErrors = 100;
constexpr int kNoPos = -1;

bool is_comm(Op op) { return op != Op::forward && op != Op::backward && op != Op::optimizer_step; }

// How `kind` derives a step's version on stage s, for error messages.
std::string version_rule(ScheduleKind kind, int s) {
  switch (kind) {
    case ScheduleKind::two_bw: return " (max(step-1, 0))";
    case ScheduleKind::pipedream:
      return " on stage " + std::to_string(s) + " (max(step - (S-1-s), 0))";
    default: return " (= step)";
  }
}

// Most versions alive after any instruction, and the first instruction index where that many are
// alive (-1: before the first instruction). Intervals are accumulated in a difference array.
// Only forwards and backwards use weights; a send/recv's version just labels its data (a receive
// may be posted before the optimizer step creating its forward's version).
std::pair<int, int> versions_alive_peak(const std::vector<Instruction>& program) {
  const int n = static_cast<int>(program.size());
  std::map<int, int> created{{0, -1}};  // version -> index of the instruction creating it
  std::map<int, int> last_use;
  std::vector<int> optimizer_positions;
  for (int i = 0; i < n; ++i) {
    const Instruction& ins = program[i];
    if (ins.op == Op::optimizer_step) {
      created.emplace(ins.version, i);
      optimizer_positions.push_back(i);
    } else if (!is_comm(ins.op)) {
      last_use[ins.version] = i;
    }
  }
  std::vector<int> diff(n + 2, 0);  // slot p counts "alive after instruction p-1"
  for (auto [v, c] : created) {
    // Alive until superseded by the next created version, or until its last use if later.
    auto next = std::upper_bound(optimizer_positions.begin(), optimizer_positions.end(), c);
    const int superseded = next == optimizer_positions.end() ? n : *next;
    auto lu = last_use.find(v);
    const int last_alive = std::max(superseded, lu == last_use.end() ? -1 : lu->second) - 1;
    if (last_alive < c) continue;
    ++diff[c + 1];
    --diff[std::min(last_alive, n - 1) + 2];
  }
  int now = 0, best = 0, where = -1;
  for (int p = 0; p <= n; ++p) {
    now += diff[p];
    if (now > best) best = now, where = p - 1;
  }
  return {best, where};
}

// Positions of each per-microbatch instruction kind on one stage, indexed by step*m + mb.
struct StageIndex {
  std::vector<int> pos[6];  // recv_act, forward, send_act, recv_grad, backward, send_grad
  std::vector<int> optimizer_pos;  // per step: first optimizer_step of that step
};

class Validator {
 public:
  explicit Validator(const Schedule& s) : sched_(s) {}

  ValidationReport run() {
    if (!check_header()) return finish();
    const int S = sched_.stages;
    index_.resize(S);
    for (int s = 0; s < S; ++s) scan_stage(s);
    for (int s = 0; s < S; ++s) check_microbatches(s);
    for (int s = 0; s < S; ++s) check_optimizer_and_versions(s);
    for (int s = 0; s + 1 < S; ++s) {
      check_link(s, Op::send_act, s + 1, Op::recv_act);
      check_link(s + 1, Op::send_grad, s, Op::recv_grad);
    }
    // The rendezvous simulation is only meaningful once everything else is consistent (every
    // message has a well-formed partner); problems found above already explain a hang.
    if (errors_.empty()) simulate_rendezvous();
    return finish();
  }

 private:
  const Schedule& sched_;
  std::vector<std::string> errors_;
  std::vector<StageIndex> index_;

  template <typename... Args>
  void error(const Args&... args) {
    errors_.push_back(detail::concat(args...));
  }
  const Instruction& at(int s, int i) const { return sched_.programs[s][i]; }
  std::string where(int s, int i) const { return describe_instruction(s, i, at(s, i)); }
  int64_t key(int step, int mb) const { return int64_t{step} * sched_.microbatches + mb; }

  ValidationReport finish() {
    ValidationReport r;
    r.ok = errors_.empty();
    if (errors_.size() > kMaxErrors) {
      const size_t more = errors_.size() - kMaxErrors;
      errors_.resize(kMaxErrors);
      errors_.push_back(detail::concat("... and ", more, " more problems"));
    }
    r.errors = std::move(errors_);
    return r;
  }

  bool check_header() {
    const Schedule& s = sched_;
    if (s.stages < 1 || s.microbatches < 1 || s.steps < 1)
      error("schedule header: stages, microbatches and steps must all be >= 1 (got S=", s.stages,
            ", m=", s.microbatches, ", K=", s.steps, ")");
    else if (int64_t{s.stages} * s.microbatches * s.steps > kMaxScheduleWork)
      error("schedule header: stages*microbatches*steps exceeds ", kMaxScheduleWork);
    else if (static_cast<int64_t>(s.programs.size()) != s.stages)
      error("schedule header: ", s.programs.size(), " programs for ", s.stages,
            " stages; give exactly one program per stage");
    else if (s.kind == ScheduleKind::pipedream && s.microbatches != 1)
      error("schedule header: pipedream runs one microbatch per optimizer step (got m=",
            s.microbatches, "); set microbatches to 1");
    return errors_.empty();
  }

  // Field ranges, neighbour fields, the version rule and duplicates; records positions.
  void scan_stage(int s) {
    const int S = sched_.stages, m = sched_.microbatches, K = sched_.steps;
    StageIndex& idx = index_[s];
    for (auto& p : idx.pos) p.assign(static_cast<size_t>(int64_t{m} * K), kNoPos);
    idx.optimizer_pos.assign(K, kNoPos);
    const auto& prog = sched_.programs[s];
    for (int i = 0; i < static_cast<int>(prog.size()); ++i) {
      const Instruction& ins = prog[i];
      if (ins.step < 0 || ins.step >= K) {
        error(where(s, i), ": step out of range (steps are 0..", K - 1, ")");
        continue;
      }
      if (ins.op == Op::optimizer_step) {
        if (ins.microbatch != -1)
          error(where(s, i), ": an optimizer_step names no microbatch; set microbatch to -1");
        if (ins.version != ins.step + 1)
          error(where(s, i), ": creates version ", ins.version, " but the optimizer step of step ",
                ins.step, " must create version ", ins.step + 1);
        if (idx.optimizer_pos[ins.step] == kNoPos) idx.optimizer_pos[ins.step] = i;
        continue;
      }
      if (ins.microbatch < 0 || ins.microbatch >= m) {
        error(where(s, i), ": microbatch out of range (microbatches are 0..", m - 1, ")");
        continue;
      }
      check_peer(s, i, S);
      const int expected = version_for(sched_.kind, ins.step, s, S);
      if (ins.version != expected)
        error(where(s, i), ": uses weight version ", ins.version, " but ",
              schedule_kind_name(sched_.kind), " step ", ins.step, " must use version ", expected,
              version_rule(sched_.kind, s));
      int& slot = idx.pos[static_cast<int>(ins.op)][key(ins.step, ins.microbatch)];
      if (slot != kNoPos)
        error(where(s, i), ": duplicate; the same ", op_name(ins.op), " is already instruction #",
              slot);
      else
        slot = i;
    }
  }

  void check_peer(int s, int i, int S) {
    const Instruction& ins = at(s, i);
    const bool upstream = ins.op == Op::recv_act || ins.op == Op::send_grad;
    const bool downstream = ins.op == Op::send_act || ins.op == Op::recv_grad;
    if (upstream && s == 0)
      error(where(s, i), ": stage 0 has no upstream stage (it reads the batch); remove it");
    else if (downstream && s == S - 1)
      error(where(s, i), ": the last stage has no downstream stage (it computes the loss); remove it");
    else if (upstream && ins.peer != s - 1)
      error(where(s, i), ": peer is ", ins.peer, " but must be ", s - 1, " (the upstream stage)");
    else if (downstream && ins.peer != s + 1)
      error(where(s, i), ": peer is ", ins.peer, " but must be ", s + 1, " (the downstream stage)");
    else if (!upstream && !downstream && ins.peer != -1)
      error(where(s, i), ": a compute instruction has no peer; set peer to -1");
  }

  // Every (step, mb) runs forward and backward once, with the messages around them in place.
  void check_microbatches(int s) {
    const int S = sched_.stages, m = sched_.microbatches, K = sched_.steps;
    const StageIndex& idx = index_[s];
    auto pos = [&](Op op, int64_t g) { return idx.pos[static_cast<int>(op)][g]; };
    for (int t = 0; t < K; ++t) {
      for (int mb = 0; mb < m; ++mb) {
        const int64_t g = key(t, mb);
        const int f = pos(Op::forward, g), b = pos(Op::backward, g);
        if (f == kNoPos) error("stage ", s, ", (step ", t, ", mb ", mb, "): no forward instruction");
        if (b == kNoPos) error("stage ", s, ", (step ", t, ", mb ", mb, "): no backward instruction");
        if (f != kNoPos && b != kNoPos) {
          if (b < f) error(where(s, b), ": runs before its forward (instruction #", f, ")");
          if (at(s, b).version != at(s, f).version)
            error(where(s, b), ": uses version ", at(s, b).version, " but its forward (instruction #",
                  f, ") used version ", at(s, f).version,
                  "; a microbatch's backward must use its forward's weights");
        }
        if (s > 0) {
          require_before(s, pos(Op::recv_act, g), f, "recv_act", "its input from stage " +
                         std::to_string(s - 1));
          require_after(s, pos(Op::send_grad, g), b, "send_grad", "input gradient to stage " +
                        std::to_string(s - 1));
        }
        if (s < S - 1) {
          require_after(s, pos(Op::send_act, g), f, "send_act", "output to stage " +
                        std::to_string(s + 1));
          require_before(s, pos(Op::recv_grad, g), b, "recv_grad", "output gradient from stage " +
                         std::to_string(s + 1));
        }
      }
    }
  }

  // A receive `recv` that must precede the compute instruction `compute`.
  void require_before(int s, int recv, int compute, const char* recv_op, const std::string& what) {
    if (compute == kNoPos) return;
    if (recv == kNoPos)
      error(where(s, compute), ": no ", recv_op, " for its ", what);
    else if (recv > compute)
      error(where(s, recv), ": comes after the instruction that needs it (#", compute, ")");
  }
  // A send `send` that must follow the compute instruction `compute` producing its data.
  void require_after(int s, int send, int compute, const char* send_op, const std::string& what) {
    if (compute == kNoPos) return;
    if (send == kNoPos)
      error(where(s, compute), ": its ", what, " is never sent (no ", send_op, ")");
    else if (send < compute)
      error(where(s, send), ": comes before the instruction producing its data (#", compute, ")");
  }

  void check_optimizer_and_versions(int s) {
    const int m = sched_.microbatches, K = sched_.steps;
    const StageIndex& idx = index_[s];
    const auto& prog = sched_.programs[s];
    int expected_step = 0;
    for (int i = 0; i < static_cast<int>(prog.size()); ++i) {
      if (prog[i].op != Op::optimizer_step) continue;
      if (prog[i].step != expected_step)
        error(where(s, i), ": optimizer steps must run once per step in order; expected step ",
              expected_step, " here");
      ++expected_step;
    }
    const auto& bwd = idx.pos[static_cast<int>(Op::backward)];
    for (int t = 0; t < K; ++t) {
      const int o = idx.optimizer_pos[t];
      if (o == kNoPos) {
        error("stage ", s, ": no optimizer_step for step ", t, "; add one after its last backward");
        continue;
      }
      for (int mb = 0; mb < m; ++mb) {
        const int b = bwd[key(t, mb)];
        if (b != kNoPos && b > o)
          error(where(s, o), ": runs before the backward of (step ", t, ", mb ", mb,
                ") at instruction #", b, "; it must follow every backward of its step");
        const int next = t + 1 < K ? bwd[key(t + 1, mb)] : kNoPos;
        if (next != kNoPos && next < o)
          error(where(s, next), ": runs before the optimizer step of step ", t,
                " (instruction #", o, "); gradients of two steps would mix");
      }
    }
    // Weights must exist before a forward or backward uses them (a send/recv touches none).
    for (int i = 0; i < static_cast<int>(prog.size()); ++i) {
      const Instruction& ins = prog[i];
      if (ins.op == Op::optimizer_step || is_comm(ins.op) || ins.version < 1 || ins.version > K)
        continue;
      const int o = idx.optimizer_pos[ins.version - 1];
      if (o != kNoPos && o > i)
        error(where(s, i), ": uses version ", ins.version, " before it exists (the optimizer step",
              " of step ", ins.version - 1, " creating it is instruction #", o, ")");
    }
    const int limit = versions_alive_limit(sched_.kind, s, sched_.stages);
    auto [peak, at_index] = versions_alive_peak(prog);
    if (peak > limit)
      error(at_index < 0 ? "stage " + std::to_string(s) + ", at start" : where(s, at_index), ": ",
            peak, " weight versions alive after it; ", schedule_kind_name(sched_.kind),
            " keeps at most ", limit,
            sched_.kind == ScheduleKind::pipedream ? " (S-s) on this stage" : "");
  }

  // Messages from `from` to `to`: every send has one receive and both ends use the same order.
  void check_link(int from, Op send_op, int to, Op recv_op) {
    auto collect = [&](int s, Op op) {
      std::vector<int> out;
      const auto& prog = sched_.programs[s];
      for (int i = 0; i < static_cast<int>(prog.size()); ++i) {
        const Instruction& ins = prog[i];
        if (ins.op == op && ins.step >= 0 && ins.step < sched_.steps && ins.microbatch >= 0 &&
            ins.microbatch < sched_.microbatches)
          out.push_back(i);
      }
      return out;
    };
    const std::vector<int> sends = collect(from, send_op), recvs = collect(to, recv_op);
    std::unordered_map<int64_t, int> send_by_key, recv_by_key;
    for (int i : sends) send_by_key.emplace(key(at(from, i).step, at(from, i).microbatch), i);
    for (int i : recvs) recv_by_key.emplace(key(at(to, i).step, at(to, i).microbatch), i);
    bool unmatched = false;
    for (int i : sends)
      if (!recv_by_key.count(key(at(from, i).step, at(from, i).microbatch)))
        unmatched = true, error(where(from, i), ": no matching ", op_name(recv_op), " on stage ", to);
    for (int i : recvs)
      if (!send_by_key.count(key(at(to, i).step, at(to, i).microbatch)))
        unmatched = true, error(where(to, i), ": no matching ", op_name(send_op), " on stage ", from);
    if (unmatched || sends.size() != recvs.size()) return;
    for (size_t k = 0; k < sends.size(); ++k) {
      const Instruction &snd = at(from, sends[k]), &rcv = at(to, recvs[k]);
      if (snd.step != rcv.step || snd.microbatch != rcv.microbatch) {
        error(where(from, sends[k]), ": out of order: it is ", op_name(send_op), " #", k,
              " to stage ", to, " but stage ", to, "'s ", op_name(recv_op), " #", k,
              " (instruction #", recvs[k], ") expects (step ", rcv.step, ", mb ", rcv.microbatch,
              "); both ends must handle messages in the same order");
        return;  // later mismatches follow from this one
      }
      // Each end carries its own stage's version (they differ across stages in pipedream); the
      // two must be off their stage's rule by the same amount (equal for stage-free rules).
      const int snd_rule = version_for(sched_.kind, snd.step, from, sched_.stages);
      const int rcv_rule = version_for(sched_.kind, rcv.step, to, sched_.stages);
      if (snd.version - snd_rule != rcv.version - rcv_rule) {
        if (snd_rule == rcv_rule)
          error(where(to, recvs[k]), ": version ", rcv.version, " differs from version ",
                snd.version, " of the matching ", op_name(send_op), " (stage ", from,
                ", instruction #", sends[k], ")");
        else
          error(where(to, recvs[k]), ": version ", rcv.version, " does not match version ",
                snd.version, " of the matching ", op_name(send_op), " (stage ", from,
                ", instruction #", sends[k], "): this step runs on version ", rcv_rule,
                " here and ", snd_rule, " there");
      }
    }
  }

  // Runs all stages with sends that block until the receive is posted (and vice versa).
  void simulate_rendezvous() {
    const int S = sched_.stages;
    std::vector<size_t> pc(S, 0);
    auto partner = [](Op op) {
      switch (op) {
        case Op::send_act: return Op::recv_act;
        case Op::recv_act: return Op::send_act;
        case Op::send_grad: return Op::recv_grad;
        case Op::recv_grad: return Op::send_grad;
        default: return op;
      }
    };
    auto done = [&](int s) { return pc[s] >= sched_.programs[s].size(); };
    bool progress = true;
    while (progress) {
      progress = false;
      for (int s = 0; s < S; ++s) {
        const auto& prog = sched_.programs[s];
        while (!done(s)) {
          const Instruction& ins = prog[pc[s]];
          if (!is_comm(ins.op)) {
            ++pc[s], progress = true;
            continue;
          }
          const int p = ins.peer;
          if (done(p)) break;
          const Instruction& other = sched_.programs[p][pc[p]];
          if (other.op != partner(ins.op) || other.peer != s || other.step != ins.step ||
              other.microbatch != ins.microbatch)
            break;
          ++pc[s], ++pc[p], progress = true;
        }
      }
    }
    for (int s = 0; s < S; ++s) {
      if (done(s)) continue;
      const int i = static_cast<int>(pc[s]);
      const int p = at(s, i).peer;
      if (done(p))
        error(where(s, i), ": deadlock with blocking send/recv: stage ", p,
              " has already finished its program");
      else
        error(where(s, i), ": deadlock with blocking send/recv: stage ", p, " is blocked at ",
              describe_instruction(pc[p], at(p, static_cast<int>(pc[p]))));
    }
  }
};

}  // namespace

int max_versions_alive(const std::vector<Instruction>& program) {
  return versions_alive_peak(program).first;
}

ValidationReport validate(const Schedule& sched) { return Validator(sched).run(); }

}  // namespace asyncpp::core
