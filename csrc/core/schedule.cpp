// Builds the per-stage instruction streams of GPipe, 1F1B (PipeDream-Flush), PipeDream-2BW and the
// original PipeDream (weight stashing).
//
// Construction is two-phase. First each stage gets its compute order (FORWARD / BACKWARD /
// OPTIMIZER_STEP). Then communication is woven in, stage 0 first: a stage places its downstream
// messages (SEND_ACT after a forward, RECV_GRAD right before a backward) by its own compute order,
// which fixes the message order on the link to its successor; the successor then places its
// upstream messages (RECV_ACT, SEND_GRAD) in exactly that link order. Both ends of every link
// therefore see the same sequence of messages, and on a line of stages that alone rules out
// deadlock even when every send blocks until its receive is posted: a cycle of waiting stages
// would have to be two neighbours waiting on one link, and equal link sequences make their next
// messages the same message.
#include "core/schedule.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace asyncpp::core {

const std::vector<ScheduleTraits>& schedule_table() {
  static const std::vector<ScheduleTraits> table = {
      {ScheduleKind::gpipe, "gpipe", "all forwards, then all backwards, then a flush: no weight delay"},
      {ScheduleKind::one_f_one_b, "1f1b",
       "one forward / one backward after S-s-1 warm-up forwards, flush per step: no weight delay"},
      {ScheduleKind::two_bw, "2bw",
       "PipeDream-2BW: 1F1B with no flush, every stage one step behind; needs microbatches >= stages"},
      {ScheduleKind::pipedream, "pipedream",
       "PipeDream with weight stashing: one microbatch per step, stage s S-1-s steps behind"},
  };
  return table;
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  std::string names;
  for (const ScheduleTraits& row : schedule_table()) {
    if (name == row.name) return row.kind;
    names += (names.empty() ? "" : ", ") + std::string(row.name);
  }
  ASYNCPP_ARG_CHECK(false, "unknown schedule '", name, "': choose one of ", names);
  return ScheduleKind::gpipe;  // unreachable
}

const char* schedule_kind_name(ScheduleKind kind) {
  for (const ScheduleTraits& row : schedule_table())
    if (row.kind == kind) return row.name;
  return "unknown";
}

const char* op_name(Op op) {
  switch (op) {
    case Op::recv_act: return "recv_act";
    case Op::forward: return "forward";
    case Op::send_act: return "send_act";
    case Op::recv_grad: return "recv_grad";
    case Op::backward: return "backward";
    case Op::send_grad: return "send_grad";
    case Op::optimizer_step: return "optimizer_step";
  }
  return "unknown";
}

int stage_lag(ScheduleKind kind, int stage, int stages) {
  ASYNCPP_ARG_CHECK(stages >= 1 && stage >= 0 && stage < stages, "stage ", stage,
                    " is out of range for ", stages, " stages: pass a stage in 0..stages-1");
  switch (kind) {
    case ScheduleKind::gpipe:
    case ScheduleKind::one_f_one_b: return 0;
    case ScheduleKind::two_bw: return 1;
    // Between stage s's forward and backward of a step, S-1-s later forwards run, each after
    // one more optimizer step: the backward's stashed weights are that many versions old.
    case ScheduleKind::pipedream: return stages - 1 - stage;
  }
  return 0;
}

int version_for(ScheduleKind kind, int step, int stage, int stages) {
  return std::max(step - stage_lag(kind, stage, stages), 0);
}

int version_for_step(ScheduleKind kind, int step) {
  ASYNCPP_ARG_CHECK(kind != ScheduleKind::pipedream, "pipedream's weight version depends on the "
                    "stage: use version_for(kind, step, stage, stages)");
  return version_for(kind, step, 0, 1);
}

// The versions a stage's instructions can still need: its lag's worth of older ones plus the
// newest, which the optimizer step writes while they are in use.
int versions_alive_limit(ScheduleKind kind, int stage, int stages) {
  return stage_lag(kind, stage, stages) + 1;
}

void check_schedule_shape(ScheduleKind kind, int stages, int microbatches) {
  const int S = stages, m = microbatches;
  ASYNCPP_ARG_CHECK(S >= 1, "stages must be >= 1 (got S=", S, "): use at least one stage");
  ASYNCPP_ARG_CHECK(m >= 1, "microbatches must be >= 1 (got m=", m,
                    "): split each minibatch into at least one microbatch");
  // 2bw keeps two versions only if a stage's last backward of step t comes before its first
  // forward of step t+2, i.e. at most m in-flight microbatches span S stages.
  ASYNCPP_ARG_CHECK(kind != ScheduleKind::two_bw || m >= S, "2bw needs microbatches >= stages (got m=",
                    m, ", S=", S, "): raise --microbatches to at least ", S);
  ASYNCPP_ARG_CHECK(kind != ScheduleKind::pipedream || m == 1,
                    "pipedream runs one microbatch per optimizer step (got m=", m,
                    "): use --microbatches 1");
}

namespace {

struct ComputeItem {
  Op op;  // forward, backward or optimizer_step
  int step;
  int microbatch;  // -1 for optimizer_step
};

// One message on the link between stage s and s+1, in the order both ends handle it.
struct LinkMessage {
  bool is_activation;  // true: activation s -> s+1; false: gradient s+1 -> s
  int step;
  int microbatch;
};

// 1F1B over `order` (microbatches in global order): `warmup` forwards, then alternate one
// forward / one backward, then drain the remaining backwards. `after_backward(i)` lets the caller
// insert optimizer steps right after the backward of order[i].
template <typename AfterBackward>
void one_f_one_b(const std::vector<std::pair<int, int>>& order, int warmup,
                 std::vector<ComputeItem>& out, AfterBackward after_backward) {
  const int n = static_cast<int>(order.size());
  warmup = std::min(warmup, n);
  int next_fwd = 0, next_bwd = 0;
  auto fwd = [&] {
    out.push_back({Op::forward, order[next_fwd].first, order[next_fwd].second});
    ++next_fwd;
  };
  auto bwd = [&] {
    out.push_back({Op::backward, order[next_bwd].first, order[next_bwd].second});
    after_backward(next_bwd);
    ++next_bwd;
  };
  while (next_fwd < warmup) fwd();
  while (next_fwd < n) {
    fwd();
    bwd();
  }
  while (next_bwd < n) bwd();
}

std::vector<ComputeItem> compute_order(ScheduleKind kind, int S, int m, int K, int s) {
  std::vector<ComputeItem> out;
  const int warmup = S - s - 1;  // forwards stage s runs before its first backward (1F1B, 2BW)
  if (kind == ScheduleKind::two_bw || kind == ScheduleKind::pipedream) {
    // One continuous 1F1B stream over all K*m microbatches: no flush between steps (pipedream is
    // this stream with m = 1; only its version rule differs).
    std::vector<std::pair<int, int>> order;
    for (int t = 0; t < K; ++t)
      for (int i = 0; i < m; ++i) order.emplace_back(t, i);
    one_f_one_b(order, warmup, out, [&](int idx) {
      if (order[idx].second == m - 1) out.push_back({Op::optimizer_step, order[idx].first, -1});
    });
    return out;
  }
  for (int t = 0; t < K; ++t) {
    std::vector<std::pair<int, int>> order;
    for (int i = 0; i < m; ++i) order.emplace_back(t, i);
    if (kind == ScheduleKind::gpipe) {
      for (auto [st, i] : order) out.push_back({Op::forward, st, i});
      for (auto [st, i] : order) out.push_back({Op::backward, st, i});
    } else {
      one_f_one_b(order, warmup, out, [](int) {});
    }
    out.push_back({Op::optimizer_step, t, -1});  // after the flush of step t
  }
  return out;
}

}  // namespace

Schedule build_schedule(ScheduleKind kind, int stages, int microbatches, int steps) {
  const int S = stages, m = microbatches, K = steps;
  check_schedule_shape(kind, S, m);
  ASYNCPP_ARG_CHECK(K >= 1, "steps must be >= 1 (got K=", K, "): schedule at least one step");
  // About 4 instructions per stage and microbatch; refuse sizes that would exhaust memory.
  const int64_t work = int64_t{S} * m * K;
  ASYNCPP_ARG_CHECK(work <= kMaxScheduleWork, "schedule too large (stages*microbatches*steps = ", work,
                    " > ", kMaxScheduleWork, "): use fewer steps or microbatches");

  Schedule sched{kind, S, m, K, std::vector<std::vector<Instruction>>(S)};
  const int64_t n_mb = int64_t{m} * K;
  auto global = [m](int step, int mb) { return int64_t{step} * m + mb; };

  std::vector<LinkMessage> upstream_link;  // link (s-1, s) in its fixed order
  for (int s = 0; s < S; ++s) {
    std::vector<Instruction>& prog = sched.programs[s];
    std::vector<LinkMessage> downstream_link;
    std::vector<char> backward_done(n_mb, 0), upstream_handled_act(n_mb, 0),
        upstream_handled_grad(n_mb, 0);
    size_t next_upstream = 0;

    // Handles upstream messages in link order up to and including the wanted one. A gradient can
    // only be sent once its backward ran; the construction guarantees that, checked here.
    auto handle_upstream_through = [&](bool want_activation, int step, int mb) {
      const int64_t g = global(step, mb);
      std::vector<char>& handled = want_activation ? upstream_handled_act : upstream_handled_grad;
      while (!handled[g]) {
        ASYNCPP_CHECK(next_upstream < upstream_link.size(), "schedule construction: stage ", s,
                      " needs a message from stage ", s - 1, " that the link never carries");
        const LinkMessage msg = upstream_link[next_upstream++];
        const int64_t mg = global(msg.step, msg.microbatch);
        const int v = version_for(kind, msg.step, s, S);
        if (msg.is_activation) {
          prog.push_back({Op::recv_act, msg.step, msg.microbatch, v, s - 1});
          upstream_handled_act[mg] = 1;
        } else {
          ASYNCPP_CHECK(backward_done[mg], "schedule construction: stage ", s,
                        " would send the gradient of (step ", msg.step, ", mb ", msg.microbatch,
                        ") before its backward");
          prog.push_back({Op::send_grad, msg.step, msg.microbatch, v, s - 1});
          upstream_handled_grad[mg] = 1;
        }
      }
    };

    for (const ComputeItem& c : compute_order(kind, S, m, K, s)) {
      if (c.op == Op::optimizer_step) {
        prog.push_back({Op::optimizer_step, c.step, -1, c.step + 1, -1});
        continue;
      }
      const int v = version_for(kind, c.step, s, S);
      if (c.op == Op::forward) {
        if (s > 0) handle_upstream_through(true, c.step, c.microbatch);
        prog.push_back({Op::forward, c.step, c.microbatch, v, -1});
        if (s < S - 1) {
          prog.push_back({Op::send_act, c.step, c.microbatch, v, s + 1});
          downstream_link.push_back({true, c.step, c.microbatch});
        }
      } else {
        if (s < S - 1) {
          prog.push_back({Op::recv_grad, c.step, c.microbatch, v, s + 1});
          downstream_link.push_back({false, c.step, c.microbatch});
        }
        prog.push_back({Op::backward, c.step, c.microbatch, v, -1});
        backward_done[global(c.step, c.microbatch)] = 1;
        // Send the gradient as soon as the link order allows, so the upstream stage is not held.
        if (s > 0) handle_upstream_through(false, c.step, c.microbatch);
      }
    }
    ASYNCPP_CHECK(next_upstream == upstream_link.size(), "schedule construction: stage ", s,
                  " left ", upstream_link.size() - next_upstream, " upstream messages unhandled");
    upstream_link = std::move(downstream_link);
  }
  return sched;
}

}  // namespace asyncpp::core
