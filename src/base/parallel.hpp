#pragma once
// Work spread over threads; internal to the library (not installed).

#include <cstddef>
#include <functional>

namespace weightstream::detail {

/// Runs `work(worker, item)` for every item in [0, count) on up to `workers` threads, worker 0
/// being the calling thread (so a callback that must run there, such as progress, can be
/// called when `worker` is 0). The first failure stops the others after their current item
/// and is rethrown.
void run_parallel(size_t count, size_t workers, const std::function<void(size_t worker, size_t item)>& work);

}  // namespace weightstream::detail
