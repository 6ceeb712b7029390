// What a stage executor is doing, readable from another thread while it runs: the watchdog polls
// it instead of being told of every instruction, so watching costs the hot loop two uncontended
// lock/unlock pairs per instruction and no call into Python.
#pragma once
#include <cstdint>
#include <mutex>

#include "core/schedule.h"

namespace asyncpp::core {

class Progress {
 public:
  struct Snapshot {
    int64_t completed = 0;     // instructions finished since this object was made (every run)
    bool running = false;      // an instruction has begun and not yet finished
    Instruction current{};     // valid when running
    double current_for_s = 0;  // how long `current` has been running
    bool has_last = false;
    Instruction last_done{};   // the most recently finished instruction, when has_last
  };

  void begin(const Instruction& ins, int64_t now_ns);
  void end(const Instruction& ins);
  Snapshot snapshot(int64_t now_ns) const;

 private:
  mutable std::mutex mu_;
  Snapshot state_;
  int64_t since_ns_ = 0;
};

}  // namespace asyncpp::core
