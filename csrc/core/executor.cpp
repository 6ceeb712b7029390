#include "core/executor.h"

#include <chrono>

#include "core/error.h"

namespace asyncpp::core {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool is_recv(Op op) { return op == Op::recv_act || op == Op::recv_grad; }
int recv_kind(Op op) { return op == Op::recv_act ? 0 : 1; }

MessageKey key_of(const Instruction& ins) {
  MessageKind kind = (ins.op == Op::recv_act || ins.op == Op::send_act) ? MessageKind::activation
                                                                       : MessageKind::gradient;
  return MessageKey{kind, ins.step, ins.microbatch, ins.peer};
}

}  // namespace

std::string describe(const MessageKey& key, bool is_send) {
  return detail::concat(is_send ? "send " : "recv ",
                        key.kind == MessageKind::activation ? "activation" : "gradient",
                        " (step ", key.step, ", microbatch ", key.microbatch, ") ",
                        is_send ? "to" : "from", " stage ", key.peer);
}

Executor::Executor(int stage, std::vector<Instruction> program, StageHost& host,
                   Transport& transport, ExecutorOptions options)
    : stage_(stage),
      program_(std::move(program)),
      host_(host),
      transport_(transport),
      options_(options),
      recv_request_(program_.size(), -1) {
  ASYNCPP_ARG_CHECK(options_.recv_ahead >= 1, "recv_ahead must be >= 1 (got ", options_.recv_ahead, ")");
  ASYNCPP_ARG_CHECK(options_.max_inflight_sends >= 1, "max_inflight_sends must be >= 1 (got ",
                    options_.max_inflight_sends, ")");
  ASYNCPP_ARG_CHECK(options_.timeout_s > 0, "timeout_s must be > 0 (got ", options_.timeout_s, ")");
  trace_.reserve(program_.size());
}

std::string Executor::where(size_t index) const {
  const Instruction& ins = program_[index];
  std::string last = "none yet";
  if (last_completed_ >= 0) {
    const Instruction& l = program_[last_completed_];
    last = detail::concat("#", last_completed_, " ", op_name(l.op), " (step ", l.step, ", microbatch ",
                          l.microbatch, ")");
  }
  return detail::concat("stage ", stage_, ", instruction #", index, " ", op_name(ins.op), " (step ",
                        ins.step, ", microbatch ", ins.microbatch, "); last completed: ", last);
}

void Executor::post_receives_up_to(size_t limit_index) {
  for (int kind = 0; kind < 2; ++kind) {
    size_t& scan = next_recv_scan_[kind];
    while (posted_unused_[kind] < options_.recv_ahead && scan < program_.size() && scan <= limit_index) {
      const Instruction& ins = program_[scan];
      if (is_recv(ins.op) && recv_kind(ins.op) == kind) {
        recv_request_[scan] = transport_.post_recv(key_of(ins));
        ++posted_unused_[kind];
      }
      ++scan;
    }
  }
}

void Executor::execute(size_t index) {
  const Instruction& ins = program_[index];
  switch (ins.op) {
    case Op::recv_act:
    case Op::recv_grad: {
      ASYNCPP_CHECK(recv_request_[index] >= 0, "receive was not posted before use at ", where(index));
      try {
        transport_.wait(recv_request_[index], options_.timeout_s);
      } catch (const Error& e) {  // C++ transports; Python errors pass through unchanged
        throw Error(detail::concat(e.what(), " -- while waiting to ", describe(key_of(ins), false),
                                   " at ", where(index)));
      }
      --posted_unused_[recv_kind(ins.op)];
      break;
    }
    case Op::send_act:
    case Op::send_grad: {
      inflight_sends_.emplace_back(index, transport_.post_send(key_of(ins)));
      while (static_cast<int>(inflight_sends_.size()) > options_.max_inflight_sends) {
        auto [send_index, request] = inflight_sends_.front();
        try {
          transport_.wait(request, options_.timeout_s);
        } catch (const Error& e) {  // C++ transports; Python errors pass through unchanged
          throw Error(detail::concat(e.what(), " -- while waiting for ",
                                     describe(key_of(program_[send_index]), true), " at ", where(index)));
        }
        inflight_sends_.erase(inflight_sends_.begin());
      }
      break;
    }
    case Op::forward:
      host_.forward(ins.step, ins.microbatch, ins.version);
      break;
    case Op::backward:
      host_.backward(ins.step, ins.microbatch, ins.version);
      break;
    case Op::optimizer_step:
      host_.optimizer_step(ins.step, ins.version);
      break;
  }
}

void Executor::run() {
  // Receives are posted as far ahead as the buffer budget allows, at every instruction boundary.
  for (size_t index = 0; index < program_.size(); ++index) {
    post_receives_up_to(program_.size());
    const Instruction& ins = program_[index];
    TraceEvent ev{static_cast<int32_t>(index), ins.op, ins.step, ins.microbatch, ins.version, now_ns(), 0};
    if (options_.progress) options_.progress->begin(ins, ev.start_ns);
    execute(index);
    ev.end_ns = now_ns();
    if (options_.progress) options_.progress->end(ins);
    trace_.push_back(ev);
    last_completed_ = static_cast<long>(index);
    // Retire finished sends in order so their buffers can be released early.
    while (!inflight_sends_.empty() && transport_.test(inflight_sends_.front().second))
      inflight_sends_.erase(inflight_sends_.begin());
  }
  for (auto& [send_index, request] : inflight_sends_) {
    try {
      transport_.wait(request, options_.timeout_s);
    } catch (const Error& e) {  // C++ transports; Python errors pass through unchanged
      throw Error(detail::concat(e.what(), " -- while draining sends at the end of stage ", stage_,
                                 "'s program: ", describe(key_of(program_[send_index]), true)));
    }
  }
  inflight_sends_.clear();
}

}  // namespace asyncpp::core
