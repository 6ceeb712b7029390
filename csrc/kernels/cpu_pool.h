// A small worker pool for the CPU optimizer kernels, built so that a busy machine cannot stall them.
//
// Why not an OpenMP parallel region: a region ends with a barrier that waits for EVERY team thread,
// including one the OS has not scheduled yet. On an oversubscribed machine (more runnable threads
// than cores) that costs a whole scheduler time slice (measured 4-7 ms here) per region, for work
// that takes microseconds. Here the caller works through the items itself; helpers that wake up in
// time take items too, and the caller waits only for items a helper has actually claimed. A helper
// that never got the CPU costs nothing. Idle helpers sleep on a condition variable (no spinning), so
// they never take CPU from torch's own threads.
#pragma once
#include <cstdint>
#include <type_traits>

namespace asyncpp::kernels {

// Runs fn(ctx, k) for every k in [0, n_items), possibly on several threads, and returns when all
// are done. Each k runs exactly once. Items must be independent. Runs inline (no helpers) when
// n_items < min_parallel_items, when only one thread is allowed (omp_get_max_threads(), which
// follows OMP_NUM_THREADS and torch.set_num_threads) or when another call is using the pool.
using ItemFn = void (*)(void* ctx, int64_t item);
void run_items(int64_t n_items, int64_t min_parallel_items, ItemFn fn, void* ctx);

// Convenience wrapper for a lambda `body(int64_t item)`.
template <typename Body>
void parallel_items(int64_t n_items, int64_t min_parallel_items, Body&& body) {
  using B = std::remove_reference_t<Body>;
  run_items(n_items, min_parallel_items, [](void* ctx, int64_t k) { (*static_cast<B*>(ctx))(k); },
            const_cast<void*>(static_cast<const void*>(&body)));
}

// Helper threads the pool would use for a parallel call right now (threads allowed - 1).
int pool_helpers();

}  // namespace asyncpp::kernels
