#pragma once
// The committer of a staged pull (peer_pull.cpp).
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace weightstream::transfer::pull {

/// Runs jobs in order on a thread of its own, started by the first post(): a staged pull's
/// commits (rows assembled, views handed to the session), so that the session writes one
/// batch while the next one's reads land. A job that throws ends it: the jobs after it are
/// dropped, and wait() rethrows its error. The destructor waits for the jobs posted (each
/// posted batch was checked whole, so a pull that fails later still writes it: what a failed
/// pull leaves does not depend on how far the committer had got).
class Committer {
 public:
  Committer() = default;
  Committer(const Committer&) = delete;
  Committer& operator=(const Committer&) = delete;
  ~Committer() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  /// Queues `job`; returns its ticket for wait().
  size_t post(std::function<void()> job) {
    std::lock_guard lock(mutex_);
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    jobs_.push_back(std::move(job));
    changed_.notify_all();
    return ++posted_;
  }
  /// Whether the job of `ticket` and every one before it have ended (0: none), waiting at
  /// most `timeout` for it; rethrows the error of a job that failed.
  bool ended(size_t ticket, std::chrono::milliseconds timeout) {
    std::unique_lock lock(mutex_);
    const bool done = changed_.wait_for(lock, timeout, [&] { return ended_ >= ticket || error_; });
    if (error_) std::rethrow_exception(error_);
    return done;
  }
  /// Waits until the job of `ticket` and every one before it have ended (0: none); rethrows
  /// the error of a job that failed.
  void wait(size_t ticket) {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return ended_ >= ticket || error_; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      std::exception_ptr error;
      try {
        job();
      } catch (...) {
        error = std::current_exception();
      }
      {
        std::lock_guard lock(mutex_);
        ++ended_;
        if (error && !error_) error_ = error;
        if (error_) jobs_.clear();
      }
      changed_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> jobs_;
  size_t posted_ = 0;
  size_t ended_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace weightstream::transfer::pull
