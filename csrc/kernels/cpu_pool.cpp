// Worker pool of cpu_pool.h. One job at a time; a job is (fn, ctx, n_items) plus a generation
// number. Items are claimed from one atomic word holding (generation << 32 | next item), so a helper
// that wakes up late, after its job ended, sees a different generation and claims nothing: it never
// touches a finished job's context.
#include "kernels/cpu_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace asyncpp::kernels {
namespace {

int threads_allowed() {
#ifdef _OPENMP
  return std::max(1, omp_get_max_threads());
#else
  return std::max(1u, std::thread::hardware_concurrency());
#endif
}

class Pool {
 public:
  void run(int64_t n_items, ItemFn fn, void* ctx, int helpers) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock()) {  // another thread's call is using the pool: do this one inline
      for (int64_t k = 0; k < n_items; ++k) fn(ctx, k);
      return;
    }
    uint32_t gen;
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (int(threads_.size()) < helpers) {
        const int index = int(threads_.size());
        threads_.emplace_back([this, index] { helper_loop(index); });
        threads_.back().detach();  // the pool lives until exit; nothing joins
      }
      gen = ++generation_;
      fn_ = fn;
      ctx_ = ctx;
      n_items_ = n_items;
      active_helpers_ = helpers;
      finished_.store(0, std::memory_order_relaxed);
      next_.store(uint64_t(gen) << 32, std::memory_order_release);
    }
    wake_.notify_all();
    work(gen, n_items, fn, ctx);
    // Only items some helper has claimed can still be running; they are short (one chunk).
    while (finished_.load(std::memory_order_acquire) < n_items) std::this_thread::yield();
  }

 private:
  // Claims and runs items of generation `gen` until none are left.
  void work(uint32_t gen, int64_t n_items, ItemFn fn, void* ctx) {
    for (;;) {
      uint64_t cur = next_.load(std::memory_order_acquire);
      do {
        if (uint32_t(cur >> 32) != gen || int64_t(cur & 0xffffffffu) >= n_items) return;
      } while (!next_.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel));
      fn(ctx, int64_t(cur & 0xffffffffu));
      finished_.fetch_add(1, std::memory_order_release);
    }
  }

  void helper_loop(int index) {
    uint32_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      wake_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      if (index >= active_helpers_) continue;  // the caller asked for fewer threads this time
      const ItemFn fn = fn_;
      void* const ctx = ctx_;
      const int64_t n = n_items_;
      lk.unlock();
      work(seen, n, fn, ctx);
      lk.lock();
    }
  }

  std::mutex run_mu_;  // held by the one caller whose job is in the pool
  std::mutex mu_;      // guards the job description below and the thread list
  std::condition_variable wake_;
  std::vector<std::thread> threads_;
  uint32_t generation_ = 0;
  ItemFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t n_items_ = 0;
  int active_helpers_ = 0;
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> finished_{0};
};

// Leaked on purpose: detached helpers may still sleep in it while static destructors run. After
// fork() the child has none of the parent's helper threads, so it starts a fresh pool.
Pool* g_pool = nullptr;
std::once_flag g_pool_once;

Pool& pool() {
  std::call_once(g_pool_once, [] {
    g_pool = new Pool();
    pthread_atfork(nullptr, nullptr, [] { g_pool = new Pool(); });
  });
  return *g_pool;
}

}  // namespace

int pool_helpers() { return threads_allowed() - 1; }

void run_items(int64_t n_items, int64_t min_parallel_items, ItemFn fn, void* ctx) {
  const int helpers = int(std::min<int64_t>(pool_helpers(), n_items - 1));
  // Item indices live in the low 32 bits of the claim word; 2^32 chunks would be ~10^14 elements.
  if (n_items < std::max<int64_t>(2, min_parallel_items) || helpers < 1 || n_items >= (int64_t(1) << 32)) {
    for (int64_t k = 0; k < n_items; ++k) fn(ctx, k);
    return;
  }
  pool().run(n_items, fn, ctx, helpers);
}

}  // namespace asyncpp::kernels
