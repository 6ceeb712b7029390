#include "core/progress.h"

namespace asyncpp::core {

void Progress::begin(const Instruction& ins, int64_t now_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  state_.running = true;
  state_.current = ins;
  since_ns_ = now_ns;
}

void Progress::end(const Instruction& ins) {
  std::lock_guard<std::mutex> lock(mu_);
  state_.running = false;
  state_.has_last = true;
  state_.last_done = ins;
  ++state_.completed;
}

Progress::Snapshot Progress::snapshot(int64_t now_ns) const {
  std::lock_guard<std::mutex> lock(mu_);
  Snapshot out = state_;
  out.current_for_s = state_.running ? static_cast<double>(now_ns - since_ns_) * 1e-9 : 0.0;
  return out;
}

}  // namespace asyncpp::core
