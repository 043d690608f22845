#pragma once
// Part of the Python bindings, not of the installed C++ API: a background thread that
// streams a checkpoint tensor by tensor into per-tensor buffers, and a bounded, ordered
// queue of the completed tensors for an iterator to pop. Knows nothing of Python, so the
// iterator can wait for it with the interpreter lock released.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
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

/// Streams every tensor of a checkpoint in file order on a thread of its own.
///
/// Bounded memory: tensors are read in batches into buffers of their own, and a new batch
/// starts only when the bytes completed but not yet popped plus the batch fit in
/// `memory_limit`, or when nothing is queued at all (so a single tensor larger than the
/// limit still streams). Tensor buffers therefore never hold more than max(memory_limit,
/// largest tensor) at once. The host path reads straight into them; a GPU stream reads by
/// the device path of stream_tensors_for_device() (options.gpu_path: pinned staging within
/// the limit, or registered windows of mapped shards) and copies each piece asynchronously,
/// as a load does; a batch starts reading while the previous one's last copies (at most
/// 64 MiB) are still landing. Dropping or cancelling the stream stops the readers at their next piece
/// and joins the thread.
class TensorStream {
 public:
  /// Starts streaming every tensor, or only the tensors whose indices `selection` holds
  /// (still in file order). Throws Error when `device` cannot be used or an index is outside
  /// the checkpoint.
  TensorStream(std::shared_ptr<const Checkpoint> checkpoint, const Device& device, const StreamOptions& options,
               std::vector<size_t> selection = {});
  /// Cancels the stream and waits for its thread; never throws.
  ~TensorStream();
  TensorStream(const TensorStream&) = delete;
  TensorStream& operator=(const TensorStream&) = delete;

  /// Blocks until the next tensor in file order is complete and returns it; nullopt once
  /// every tensor was returned. Rethrows the stream's first error (naming the tensor, the
  /// object and the cause); after that, and after cancel(), every call throws.
  std::optional<StreamedTensor> next();
  /// Stops the stream and waits for its thread. Idempotent; never throws.
  void cancel() noexcept;

  const Checkpoint& checkpoint() const noexcept { return *checkpoint_; }
  const Device& device() const noexcept { return device_; }
  /// Bytes of tensors completed or in flight and not yet returned by next().
  uint64_t queued_bytes() const;
  /// Most bytes ever queued at once (the bound this class promises).
  uint64_t peak_queued_bytes() const;

 private:
  /// A tensor buffer allocated for the current batch, and whether all its bytes landed.
  struct Slot {
    StreamedTensor tensor;
    bool complete = false;
  };
  struct BatchLandings;  // per-tensor counts of a batch's copies still in flight
  class PieceLanding;    // one piece's copy: counts it off its tensor once landed
  class BatchSink;

  void run() noexcept;
  void stream_batch(size_t first, size_t last);
  /// The tensor at position `position` of order_ has landed whole.
  void mark_complete(size_t position);

  std::shared_ptr<const Checkpoint> checkpoint_;
  Device device_;
  StreamOptions options_;
  uint64_t batch_target_;
  std::vector<size_t> order_;  // indices of the tensors streamed, in file order

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Slot> slots_;   // tensors at positions next_ .. next_ + slots_.size() of order_
  size_t next_ = 0;          // position in order_ of the next tensor next() returns
  uint64_t queued_ = 0;
  uint64_t peak_queued_ = 0;
  bool cancelled_ = false;
  std::atomic<bool> stopping_{false};  // cancelled_, readable by reader threads without the lock
  bool producer_done_ = false;
  std::exception_ptr error_;
  std::mutex join_mutex_;  // cancel() may run on two threads (close() and the destructor)
  // Declared after the state its copies' keepalives update, so it is destroyed (waiting for
  // those copies) first. Null on the host.
  std::unique_ptr<DeviceCopier> copier_;
  std::thread producer_;
};

}  // namespace weightstream::python
