// The stage executor: interprets one stage's instruction stream (schedule.h).
//
// It posts receives ahead of need (up to `recv_ahead` per message kind, so receive buffers exist
// only for messages about to be used), keeps up to `max_inflight_sends` sends in flight without
// blocking compute, and waits only where an instruction needs data. Compute instructions call
// the StageHost. For 2bw the stream spans every step of a segment with no drain between steps.
// Every instruction's start/end time is recorded so a run can be checked and drawn; a Progress
// shows another thread (the watchdog) the instruction in flight.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/progress.h"
#include "core/schedule.h"
#include "core/transport.h"

namespace asyncpp::core {

class StageHost {
 public:
  virtual ~StageHost() = default;
  virtual void forward(int step, int microbatch, int version) = 0;
  virtual void backward(int step, int microbatch, int version) = 0;
  virtual void optimizer_step(int step, int new_version) = 0;
};

struct ExecutorOptions {
  int recv_ahead = 2;           // receives posted ahead of use, per message kind
  int max_inflight_sends = 8;   // beyond this the oldest send is waited for
  double timeout_s = 300.0;     // a wait longer than this is a hang: fail with a report
  Progress* progress = nullptr; // when set, every instruction's begin and end are recorded there
};

struct TraceEvent {
  int32_t index;       // position in the program
  Op op;
  int32_t step;
  int32_t microbatch;
  int32_t version;
  int64_t start_ns;    // steady clock, same origin for every stage on a machine
  int64_t end_ns;
};

class Executor {
 public:
  Executor(int stage, std::vector<Instruction> program, StageHost& host, Transport& transport,
           ExecutorOptions options);
  // Runs the whole program. On failure throws asyncpp::Error naming the stage, the instruction
  // and (for waits) the message it was waiting for.
  void run();
  const std::vector<TraceEvent>& trace() const { return trace_; }

 private:
  void post_receives_up_to(size_t limit_index);
  void execute(size_t index);
  std::string where(size_t index) const;

  int stage_;
  std::vector<Instruction> program_;
  StageHost& host_;
  Transport& transport_;
  ExecutorOptions options_;
  std::vector<Transport::Request> recv_request_;  // per instruction index; -1 = not posted
  size_t next_recv_scan_[2] = {0, 0};             // next program index to scan, per kind
  int posted_unused_[2] = {0, 0};                 // posted receives not yet consumed, per kind
  std::vector<std::pair<size_t, Transport::Request>> inflight_sends_;
  std::vector<TraceEvent> trace_;
  long last_completed_ = -1;
};

}  // namespace asyncpp::core
