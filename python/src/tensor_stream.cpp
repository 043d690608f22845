#include "tensor_stream.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "weightstream/error.hpp"

namespace weightstream::python {
namespace {

/// Bytes of one batch's copies to the device that may still be landing when the next batch
/// starts reading: the staging they hold is the most by which staging exceeds the limit
/// (the stream contract allows 64 MiB).
constexpr uint64_t kCopiesInFlightBetweenBatches = 64 * kMiB;

/// Half the limit per batch, so that one batch is read while the one before it is consumed.
uint64_t batch_target_for(const StreamOptions& options) { return std::max<uint64_t>(options.memory_limit / 2, 1); }

/// End of the batch that starts at position `first` of `order`: tensors in file order up to
/// `target` bytes, and always at least one tensor.
size_t batch_end(const std::vector<CheckpointTensor>& tensors, const std::vector<size_t>& order, size_t first,
                 uint64_t target) {
  size_t last = first;
  uint64_t bytes = 0;
  while (last < order.size() && (last == first || bytes + tensors[order[last]].bytes <= target)) {
    bytes += tensors[order[last++]].bytes;
  }
  return last;
}

/// Every tensor index when `selection` is empty, else the selected ones in file order.
std::vector<size_t> stream_order(const Checkpoint& checkpoint, std::vector<size_t> selection) {
  if (selection.empty()) {
    selection.resize(checkpoint.tensors().size());
    for (size_t i = 0; i < selection.size(); ++i) selection[i] = i;
    return selection;
  }
  std::sort(selection.begin(), selection.end());
  selection.erase(std::unique(selection.begin(), selection.end()), selection.end());
  WS_EXPECT(selection.back() < checkpoint.tensors().size(), ErrorCode::kInvalidArgument,
            "tensor index " + std::to_string(selection.back()) + " is outside the " +
                std::to_string(checkpoint.tensors().size()) + " tensors of " + checkpoint.uri());
  return selection;
}

}  // namespace

/// What is still outstanding of each tensor of one batch: one count for "pieces still to
/// come" (dropped by request_complete) plus one per piece whose copy to the device has not
/// landed. The last one to go marks the tensor complete. Shared with the copies' keepalives,
/// which the copier may drop after the batch's sink is gone.
struct TensorStream::BatchLandings {
  BatchLandings(TensorStream& stream, size_t first, size_t count) : stream(stream), first(first), outstanding(count) {
    for (auto& count_left : outstanding) count_left.store(1, std::memory_order_relaxed);
  }
  void release(size_t request) {
    if (outstanding[request].fetch_sub(1, std::memory_order_acq_rel) == 1) stream.mark_complete(first + request);
  }
  TensorStream& stream;
  size_t first;
  std::vector<std::atomic<uint32_t>> outstanding;
};

/// The keepalive of one piece's copy to the device: holds the piece's source (a staging
/// lease or a registered window) and, once the copier drops it after the copy landed, counts
/// the piece off its tensor.
class TensorStream::PieceLanding {
 public:
  PieceLanding(std::shared_ptr<BatchLandings> landings, size_t request, std::shared_ptr<const void> source)
      : landings_(std::move(landings)), request_(request), source_(std::move(source)) {}
  ~PieceLanding() {
    source_.reset();  // the staging buffer goes back to its pool first
    landings_->release(request_);
  }
  PieceLanding(const PieceLanding&) = delete;
  PieceLanding& operator=(const PieceLanding&) = delete;

 private:
  std::shared_ptr<BatchLandings> landings_;
  size_t request_;
  std::shared_ptr<const void> source_;
};

/// Receives the pieces of one batch. Host tensors are read straight into their own buffers;
/// for a GPU, each piece is copied asynchronously into its tensor's device buffer by the
/// stream's DeviceCopier, from wherever the device path put it (pinned staging or a
/// registered window of a mapped shard), and the tensor is complete once its last copy
/// landed: nothing waits per piece or per tensor.
class TensorStream::BatchSink final : public TensorSink {
 public:
  BatchSink(TensorStream& stream, std::shared_ptr<BatchLandings> landings, std::vector<std::byte*> destinations)
      : stream_(stream), landings_(std::move(landings)), destinations_(std::move(destinations)) {}

  std::byte* direct_destination(size_t request) override {
    return stream_.copier_ ? nullptr : destinations_[request];
  }

  void consume(TensorPiece&& piece) override {
    const CheckpointTensor& tensor = *piece.tensor;
    // Throwing is how a sink stops stream_tensors: it cancels the other readers at once.
    WS_EXPECT(!stream_.stopping_.load(std::memory_order_relaxed), ErrorCode::kCancelled,
              "stream of " + stream_.checkpoint_->uri() + " cancelled while reading '" + tensor.name + "'");
    std::byte* destination = destinations_[piece.request] + piece.offset;
    if (!stream_.copier_) {
      // Read straight into the buffer, except where the storage had to stage the bytes.
      if (piece.bytes.data() != destination) std::memcpy(destination, piece.bytes.data(), piece.bytes.size());
      return;
    }
    landings_->outstanding[piece.request].fetch_add(1, std::memory_order_relaxed);
    auto landing = std::make_shared<PieceLanding>(landings_, piece.request, std::move(piece.keepalive));
    stream_.copier_->copy_to_device(destination, piece.bytes.data(), piece.bytes.size(), std::move(landing),
                                    static_cast<unsigned>(piece.request), tensor.name);
  }

  void request_complete(size_t request) override { landings_->release(request); }

  /// The next batch starts while the last copies of this one are still landing, so the copy
  /// engine never waits for a batch's reads to start: this returns once at most
  /// kCopiesInFlightBetweenBatches are left (their staging is all that outlives the batch).
  /// Synchronizing here instead cost a drain and refill of the whole pipeline per batch.
  void finish() override {
    if (stream_.copier_) stream_.copier_->wait_until_in_flight_at_most(kCopiesInFlightBetweenBatches);
  }

 private:
  TensorStream& stream_;
  std::shared_ptr<BatchLandings> landings_;
  std::vector<std::byte*> destinations_;
};

TensorStream::TensorStream(std::shared_ptr<const Checkpoint> checkpoint, const Device& device, const StreamOptions& options,
                           std::vector<size_t> selection)
    : checkpoint_(std::move(checkpoint)),
      device_(device),
      options_(options),
      batch_target_(batch_target_for(options)),
      order_(stream_order(*checkpoint_, std::move(selection))) {
  require_device(device_);
  if (device_.is_cuda()) copier_ = std::make_unique<DeviceCopier>(device_);
  producer_ = std::thread([this] { run(); });
}

TensorStream::~TensorStream() { cancel(); }

void TensorStream::cancel() noexcept {
  {
    std::lock_guard lock(mutex_);
    cancelled_ = true;
    stopping_.store(true, std::memory_order_relaxed);
  }
  changed_.notify_all();
  std::lock_guard join_lock(join_mutex_);
  if (producer_.joinable()) producer_.join();
}

void TensorStream::run() noexcept {
  try {
    const auto& tensors = checkpoint_->tensors();
    for (size_t first = 0; first < order_.size();) {
      size_t last = batch_end(tensors, order_, first, batch_target_);
      uint64_t bytes = 0;
      for (size_t i = first; i < last; ++i) bytes += tensors[order_[i]].bytes;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return cancelled_ || queued_ == 0 || queued_ + bytes <= options_.memory_limit; });
        if (cancelled_) break;
      }
      stream_batch(first, last);
      first = last;
    }
  } catch (...) {
    std::lock_guard lock(mutex_);
    // A failure caused by cancel() is no error: nobody is waiting for the stream any more.
    if (!cancelled_ && !error_) error_ = std::current_exception();
  }
  {
    std::lock_guard lock(mutex_);
    producer_done_ = true;
  }
  changed_.notify_all();
}

void TensorStream::stream_batch(size_t first, size_t last) {
  const auto& tensors = checkpoint_->tensors();
  std::vector<Slot> slots(last - first);
  std::vector<std::byte*> destinations(last - first, nullptr);
  std::vector<TensorRequest> requests(last - first);
  uint64_t bytes = 0;
  for (size_t position = first; position < last; ++position) {
    size_t request = position - first;
    size_t i = order_[position];
    slots[request].tensor.tensor = i;
    if (tensors[i].bytes > 0) {
      slots[request].tensor.buffer = std::make_unique<Buffer>(device_, tensors[i].bytes);
      destinations[request] = slots[request].tensor.buffer->data();
    }
    requests[request] = {i, {0, tensors[i].bytes}};
    bytes += tensors[i].bytes;
  }
  {
    std::lock_guard lock(mutex_);
    for (auto& slot : slots) slots_.push_back(std::move(slot));
    queued_ += bytes;
    peak_queued_ = std::max(peak_queued_, queued_);
  }
  BatchSink sink(*this, std::make_shared<BatchLandings>(*this, first, last - first), std::move(destinations));
  stream_tensors_for_device(device_, *checkpoint_, requests, sink, options_);
}

void TensorStream::mark_complete(size_t position) {
  {
    std::lock_guard lock(mutex_);
    slots_[position - next_].complete = true;
  }
  changed_.notify_all();
}

std::optional<StreamedTensor> TensorStream::next() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] {
    return cancelled_ || error_ || (!slots_.empty() && slots_.front().complete) || (producer_done_ && slots_.empty());
  });
  if (error_) std::rethrow_exception(error_);
  WS_EXPECT(!cancelled_, ErrorCode::kCancelled, "stream of " + checkpoint_->uri() + " was closed");
  if (slots_.empty()) return std::nullopt;
  // A copy that failed still counts its piece off: hand out no tensor after a failed copy.
  if (copier_) copier_->throw_if_failed();
  StreamedTensor tensor = std::move(slots_.front().tensor);
  slots_.pop_front();
  ++next_;
  queued_ -= checkpoint_->tensors()[tensor.tensor].bytes;
  lock.unlock();
  // The producer may be waiting for room for its next batch.
  changed_.notify_all();
  return tensor;
}

uint64_t TensorStream::queued_bytes() const {
  std::lock_guard lock(mutex_);
  return queued_;
}

uint64_t TensorStream::peak_queued_bytes() const {
  std::lock_guard lock(mutex_);
  return peak_queued_;
}

}  // namespace weightstream::python
