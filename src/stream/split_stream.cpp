// Implements split_stream.hpp: two sources at once, one sink, the first error wins.
#include "stream/split_stream.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <numeric>
#include <set>
#include <thread>

namespace weightstream {
namespace {

uint64_t request_bytes(const Checkpoint& checkpoint, const TensorRequest& request) {
  if (request.runs > 1) return request.run_bytes();
  return request.range.length ? request.range.length
                              : checkpoint.tensors()[request.tensor].bytes - request.range.offset;
}

/// What a source's progress callback throws to stop it once the other source has failed.
struct SourceCancelled {};

/// One source's view of the sink: its requests carry local indices, the sink sees the
/// original ones; finish() is left to split_stream, which calls the sink's once.
class SubsetSink final : public TensorSink {
 public:
  SubsetSink(TensorSink& outer, const std::vector<size_t>& original) : outer_(outer), original_(original) {}
  std::byte* direct_destination(size_t request) override { return outer_.direct_destination(original_[request]); }
  bool wants_ordered_pieces() const override { return outer_.wants_ordered_pieces(); }
  bool wants_file_order() const override { return outer_.wants_file_order(); }
  bool takes_views() const override { return outer_.takes_views(); }
  void consume(TensorPiece&& piece) override {
    piece.request = original_[piece.request];
    outer_.consume(std::move(piece));
  }
  void request_complete(size_t request) override { outer_.request_complete(original_[request]); }
  void finish() override {}

 private:
  TensorSink& outer_;
  const std::vector<size_t>& original_;
};

/// The requests of one source: original indices, and the requests with local indices.
struct Subset {
  std::vector<size_t> original;
  std::vector<TensorRequest> requests;
  uint64_t bytes = 0;
};

/// Deals `requests` in file order so that the second subset holds `share` of the bytes
/// read so far at every point: both sources then work along the whole checkpoint.
std::pair<Subset, Subset> deal(const Checkpoint& checkpoint, std::span<const TensorRequest> requests, double share) {
  const auto& tensors = checkpoint.tensors();
  std::vector<size_t> order(requests.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const CheckpointTensor& x = tensors[requests[a].tensor];
    const CheckpointTensor& y = tensors[requests[b].tensor];
    return x.shard != y.shard ? x.shard < y.shard : x.offset + requests[a].range.offset < y.offset + requests[b].range.offset;
  });
  Subset first, second;
  for (size_t index : order) {
    uint64_t bytes = request_bytes(checkpoint, requests[index]);
    double wanted = share * static_cast<double>(first.bytes + second.bytes + bytes);
    bool to_second = share >= 1 || (share > 0 && static_cast<double>(second.bytes) + static_cast<double>(bytes) / 2 <= wanted);
    Subset& subset = to_second ? second : first;
    subset.original.push_back(index);
    subset.requests.push_back(requests[index]);
    subset.bytes += bytes;
  }
  return {std::move(first), std::move(second)};
}

/// How one source ended.
struct Outcome {
  StreamStats stats;
  std::exception_ptr error;  ///< empty on success and when it was only cancelled
  bool cancelled = false;
};

/// Each source's options: the second gets plan.second_concurrency of the workers (at least
/// one, leaving one for the first) and a share of the staging memory by its share of the bytes.
std::pair<StreamOptions, StreamOptions> divide_options(const StreamOptions& options, const SplitPlan& plan,
                                                       uint64_t second_bytes, uint64_t total) {
  StreamOptions first_options = options, second_options = options;
  unsigned second_workers = std::clamp(plan.second_concurrency, 1u, std::max(options.concurrency, 2u) - 1);
  second_options.concurrency = second_workers;
  first_options.concurrency = std::max(options.concurrency, 2u) - second_workers;
  double byte_share = total ? static_cast<double>(second_bytes) / static_cast<double>(total) : 0;
  second_options.memory_limit =
      std::max(kMinStagingBytes, static_cast<uint64_t>(static_cast<double>(options.memory_limit) * byte_share));
  first_options.memory_limit = std::max(kMinStagingBytes, options.memory_limit - std::min(options.memory_limit,
                                                                                          second_options.memory_limit));
  return {first_options, second_options};
}

/// The two sources' counters added up (shards_read and seconds are the caller's).
StreamStats sum_stats(const StreamStats& first, const StreamStats& second) {
  StreamStats stats;
  for (const StreamStats* part : {&first, &second}) {
    stats.tensors += part->tensors;
    stats.bytes += part->bytes;
    stats.bytes_read += part->bytes_read;
    stats.reads += part->reads;
    stats.peak_staging_bytes += part->peak_staging_bytes;
    stats.read_seconds += part->read_seconds;
    stats.deliver_seconds += part->deliver_seconds;
    stats.staging_wait_seconds += part->staging_wait_seconds;
  }
  return stats;
}

}  // namespace

StreamStats split_stream(const Checkpoint& checkpoint, std::span<const TensorRequest> requests, TensorSink& sink,
                         const StreamOptions& options, const ProgressCallback& progress, const SplitPlan& plan,
                         const SplitSource& first, const SplitSource& second) {
  auto start = std::chrono::steady_clock::now();
  // Named references, not a structured binding: the lambdas below capture them.
  std::pair<Subset, Subset> subsets = deal(checkpoint, requests, std::clamp(plan.second_share, 0.0, 1.0));
  Subset& first_subset = subsets.first;
  Subset& second_subset = subsets.second;
  const uint64_t total = first_subset.bytes + second_subset.bytes;

  const std::pair<StreamOptions, StreamOptions> divided = divide_options(options, plan, second_subset.bytes, total);
  const StreamOptions& first_options = divided.first;
  const StreamOptions& second_options = divided.second;

  std::atomic<bool> stop{false};
  std::atomic<uint64_t> first_done{0}, second_done{0};
  std::mutex mutex;
  std::condition_variable second_ended;
  bool second_running = !second_subset.requests.empty();
  Outcome first_outcome, second_outcome;

  auto run = [&](const SplitSource& source, Subset& subset, const StreamOptions& source_options,
                 std::atomic<uint64_t>& done, const ProgressCallback& report) {
    Outcome outcome;
    if (subset.requests.empty()) return outcome;
    SubsetSink subset_sink(sink, subset.original);
    try {
      outcome.stats = source(subset.requests, subset_sink, source_options, [&](uint64_t bytes, uint64_t) {
        done.store(bytes, std::memory_order_relaxed);
        if (stop.load()) throw SourceCancelled{};
        if (report) report(first_done.load() + second_done.load(), total);
      });
    } catch (const SourceCancelled&) {
      outcome.cancelled = true;
    } catch (...) {
      outcome.error = std::current_exception();
      stop.store(true);
    }
    return outcome;
  };

  std::thread second_thread;
  if (second_running) {
    second_thread = std::thread([&] {
      Outcome outcome = run(second, second_subset, second_options, second_done, {});
      std::lock_guard lock(mutex);
      second_outcome = std::move(outcome);
      second_running = false;
      second_ended.notify_all();
    });
  }
  // The first source runs here, so `progress` is called on the caller's thread; once it is
  // done this thread keeps reporting until the second one ends.
  first_outcome = run(first, first_subset, first_options, first_done, progress);
  {
    std::unique_lock lock(mutex);
    while (!second_ended.wait_for(lock, std::chrono::milliseconds(100), [&] { return !second_running; })) {
      if (!progress || stop.load()) continue;
      lock.unlock();
      try {
        progress(first_done.load() + second_done.load(), total);
      } catch (...) {
        if (!first_outcome.error) first_outcome.error = std::current_exception();
        stop.store(true);
      }
      lock.lock();
    }
  }
  if (second_thread.joinable()) second_thread.join();

  // A source that was only cancelled has no error of its own: the other one's is thrown.
  std::exception_ptr error = first_outcome.error ? first_outcome.error : second_outcome.error;
  if (error) {
    try {
      sink.finish();
    } catch (...) {
      // The first error is the one the caller sees.
    }
    std::rethrow_exception(error);
  }
  sink.finish();
  if (progress) progress(total, total);

  StreamStats stats = sum_stats(first_outcome.stats, second_outcome.stats);
  std::set<uint32_t> shards;
  for (const TensorRequest& request : requests) shards.insert(checkpoint.tensors()[request.tensor].shard);
  stats.shards_read = shards.size();
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

}  // namespace weightstream
