#include "tensor_stream.hpp"

#include <algorithm>
#include <atomic>
#include <vector>

#include "weightstream/error.hpp"

namespace weightstream::python {
namespace {

// Tensors start on 256-byte boundaries in the CUDA landing buffer, as in load_checkpoint's
// arena: aligned direct reads stay aligned.
constexpr uint64_t kLandingAlignment = 256;

uint64_t align_up(uint64_t value) { return (value + kLandingAlignment - 1) / kLandingAlignment * kLandingAlignment; }

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

/// Receives the pieces of one batch. Host tensors are read straight into their own
/// buffers; CUDA tensors land in the pinned landing buffer and are copied to their device
/// buffer when complete. Marks each tensor's slot complete so the iterator can pop it.
class TensorStream::BatchSink final : public TensorSink {
 public:
  BatchSink(TensorStream& stream, size_t first, std::vector<std::byte*> destinations, std::vector<uint64_t> landing_offsets)
      : stream_(stream), first_(first), destinations_(std::move(destinations)), landing_offsets_(std::move(landing_offsets)) {}

  std::byte* direct_destination(size_t request) override {
    if (stream_.device_.is_cuda()) return stream_.landing_->data() + landing_offsets_[request];
    return destinations_[request];
  }

  void consume(TensorPiece&& piece) override {
    // Throwing is how a sink stops stream_tensors: it cancels the other readers at once.
    WS_EXPECT(!stream_.stopping_.load(std::memory_order_relaxed), ErrorCode::kCancelled,
              "stream of " + stream_.checkpoint_->uri() + " cancelled while reading '" + piece.tensor->name + "'");
  }

  void request_complete(size_t request) override {
    size_t position = first_ + request;
    uint64_t bytes = stream_.checkpoint_->tensors()[stream_.order_[position]].bytes;
    if (stream_.device_.is_cuda() && bytes > 0) {
      copy_bytes(destinations_[request], stream_.device_, stream_.landing_->data() + landing_offsets_[request], Device{},
                 bytes);
    }
    {
      std::lock_guard lock(stream_.mutex_);
      stream_.slots_[position - stream_.next_].complete = true;
    }
    stream_.changed_.notify_all();
  }

 private:
  TensorStream& stream_;
  size_t first_;
  std::vector<std::byte*> destinations_;
  std::vector<uint64_t> landing_offsets_;
};

TensorStream::TensorStream(std::shared_ptr<const Checkpoint> checkpoint, const Device& device, const StreamOptions& options,
                           std::vector<size_t> selection)
    : checkpoint_(std::move(checkpoint)),
      device_(device),
      options_(options),
      batch_target_(batch_target_for(options)),
      order_(stream_order(*checkpoint_, std::move(selection))) {
  require_device(device_);
  if (device_.is_cuda()) {
    // One landing buffer serves every batch in turn: batches run one after another.
    const auto& tensors = checkpoint_->tensors();
    uint64_t largest_batch = 0;
    for (size_t first = 0; first < order_.size();) {
      size_t last = batch_end(tensors, order_, first, batch_target_);
      uint64_t bytes = 0;
      for (size_t i = first; i < last; ++i) bytes = align_up(bytes + tensors[order_[i]].bytes);
      largest_batch = std::max(largest_batch, bytes);
      first = last;
    }
    landing_ = std::make_unique<Buffer>(Device{}, std::max<uint64_t>(largest_batch, 1), HostMemory::kPinned);
  }
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
  std::vector<uint64_t> landing_offsets(last - first, 0);
  std::vector<TensorRequest> requests(last - first);
  uint64_t bytes = 0;
  uint64_t landing_end = 0;
  for (size_t position = first; position < last; ++position) {
    size_t request = position - first;
    size_t i = order_[position];
    slots[request].tensor.tensor = i;
    if (tensors[i].bytes > 0) {
      slots[request].tensor.buffer = std::make_unique<Buffer>(device_, tensors[i].bytes);
      destinations[request] = slots[request].tensor.buffer->data();
    }
    landing_offsets[request] = landing_end;
    landing_end = align_up(landing_end + tensors[i].bytes);
    requests[request] = {i, {0, tensors[i].bytes}};
    bytes += tensors[i].bytes;
  }
  {
    std::lock_guard lock(mutex_);
    for (auto& slot : slots) slots_.push_back(std::move(slot));
    queued_ += bytes;
    peak_queued_ = std::max(peak_queued_, queued_);
  }
  BatchSink sink(*this, first, std::move(destinations), std::move(landing_offsets));
  stream_tensors(*checkpoint_, requests, sink, options_, {}, HostMemory::kPinned);
}

std::optional<StreamedTensor> TensorStream::next() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] {
    return cancelled_ || error_ || (!slots_.empty() && slots_.front().complete) || (producer_done_ && slots_.empty());
  });
  if (error_) std::rethrow_exception(error_);
  WS_EXPECT(!cancelled_, ErrorCode::kCancelled, "stream of " + checkpoint_->uri() + " was closed");
  if (slots_.empty()) return std::nullopt;
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
