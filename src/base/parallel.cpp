// run_parallel (parallel.hpp).
#include "base/parallel.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace weightstream::detail {

void run_parallel(size_t count, size_t workers, const std::function<void(size_t, size_t)>& work) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto worker = [&](size_t id) {
    for (size_t item; !failed && (item = next++) < count;) {
      try {
        work(id, item);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
        failed = true;
      }
    }
  };
  workers = std::max<size_t>(1, std::min(workers, count));
  {
    std::vector<std::jthread> pool;
    for (size_t id = 1; id < workers; ++id) pool.emplace_back(worker, id);
    worker(0);
  }  // joins
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace weightstream::detail
