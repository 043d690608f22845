// The streamer: plan reads from tensor requests, run a reader pool, stage through a bounded
// pool, deliver every requested byte exactly once to the sink.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <set>
#include <thread>

#include "stream/staging_pool.hpp"
#include "stream/streamer.hpp"
#include "weightstream/error.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {
namespace {

using Clock = std::chrono::steady_clock;

/// Part of a read that belongs to one request.
struct Delivery {
  size_t request;
  uint64_t request_offset;  // where the bytes go within the request's extent
  uint64_t buffer_offset;   // where they are within the read
  uint64_t length;
  std::byte* direct;        // in a direct read: where the sink wants these bytes
  uint64_t payload;         // bytes of the request's runs among them (less than length across gaps)
  bool packed = false;      // runs of the request back to back (TensorPiece::packed)
};

/// One read call against storage.
struct PlannedRead {
  uint32_t shard;
  uint64_t offset;
  uint64_t length;
  bool direct;  // read straight into each delivery's memory (no staging)
  std::vector<Delivery> deliveries;
  /// A read of a request's runs: the file ranges read (by Storage::read_runs), each where it
  /// lies in [offset, offset + length); empty when the whole range is read.
  std::vector<ByteRange> runs;
  /// The runs are staged back to back (RunPlacement::kPacked) in `staged` bytes: a gathered
  /// read (plan_gathered_reads()).
  bool packed = false;
  uint64_t staged = 0;
  /// Bytes of staging the read takes.
  uint64_t staging_bytes() const { return packed ? staged : length; }
};

struct ResolvedRequest {
  uint32_t shard;
  uint64_t start;   // absolute offset in the shard file
  uint64_t length;  // of the extent
  std::byte* direct;
  uint64_t runs;    // runs of run_length bytes, `stride` apart
  uint64_t run_length;
  uint64_t stride;
};

/// Reads of the runs of `request` (request `index`; one run or several): as many runs as fit in
/// `chunk` bytes of the extent per read, one piece each; a run longer than `chunk` alone in
/// reads of `chunk` bytes. Which gaps storage reads with the runs is its choice (read_runs).
void plan_run_reads(const ResolvedRequest& request, size_t index, uint64_t chunk, std::vector<PlannedRead>& reads) {
  auto run_start = [&](uint64_t run) { return request.start + run * request.stride; };
  uint64_t run = 0;
  while (run < request.runs) {
    const uint64_t first = run_start(run);
    if (request.run_length > chunk) {
      for (uint64_t done = 0; done < request.run_length; done += chunk) {
        uint64_t length = std::min(chunk, request.run_length - done);
        reads.push_back({request.shard, first + done, length, false,
                         {{index, first - request.start + done, 0, length, nullptr, length}}, {}});
      }
      ++run;
      continue;
    }
    PlannedRead read{request.shard, first, 0, false, {}, {}};
    while (run < request.runs && run_start(run) + request.run_length - first <= chunk) {
      read.runs.push_back({run_start(run), request.run_length});
      ++run;
    }
    read.length = read.runs.back().offset + read.runs.back().length - first;
    read.deliveries.push_back(
        {index, first - request.start, 0, read.length, nullptr, read.runs.size() * request.run_length});
    if (read.runs.size() == 1) read.runs.clear();  // one range: a plain read
    reads.push_back(std::move(read));
  }
}

uint64_t effective_chunk(const StreamOptions& options) {
  // Keep at least four buffers inside the memory limit so reads overlap, but never read in
  // pieces smaller than a page.
  uint64_t chunk = std::min(options.chunk_bytes, std::max<uint64_t>(options.memory_limit / 4, 4096));
  chunk = std::max<uint64_t>(chunk - chunk % 4096, 4096);
  return std::min(chunk, std::max<uint64_t>(options.memory_limit, 4096));
}

/// Reads of the staged requests `order` (none direct) for a sink that takes packed runs
/// (TensorSink::takes_packed_runs()), in file order:
/// the ranges it asks for, apart or not, are gathered into reads that stage at most `chunk`
/// bytes of exactly those ranges, back to back: the runs of a column window, and slices of
/// many small tensors, cost a read per `chunk` of their own bytes. A run or request longer
/// than `chunk` is read alone, in reads of `chunk` bytes.
std::vector<PlannedRead> plan_gathered_reads(std::span<const ResolvedRequest> resolved, std::span<const size_t> order,
                                             uint64_t chunk) {
  std::vector<PlannedRead> reads;
  size_t open = SIZE_MAX;  // the read that takes more ranges
  // Stages [start, start + length) of `shard` in the open read, or a new one; returns its
  // place in the read's staging and whether a new read began.
  auto gather = [&](uint32_t shard, uint64_t start, uint64_t length) {
    bool fresh = open == SIZE_MAX || reads[open].shard != shard || reads[open].staged + length > chunk ||
                 start < reads[open].offset + reads[open].length;
    if (fresh) {
      reads.push_back({shard, start, 0, false, {}, {}, true, 0});
      open = reads.size() - 1;
    }
    PlannedRead& read = reads[open];
    const uint64_t at = read.staged;
    if (!read.runs.empty() && read.runs.back().offset + read.runs.back().length == start) {
      read.runs.back().length += length;  // ranges that meet are one copy
    } else {
      read.runs.push_back({start, length});
    }
    read.staged += length;
    read.length = start + length - read.offset;
    return std::pair{at, fresh};
  };
  for (size_t index : order) {
    const ResolvedRequest& request = resolved[index];
    if (request.length == 0) continue;
    const bool several = request.runs > 1;
    if (request.run_length > chunk) {  // alone, as plain reads of `chunk` bytes
      plan_run_reads(request, index, chunk, reads);
      continue;
    }
    for (uint64_t run = 0; run < request.runs; ++run) {
      const uint64_t start = request.start + run * request.stride;
      auto [at, fresh] = gather(request.shard, start, request.run_length);
      std::vector<Delivery>& deliveries = reads[open].deliveries;
      if (!fresh && run > 0 && !deliveries.empty() && deliveries.back().request == index) {
        deliveries.back().length += request.run_length;  // the next run of the same packed piece
        deliveries.back().payload += request.run_length;
        continue;
      }
      deliveries.push_back({index, run * request.stride, at, request.run_length, nullptr, request.run_length, several});
    }
  }
  return reads;
}

/// Reads of at most `chunk` bytes, in file order; with `gather`, the staged requests'
/// plan_gathered_reads() after the direct ones.
/// Neighbouring small requests share a read:
/// staged ones one staging buffer; direct ones (memory of the sink's own) one scatter read,
/// where `merge_direct` (a storage that pays per request, such as S3, reads it in one
/// request rather than one a tensor).
std::vector<PlannedRead> plan_reads(const Checkpoint& checkpoint, std::span<const TensorRequest> requests,
                                    TensorSink& sink, uint64_t chunk, bool merge_direct, bool gather) {
  std::vector<ResolvedRequest> resolved(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto& request = requests[i];
    WS_EXPECT(request.tensor < checkpoint.tensors().size(), ErrorCode::kInvalidArgument,
              "request " + std::to_string(i) + " names tensor #" + std::to_string(request.tensor) + " of a checkpoint with " +
                  std::to_string(checkpoint.tensors().size()) + " tensors");
    const auto& tensor = checkpoint.tensors()[request.tensor];
    if (request.runs > 1) {
      WS_EXPECT(request.range.length > 0 && request.range.length <= tensor.bytes && request.stride >= request.range.length &&
                    request.runs - 1 <= (tensor.bytes - request.range.length) / request.stride,
                ErrorCode::kInvalidArgument,
                "request " + std::to_string(i) + " for " + std::to_string(request.runs) + " runs of " +
                    std::to_string(request.range.length) + " bytes every " + std::to_string(request.stride) +
                    " bytes of tensor '" + tensor.name + "' does not fit its runs apart, or in the tensor");
    }
    const ByteRange extent = request.extent();
    uint64_t length = extent.length == 0 ? tensor.bytes - std::min(tensor.bytes, extent.offset) : extent.length;
    WS_EXPECT(extent.offset <= tensor.bytes && length <= tensor.bytes - extent.offset, ErrorCode::kInvalidArgument,
              "request for bytes " + std::to_string(extent.offset) + "+" + std::to_string(length) + " of tensor '" +
                  tensor.name + "' lies outside its " + std::to_string(tensor.bytes) + " bytes");
    const uint64_t runs = std::max<uint64_t>(request.runs, 1);
    resolved[i] = {tensor.shard, tensor.offset + extent.offset, length,
                   runs > 1 ? nullptr : sink.direct_destination(i), runs, runs > 1 ? request.range.length : length,
                   request.stride};
  }
  std::vector<size_t> order(requests.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(resolved[a].shard, resolved[a].start) < std::tie(resolved[b].shard, resolved[b].start);
  });
  std::vector<PlannedRead> reads;
  std::vector<size_t> staged;  // with `gather`: the requests read into staging, gathered below
  bool merge_open = false;  // whether reads.back() may take more neighbours of its kind
  for (size_t index : order) {
    const auto& request = resolved[index];
    if (request.length == 0) continue;
    if (gather && request.direct == nullptr) {
      staged.push_back(index);
      continue;
    }
    if (request.runs > 1) {
      plan_run_reads(request, index, chunk, reads);
      merge_open = false;
      continue;
    }
    const bool direct = request.direct != nullptr;
    const bool mergeable = request.length <= chunk && (!direct || merge_direct);
    if (mergeable && merge_open) {
      auto& last = reads.back();
      if (last.direct == direct && last.shard == request.shard && last.offset + last.length == request.start &&
          last.length + request.length <= chunk) {
        last.deliveries.push_back({index, 0, last.length, request.length, request.direct, request.length});
        last.length += request.length;
        continue;
      }
    }
    for (uint64_t done = 0; done < request.length; done += chunk) {
      uint64_t length = std::min(chunk, request.length - done);
      reads.push_back({request.shard, request.start + done, length, direct,
                       {{index, done, 0, length, direct ? request.direct + done : nullptr, length}}, {}});
    }
    merge_open = mergeable;
  }
  if (gather) {
    // Direct reads (merged as above where storage pays per request) come first.
    std::vector<PlannedRead> gathered = plan_gathered_reads(resolved, staged, chunk);
    reads.insert(reads.end(), std::make_move_iterator(gathered.begin()), std::make_move_iterator(gathered.end()));
  }
  return reads;
}

/// State shared by the reader threads of one stream.
class StreamRun {
 public:
  StreamRun(Storage& storage, const Checkpoint& checkpoint, std::span<const TensorRequest> requests, TensorSink& sink,
            std::vector<PlannedRead> reads, std::shared_ptr<StagingPool> pool, unsigned workers)
      : storage_(storage),
        checkpoint_(checkpoint),
        requests_(requests),
        sink_(sink),
        reads_(std::move(reads)),
        pool_(std::move(pool)),
        file_ordered_(sink.wants_file_order()),
        lends_views_(sink.takes_views() && storage.views_serve_reads()),
        ordered_(sink.wants_ordered_pieces() || file_ordered_),
        remaining_(requests.size()), next_offset_(requests.size(), 0),
        workers_running_(workers) {
    for (const auto& read : reads_) {
      for (const auto& delivery : read.deliveries) {
        remaining_[delivery.request] += delivery.payload;
        total_ += delivery.payload;
      }
    }
    // The callback holds the wake-up state by shared_ptr: a sink may drop a lease after this
    // run is gone. Taking the lock orders the wake-up after a waiter's failed try_acquire.
    pool_->set_on_release([wake = wake_] {
      { std::lock_guard lock(wake->mutex); }
      wake->condition.notify_all();
    });
  }

  void run_worker() {
    while (true) {
      size_t read_index;
      StagingPool::Lease lease;
      bool reserved = false;
      {
        // Buffers are granted in plan order, so the earliest unfinished read always holds
        // one: ordered delivery can wait on earlier pieces without deadlock.
        std::unique_lock lock(mutex_);
        while (true) {
          if (error_ || next_read_ >= reads_.size()) return;
          if (reads_[next_read_].direct || lent(reads_[next_read_])) break;
          lease = pool_->try_acquire();
          if (lease.data) break;
          reserved = pool_->try_reserve();
          if (reserved) break;
          auto waited_from = Clock::now();
          wakeup_.wait(lock);
          staging_wait_.add_since(waited_from);
        }
        read_index = next_read_++;
      }
      if (helpers_) {
        reads_taken_.store(read_index + 1, std::memory_order_relaxed);
        // Taking the lock orders the wake-up after a helper's check of reads_taken_.
        { std::lock_guard lock(helper_mutex_); }
        helper_wakeup_.notify_one();
      }
      try {
        if (reserved) lease = pool_->allocate_reserved();
        execute(read_index, lease);
      } catch (...) {
        fail(std::current_exception());
        return;
      }
    }
  }

  void fail(std::exception_ptr error) {
    {
      std::lock_guard lock(mutex_);
      if (!error_) error_ = error;
    }
    wakeup_.notify_all();
    wake_progress();
  }

  /// Called by each reader thread as it returns, whatever the reason.
  void worker_exited() {
    if (workers_running_.fetch_sub(1) == 1) {
      wake_progress();
      {
        std::lock_guard lock(helper_mutex_);
        readers_done_ = true;
      }
      helper_wakeup_.notify_all();
    }
  }

  /// A prefetcher, for a storage that reads through views: borrows the reads just ahead of
  /// the readers with populate (at most `lookahead` reads past the last one taken), and
  /// returns the views of finished reads (which drops their pages), so the readers' time
  /// goes to their copies and the mapping is empty when it is unmapped.
  /// Returns once every reader has returned and every finished read is dropped.
  void run_helper(size_t lookahead) {
    std::unique_lock lock(helper_mutex_);
    for (;;) {
      if (!to_return_.empty()) {
        Bytes finished = std::move(to_return_.back());
        to_return_.pop_back();
        lock.unlock();
        finished = {};  // drops the pages
        lock.lock();
        continue;
      }
      size_t taken = reads_taken_.load(std::memory_order_relaxed);
      next_prefetch_ = std::max(next_prefetch_, taken);  // a read a reader has taken is its own
      if (!readers_done_ && next_prefetch_ < reads_.size() && next_prefetch_ < taken + lookahead) {
        const PlannedRead& read = reads_[next_prefetch_++];
        lock.unlock();
        try {
          // Only the populated pages matter: the view goes at once, and the reader's read
          // of this range copies without mapping it again. A gathered read populates the
          // pages of its ranges, not those of the gaps between them.
          const std::string& name = checkpoint_.shards()[read.shard].name;
          if (!read.packed) {
            storage_.borrow(name, read.offset, read.length, {.populate = true});
          } else {
            const uint64_t gap = storage_.run_merge_gap();  // ranges this close populate together
            for (size_t first = 0, last = 0; first < read.runs.size(); first = ++last) {
              while (last + 1 < read.runs.size() &&
                     read.runs[last + 1].offset - (read.runs[last].offset + read.runs[last].length) <= gap) {
                ++last;
              }
              const uint64_t end = read.runs[last].offset + read.runs[last].length;
              storage_.borrow(name, read.runs[first].offset, end - read.runs[first].offset, {.populate = true});
            }
          }
        } catch (...) {
          // A hint only: the reader's read of this range reports what is wrong.
        }
        lock.lock();
        continue;
      }
      if (readers_done_) return;
      helper_wakeup_.wait(lock);
    }
  }

  /// `helpers` prefetcher threads will run beside the readers.
  void set_helpers(unsigned helpers) { helpers_ = helpers; }

  /// Calls `progress` about every `interval` until every byte is delivered, a reader fails
  /// or every reader has returned; wakes as soon as one of those happens, so a small load
  /// does not wait out the interval.
  void report_progress(const ProgressCallback& progress, uint64_t total, std::chrono::milliseconds interval) {
    auto finished = [&] {
      return delivered() >= total || workers_running_.load() == 0 || error();
    };
    while (!finished()) {
      progress(delivered(), total);
      std::unique_lock lock(progress_mutex_);
      progress_wakeup_.wait_for(lock, interval, finished);
    }
  }

  std::exception_ptr error() {
    std::lock_guard lock(mutex_);
    return error_;
  }

  double read_seconds() const { return reading_.seconds(); }
  double deliver_seconds() const { return delivering_.seconds(); }
  double staging_wait_seconds() const { return staging_wait_.seconds(); }

  uint64_t delivered() const { return delivered_.load(std::memory_order_relaxed); }
  /// Bytes Storage::read_runs read for the reads of runs (their runs, and gaps read with them).
  uint64_t run_bytes_read() const { return run_bytes_read_.load(std::memory_order_relaxed); }
  uint64_t completed() const { return completed_.load(std::memory_order_relaxed); }

  /// Requests with nothing to read (empty tensors) complete at once.
  void complete_empty_requests() {
    for (size_t i = 0; i < remaining_.size(); ++i) {
      if (remaining_[i] == 0) {
        sink_.request_complete(i);
        completed_.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

 private:
  void execute(size_t read_index, const StagingPool::Lease& lease) {
    const PlannedRead& read = reads_[read_index];
    const bool lent_read = lent(read);
    Bytes held = read_range(read, lease, lent_read);
    if (views_ && !lent_read) return_view(std::move(held));
    auto deliver_from = Clock::now();
    ReaderTime::AddOnExit delivering{delivering_, deliver_from};
    deliver(read_index, lease, held, lent_read);
  }

  /// Reads `read` into the lease's staging, or into the sink's memory for a direct read;
  /// returns the view of its range it borrowed (through views, or lent to the sink), else none.
  Bytes read_range(const PlannedRead& read, const StagingPool::Lease& lease, bool lent_read) {
    const auto& shard = checkpoint_.shards()[read.shard];
    auto read_from = Clock::now();
    // Through views, the reader holds its range's view while it reads: returning it drops
    // the pages, by a helper or, where there is none or it is behind, by this reader. A
    // range lent to the sink is that view, held until its pieces are consumed.
    Bytes held;
    if (views_ || lent_read) {
      held = storage_.borrow(shard.name, read.offset, read.length,
                             {.populate = lent_read, .drop_when_returned = true, .checked = lent_read});
    }
    if (lent_read) {
      // Nothing to copy: the pieces point into the view (a read of runs: the runs where they
      // lie, the gaps between them the file's bytes).
      for (const ByteRange& run : read.runs) run_bytes_read_.fetch_add(run.length, std::memory_order_relaxed);
    } else if (!read.runs.empty()) {
      const RunPlacement placement = read.packed ? RunPlacement::kPacked : RunPlacement::kAtOffsets;
      run_bytes_read_.fetch_add(
          storage_.read_runs(shard.name, read.offset, std::span(lease.data, read.staging_bytes()), read.runs, placement),
          std::memory_order_relaxed);
    } else if (!read.direct) {
      storage_.read(shard.name, read.offset, std::span(lease.data, read.length));
    } else {
      std::vector<std::span<std::byte>> segments;
      segments.reserve(read.deliveries.size());
      for (const auto& delivery : read.deliveries) segments.emplace_back(delivery.direct, delivery.length);
      storage_.read_scattered(shard.name, read.offset, segments);
    }
    reading_.add_since(read_from);
    return held;
  }

  /// Returns the view of a read copied out of it: to a helper, or here (dropping its pages)
  /// when there is none or its backlog is full.
  void return_view(Bytes held) {
    // A helper's backlog is at most one view each: the mapped pages this process holds
    // stay near the reads in flight, not the whole checkpoint, and nothing is left for
    // the unmap at the end.
    bool queued = false;
    if (helpers_) {
      std::lock_guard lock(helper_mutex_);
      queued = to_return_.size() < helpers_;
      if (queued) to_return_.push_back(std::move(held));
    }
    if (queued) {
      helper_wakeup_.notify_one();
    } else {
      held = {};
    }
  }

  /// Hands the pieces of read `read_index` to the sink, in the order it wants, and completes
  /// the requests whose last bytes they are.
  void deliver(size_t read_index, const StagingPool::Lease& lease, const Bytes& held, bool lent_read) {
    const PlannedRead& read = reads_[read_index];
    if (file_ordered_) {
      // Reads take their staging in plan order (a lent read needs none), so the read due
      // next always has what it needs: waiting for it cannot deadlock.
      std::unique_lock lock(mutex_);
      wakeup_.wait(lock, [&] { return error_ || next_delivered_read_ == read_index; });
      if (error_) return;
    }
    auto piece_of = [&](const auto& delivery) {
      TensorPiece piece;
      piece.request = delivery.request;
      piece.offset = delivery.request_offset;
      const std::byte* staged = lent_read ? held.span.data() : lease.data;
      piece.bytes = std::span<const std::byte>(read.direct ? delivery.direct : staged + delivery.buffer_offset,
                                               delivery.length);
      piece.keepalive = read.direct ? nullptr : lent_read ? held.keepalive : lease.keepalive;
      piece.lent = lent_read;
      piece.packed = delivery.packed;
      piece.tensor = &checkpoint_.tensors()[requests_[delivery.request].tensor];
      return piece;
    };
    auto delivered = [&](const auto& delivery) {
      if (delivered_.fetch_add(delivery.payload, std::memory_order_relaxed) + delivery.payload == total_) wake_progress();
      if (remaining_[delivery.request].fetch_sub(delivery.payload) == delivery.payload) {
        sink_.request_complete(delivery.request);
        completed_.fetch_add(1, std::memory_order_relaxed);
      }
    };
    if (!ordered_) {
      // The read's pieces go together: a sink copying to a GPU lands them in one copy.
      std::vector<TensorPiece> pieces;
      pieces.reserve(read.deliveries.size());
      for (const auto& delivery : read.deliveries) pieces.push_back(piece_of(delivery));
      sink_.consume_batch(pieces);
      for (const auto& delivery : read.deliveries) delivered(delivery);
    } else {
      for (const auto& delivery : read.deliveries) {
        if (ordered_) {
          std::unique_lock lock(mutex_);
          wakeup_.wait(lock, [&] { return error_ || next_offset_[delivery.request] == delivery.request_offset; });
          if (error_) return;
        }
        sink_.consume(piece_of(delivery));
        if (ordered_) {
          {
            std::lock_guard lock(mutex_);
            next_offset_[delivery.request] += delivery.length;
          }
          wakeup_.notify_all();
        }
        delivered(delivery);
      }
    }
    if (file_ordered_) {
      {
        std::lock_guard lock(mutex_);
        next_delivered_read_ = read_index + 1;
      }
      wakeup_.notify_all();
    }
  }

  void wake_progress() {
    // Taking the lock orders the notification after a waiter's check of its predicate.
    { std::lock_guard lock(progress_mutex_); }
    progress_wakeup_.notify_all();
  }

  /// Time summed over the reader threads, for StreamStats.
  class ReaderTime {
   public:
    void add_since(Clock::time_point from) {
      nanoseconds_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - from).count(),
                             std::memory_order_relaxed);
    }
    double seconds() const { return static_cast<double>(nanoseconds_.load(std::memory_order_relaxed)) * 1e-9; }
    /// Adds the time from `from` to its destruction (however the scope is left).
    struct AddOnExit {
      ReaderTime& time;
      Clock::time_point from;
      ~AddOnExit() { time.add_since(from); }
    };

   private:
    std::atomic<int64_t> nanoseconds_{0};
  };

  struct WakeState {
    std::mutex mutex;
    std::condition_variable condition;
  };

  Storage& storage_;
  const bool views_ = storage_.reads_through_views();  // reads copy out of borrowed views
  const Checkpoint& checkpoint_;
  std::span<const TensorRequest> requests_;
  TensorSink& sink_;
  std::vector<PlannedRead> reads_;
  std::shared_ptr<StagingPool> pool_;
  /// Whether `read` is delivered straight from storage's view of it (no staging).
  bool lent(const PlannedRead& read) const { return lends_views_ && !read.direct && !read.packed; }

  bool file_ordered_;  ///< every piece in plan order (sink.wants_file_order())
  bool lends_views_;   ///< sink.takes_views() and storage.views_serve_reads()
  bool ordered_;       ///< pieces of each request in offset order
  std::vector<std::atomic<uint64_t>> remaining_;
  std::vector<uint64_t> next_offset_;
  std::shared_ptr<WakeState> wake_ = std::make_shared<WakeState>();
  std::mutex& mutex_ = wake_->mutex;
  std::condition_variable& wakeup_ = wake_->condition;
  size_t next_read_ = 0;
  size_t next_delivered_read_ = 0;  ///< with file_ordered_: the read whose pieces go next
  std::exception_ptr error_;
  ReaderTime reading_;
  ReaderTime delivering_;
  ReaderTime staging_wait_;
  std::atomic<uint64_t> delivered_{0};
  std::atomic<uint64_t> run_bytes_read_{0};
  std::atomic<uint64_t> completed_{0};
  uint64_t total_ = 0;
  std::atomic<unsigned> workers_running_{0};
  std::mutex progress_mutex_;
  std::condition_variable progress_wakeup_;
  // Prefetchers (run_helper): set before any thread starts.
  unsigned helpers_ = 0;
  std::atomic<size_t> reads_taken_{0};  // reads handed to readers so far
  std::mutex helper_mutex_;
  std::condition_variable helper_wakeup_;
  size_t next_prefetch_ = 0;                     // guarded by helper_mutex_
  std::vector<Bytes> to_return_;                 // views of reads copied out; guarded by helper_mutex_
  bool readers_done_ = false;                    // guarded by helper_mutex_
};

// Prefetchers by default, where the cores allow: of 0, 3, 6 and 8 beside the warm shape's 8
// readers on a 16-core GPU machine, 3 was fastest; 6 and 8 were no faster than none (more
// threads, more memory traffic): bench/HISTORY.md, "Figures once in source comments".
constexpr unsigned kDefaultPrefetchers = 3;

/// Prefetchers beside `readers` reader threads: as asked, or kDefaultPrefetchers where the
/// readers leave that many hardware threads free (two kept for the copy engine's reaper and
/// the caller); none on smaller machines, where they would take cores from the readers.
unsigned prefetcher_count(const StreamOptions& options, unsigned readers) {
  if (options.prefetchers) return *options.prefetchers;
  unsigned cores = std::thread::hardware_concurrency();
  return cores >= readers + 2 + kDefaultPrefetchers ? kDefaultPrefetchers : 0;
}

/// Counts the plan's reads and shards, and the bytes of its plain reads (the others are
/// counted as storage reads them), into `stats`; returns the bytes it delivers.
uint64_t count_plan(std::span<const PlannedRead> reads, StreamStats& stats) {
  std::set<uint32_t> shards;
  uint64_t total = 0;
  for (const auto& read : reads) {
    if (read.runs.empty()) stats.bytes_read += read.length;
    shards.insert(read.shard);
    for (const auto& delivery : read.deliveries) total += delivery.payload;
  }
  stats.reads = reads.size();
  stats.shards_read = shards.size();
  return total;
}

/// Runs `run`'s readers and prefetchers, and reports progress on this thread, until every
/// reader and prefetcher has returned.
void run_threads(StreamRun& run, unsigned thread_count, unsigned helper_count, size_t lookahead,
                 const ProgressCallback& progress, uint64_t total) {
  // Declared first so they are joined last: they return once the readers have.
  std::vector<std::jthread> helpers;
  for (unsigned i = 0; i < helper_count; ++i) helpers.emplace_back([&run, lookahead] { run.run_helper(lookahead); });
  std::vector<std::jthread> threads;
  threads.reserve(thread_count);
  for (unsigned i = 0; i < thread_count; ++i) {
    threads.emplace_back([&run] {
      try {
        run.run_worker();
      } catch (...) {
        run.fail(std::current_exception());
      }
      run.worker_exited();
    });
  }
  if (progress) {
    try {
      run.report_progress(progress, total, std::chrono::milliseconds(100));
    } catch (...) {
      // A progress callback that throws cancels the stream (how a caller interrupts
      // a load, e.g. Python's Ctrl-C); its exception is the one thrown.
      run.fail(std::current_exception());
    }
  }
}

}  // namespace

std::vector<TensorRequest> all_tensors(const Checkpoint& checkpoint) {
  std::vector<TensorRequest> requests(checkpoint.tensors().size());
  for (size_t i = 0; i < requests.size(); ++i) requests[i] = {i, {0, checkpoint.tensors()[i].bytes}};
  return requests;
}

StreamStats stream_tensors(const Checkpoint& checkpoint, std::span<const TensorRequest> requests, TensorSink& sink,
                           const StreamOptions& options, const ProgressCallback& progress, HostMemory staging) {
  return stream_tensors_through(checkpoint.storage(), checkpoint, requests, sink, options, progress, staging);
}

StreamStats stream_tensors_through(Storage& storage, const Checkpoint& checkpoint,
                                   std::span<const TensorRequest> requests, TensorSink& sink,
                                   const StreamOptions& options, const ProgressCallback& progress,
                                   HostMemory staging) {
  auto start = Clock::now();
  check_stream_options(options);
  // Pieces of a request of several runs skip its gaps: they cannot come in one ordered sequence.
  WS_EXPECT(!(sink.wants_ordered_pieces() || sink.wants_file_order()) ||
                std::ranges::none_of(requests, [](const TensorRequest& request) { return request.runs > 1; }),
            ErrorCode::kInvalidArgument, "a sink that wants its pieces in order cannot take requests of several runs");
  uint64_t chunk = effective_chunk(options);
  // A storage read through views pairs each populated view with one read of the same
  // range: its direct reads stay one a tensor.
  // Gathered reads where the sink takes packed runs and its reads are staged (not lent views).
  const bool gather = sink.takes_packed_runs() && !sink.wants_ordered_pieces() && !sink.wants_file_order() &&
                      !(sink.takes_views() && storage.views_serve_reads());
  auto reads = plan_reads(checkpoint, requests, sink, chunk, !storage.reads_through_views(), gather);

  const StorageStats storage_before = storage.stats();
  StreamStats stats;
  const uint64_t total = count_plan(reads, stats);
  // Buffers as large as the largest staged read, not the chunk: a checkpoint of small
  // tensors, or a chunk size far above them (--chunk-size 1TB), stages only what it reads.
  uint64_t largest_staged = 0;
  for (const auto& read : reads) {
    if (!read.direct) largest_staged = std::max(largest_staged, read.staging_bytes());
  }
  chunk = std::min(chunk, std::max<uint64_t>((largest_staged + 4095) / 4096 * 4096, 4096));

  // Staging beyond what the readers can fill at once only costs allocation time (pinned
  // memory is slow to allocate); half again the reader count covers pieces whose copy or
  // hashing is still in flight.
  size_t useful_buffers = options.concurrency + options.concurrency / 2 + 1;
  size_t max_buffers = static_cast<size_t>(std::clamp<uint64_t>(options.memory_limit / chunk, 1, useful_buffers));
  auto pool = StagingPool::create(chunk, max_buffers, staging);
  unsigned thread_count = static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(options.concurrency, reads.size())));
  unsigned helper_count = storage.reads_through_views() ? prefetcher_count(options, thread_count) : 0;
  {
    StreamRun run(storage, checkpoint, requests, sink, std::move(reads), pool, thread_count);
    run.set_helpers(helper_count);
    run.complete_empty_requests();
    // The prefetchers map at most two reads a reader ahead, within what the memory limit
    // leaves beside the staging (at least one read).
    const uint64_t room = options.memory_limit - std::min<uint64_t>(options.memory_limit, max_buffers * chunk);
    const size_t lookahead = std::clamp<size_t>(room / chunk, 1, 2 * static_cast<size_t>(thread_count));
    run_threads(run, thread_count, helper_count, lookahead, progress, total);
    if (auto error = run.error()) {
      try {
        sink.finish();
      } catch (...) {
        // The first error is the one the caller sees; a sink failing to drain after it
        // adds nothing.
      }
      std::rethrow_exception(error);
    }
    WS_EXPECT(run.delivered() == total, ErrorCode::kInternal,
              "stream delivered " + std::to_string(run.delivered()) + " of " + std::to_string(total) + " bytes");
    stats.tensors = run.completed();
    stats.bytes = run.delivered();
    stats.bytes_read += run.run_bytes_read();
    stats.read_seconds = run.read_seconds();
    stats.deliver_seconds = run.deliver_seconds();
    stats.staging_wait_seconds = run.staging_wait_seconds();
  }
  sink.finish();
  if (progress) progress(total, total);
  stats.peak_staging_bytes = pool->peak_bytes();
  const StorageStats storage_after = storage.stats();
  stats.storage_requests = storage_after.requests - storage_before.requests;
  stats.storage_retries = storage_after.retries - storage_before.retries;
  stats.storage_checksum_failures = storage_after.checksum_failures - storage_before.checksum_failures;
  stats.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return stats;
}

}  // namespace weightstream
