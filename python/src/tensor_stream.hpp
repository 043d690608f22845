#pragma once
// Part of the Python bindings, not of the installed C++ API: a background stream of a
// checkpoint's tensors, each into a buffer of its own, and a bounded, ordered queue of the
// completed tensors for an iterator to pop. Knows nothing of Python, so the iterator can
// wait for it with the interpreter lock released.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "weightstream/device.hpp"
#include "weightstream/stream.hpp"

namespace weightstream::python {

/// One streamed tensor: its index in Checkpoint::tensors() and the buffer that owns its
/// bytes (host or device memory). `buffer` is null for a tensor of zero bytes.
struct StreamedTensor {
  size_t tensor = 0;
  std::unique_ptr<Buffer> buffer;
};

/// Streams every tensor of a checkpoint in file order: one stream of the whole selection
/// (stream_tensors_for_device(), the load's path: on a GPU, pinned staging or registered
/// windows of mapped shards, and an asynchronous copy per piece), so its readers never stop
/// between tensors and its setup (reader threads, page-cache probe, mappings) is paid once.
///
/// Bounded memory: a tensor is *admitted* (its buffer allocated, on a thread of its own,
/// ahead of the readers) in file order, only when the bytes admitted but not yet popped
/// plus its own fit in the queue's limit, or when nothing is queued at all (so a single
/// tensor larger than the limit still streams). A reader holding a piece of a tensor not yet
/// admitted waits for it. Tensor buffers therefore never hold more than max(queue limit,
/// largest tensor) at once. For a GPU the queue's limit is `memory_limit` (device memory;
/// staging is pinned host memory within its own `memory_limit`); on the host, where both
/// are host memory, staging and the queue get half of `memory_limit` each. Every earlier tensor's reads were handed out before that
/// reader's, with their staging, so a waiting reader never blocks the tensors the consumer
/// waits for. Pieces land from staging (a host stream copies them into the tensor's
/// buffer); a tensor is complete once its last copy landed. Dropping or cancelling the
/// stream stops the readers at their next piece and joins both threads.
class TensorStream {
 public:
  /// Starts streaming every tensor, or only the tensors whose indices `selection` holds
  /// (still in file order). Throws Error when `device` cannot be used or an index is outside
  /// the checkpoint.
  TensorStream(std::shared_ptr<const Checkpoint> checkpoint, const Device& device, const StreamOptions& options,
               std::vector<size_t> selection = {});
  /// Cancels the stream and waits for its threads; never throws.
  ~TensorStream();
  TensorStream(const TensorStream&) = delete;
  TensorStream& operator=(const TensorStream&) = delete;

  /// Blocks until the next tensor in file order is complete and returns it; nullopt once
  /// every tensor was returned. Rethrows the stream's first error (naming the tensor, the
  /// object and the cause); after that, and after cancel(), every call throws.
  std::optional<StreamedTensor> next();
  /// Stops the stream and waits for its threads. Idempotent; never throws.
  void cancel() noexcept;

  const Checkpoint& checkpoint() const noexcept { return *checkpoint_; }
  const Device& device() const noexcept { return device_; }
  /// Bytes of tensors admitted (allocated, complete or in flight) and not yet returned by next().
  uint64_t queued_bytes() const;
  /// Most bytes ever queued at once (the bound this class promises).
  uint64_t peak_queued_bytes() const;

 private:
  class PieceLanding;  // one piece's copy: counts it off its tensor once landed
  class Sink;

  /// Thread bodies: the stream of every selected tensor, and the admission of their buffers.
  void read_all() noexcept;
  void admit_all() noexcept;
  /// Records the stream's first error (none after cancel()) and wakes every waiter.
  void fail(std::exception_ptr error) noexcept;
  /// Where the tensor at `position` of order_ lands, once it is admitted; throws when the
  /// stream stopped first.
  std::byte* destination_once_admitted(size_t position);
  /// One count of the tensor at `position` is off: the last marks it complete.
  void count_off(size_t position);

  std::shared_ptr<const Checkpoint> checkpoint_;
  Device device_;
  StreamOptions options_;     // the reads' options (staging within options_.memory_limit)
  uint64_t queue_limit_;      // bytes of admitted tensors not yet popped (see the class comment)
  std::vector<size_t> order_;  // indices of the tensors streamed, in file order

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  // Per position of order_. buffers_ and complete_ are guarded by mutex_; destinations_[p]
  // is written before admitted_ passes p and read only after (acquire), so without the lock.
  std::vector<std::unique_ptr<Buffer>> buffers_;
  std::vector<std::byte*> destinations_;
  std::vector<char> complete_;
  // Counts of each tensor still outstanding: one for "pieces still to come" plus one per
  // piece whose copy to the device has not landed.
  std::vector<std::atomic<uint32_t>> outstanding_;
  std::atomic<size_t> admitted_{0};  // positions below this have their buffer
  size_t next_ = 0;                  // position in order_ of the next tensor next() returns
  uint64_t queued_ = 0;
  uint64_t peak_queued_ = 0;
  bool cancelled_ = false;
  std::atomic<bool> stopping_{false};  // cancelled or failed: readable by reader threads without the lock
  std::exception_ptr error_;
  std::mutex join_mutex_;  // cancel() may run on two threads (close() and the destructor)
  // Declared after the state its copies' keepalives update, so it is destroyed (waiting for
  // those copies) first. Null on the host.
  std::unique_ptr<DeviceCopier> copier_;
  std::thread admitter_;
  std::thread reader_;
};

}  // namespace weightstream::python
