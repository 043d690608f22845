#include "tensor_stream.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "weightstream/error.hpp"

namespace weightstream::python {
namespace {

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

/// The reads' options: on the host, staging takes half of the limit and the queue of
/// tensors the other half (both are host memory); for a GPU, the options as given.
StreamOptions read_options(const Device& device, StreamOptions options) {
  if (!device.is_cuda()) options.memory_limit = std::max<uint64_t>(options.memory_limit / 2, kMinStagingBytes);
  return options;
}

}  // namespace

/// The keepalive of one piece's copy to the device: holds the piece's source (a staging
/// lease or a registered window) and, once the copier drops it after the copy landed, counts
/// the piece off its tensor. The copier is destroyed (waiting for its copies) before the
/// stream's state, so the stream outlives every landing.
class TensorStream::PieceLanding {
 public:
  PieceLanding(TensorStream& stream, size_t position, std::shared_ptr<const void> source)
      : stream_(stream), position_(position), source_(std::move(source)) {}
  ~PieceLanding() {
    source_.reset();  // the staging buffer goes back to its pool first
    stream_.count_off(position_);
  }
  PieceLanding(const PieceLanding&) = delete;
  PieceLanding& operator=(const PieceLanding&) = delete;

 private:
  TensorStream& stream_;
  size_t position_;
  std::shared_ptr<const void> source_;
};

/// Receives the pieces of the stream; request i is the tensor at position i of order_. A
/// piece waits for its tensor's admission, then lands: on the host it is copied out of
/// staging into the tensor's buffer; for a GPU the stream's DeviceCopier copies it
/// asynchronously from wherever the device path put it (pinned staging or a registered
/// window of a mapped shard), and the tensor is complete once its last copy landed: nothing
/// waits per piece or per tensor.
class TensorStream::Sink final : public TensorSink {
 public:
  explicit Sink(TensorStream& stream) : stream_(stream) {}

  void consume(TensorPiece&& piece) override {
    // Throwing is how a sink stops stream_tensors: it cancels the other readers at once.
    WS_EXPECT(!stream_.stopping_.load(std::memory_order_relaxed), ErrorCode::kCancelled,
              "stream of " + stream_.checkpoint_->uri() + " stopped while reading '" + piece.tensor->name + "'");
    std::byte* destination = stream_.destination_once_admitted(piece.request) + piece.offset;
    if (!stream_.copier_) {
      std::memcpy(destination, piece.bytes.data(), piece.bytes.size());
      return;
    }
    stream_.outstanding_[piece.request].fetch_add(1, std::memory_order_relaxed);
    auto landing = std::make_shared<PieceLanding>(stream_, piece.request, std::move(piece.keepalive));
    stream_.copier_->copy_to_device(destination, piece.bytes.data(), piece.bytes.size(), std::move(landing),
                                    static_cast<unsigned>(piece.request), piece.tensor->name);
  }

  void request_complete(size_t request) override { stream_.count_off(request); }

 private:
  TensorStream& stream_;
};

TensorStream::TensorStream(std::shared_ptr<const Checkpoint> checkpoint, const Device& device, const StreamOptions& options,
                           std::vector<size_t> selection)
    : checkpoint_(std::move(checkpoint)),
      device_(device),
      options_(read_options(device, options)),
      // The rest of the limit: all of it for a GPU, the half staging left on the host.
      queue_limit_(device.is_cuda() ? options.memory_limit
                                    : options.memory_limit - std::min(options.memory_limit, options_.memory_limit)),
      order_(stream_order(*checkpoint_, std::move(selection))),
      buffers_(order_.size()),
      destinations_(order_.size(), nullptr),
      complete_(order_.size(), 0),
      outstanding_(order_.size()) {
  require_device(device_);
  for (auto& count : outstanding_) count.store(1, std::memory_order_relaxed);
  if (device_.is_cuda()) copier_ = std::make_unique<DeviceCopier>(device_);
  admitter_ = std::thread([this] { admit_all(); });
  try {
    reader_ = std::thread([this] { read_all(); });
  } catch (...) {
    cancel();
    throw;
  }
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
  if (reader_.joinable()) reader_.join();
  if (admitter_.joinable()) admitter_.join();
}

void TensorStream::fail(std::exception_ptr error) noexcept {
  {
    std::lock_guard lock(mutex_);
    // A failure caused by cancel() is no error: nobody is waiting for the stream any more.
    if (!cancelled_ && !error_) error_ = error;
    stopping_.store(true, std::memory_order_relaxed);
  }
  changed_.notify_all();
}

void TensorStream::read_all() noexcept {
  try {
    const auto& tensors = checkpoint_->tensors();
    std::vector<TensorRequest> requests(order_.size());
    for (size_t position = 0; position < order_.size(); ++position) {
      requests[position] = {order_[position], {0, tensors[order_[position]].bytes}};
    }
    Sink sink(*this);
    stream_tensors_for_device(device_, *checkpoint_, requests, sink, options_);
  } catch (...) {
    fail(std::current_exception());
  }
}

void TensorStream::admit_all() noexcept {
  try {
    const auto& tensors = checkpoint_->tensors();
    for (size_t position = 0; position < order_.size(); ++position) {
      uint64_t bytes = tensors[order_[position]].bytes;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] {
          return stopping_.load(std::memory_order_relaxed) || queued_ == 0 || queued_ + bytes <= queue_limit_;
        });
        if (stopping_.load(std::memory_order_relaxed)) return;
        queued_ += bytes;  // counted before the allocation, so the bound holds while it runs
        peak_queued_ = std::max(peak_queued_, queued_);
      }
      // Allocated off the readers' threads (a cudaMalloc takes the driver's lock), ahead of them.
      auto buffer = bytes > 0 ? std::make_unique<Buffer>(device_, bytes) : nullptr;
      {
        std::lock_guard lock(mutex_);
        destinations_[position] = buffer ? buffer->data() : nullptr;
        buffers_[position] = std::move(buffer);
        admitted_.store(position + 1, std::memory_order_release);
      }
      changed_.notify_all();
    }
  } catch (...) {
    fail(std::current_exception());
  }
}

std::byte* TensorStream::destination_once_admitted(size_t position) {
  if (position < admitted_.load(std::memory_order_acquire)) return destinations_[position];
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] {
    return stopping_.load(std::memory_order_relaxed) || position < admitted_.load(std::memory_order_relaxed);
  });
  WS_EXPECT(position < admitted_.load(std::memory_order_relaxed), ErrorCode::kCancelled,
            "stream of " + checkpoint_->uri() + " stopped before '" + checkpoint_->tensors()[order_[position]].name +
                "' had room");
  return destinations_[position];
}

void TensorStream::count_off(size_t position) {
  if (outstanding_[position].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  {
    std::lock_guard lock(mutex_);
    complete_[position] = 1;
  }
  changed_.notify_all();
}

std::optional<StreamedTensor> TensorStream::next() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] {
    return cancelled_ || error_ || next_ == order_.size() ||
           (next_ < admitted_.load(std::memory_order_relaxed) && complete_[next_]);
  });
  if (error_) std::rethrow_exception(error_);
  WS_EXPECT(!cancelled_, ErrorCode::kCancelled, "stream of " + checkpoint_->uri() + " was closed");
  if (next_ == order_.size()) return std::nullopt;
  // A copy that failed still counts its piece off: hand out no tensor after a failed copy.
  if (copier_) copier_->throw_if_failed();
  StreamedTensor tensor{order_[next_], std::move(buffers_[next_])};
  queued_ -= checkpoint_->tensors()[tensor.tensor].bytes;
  ++next_;
  lock.unlock();
  // The admitter may be waiting for room for the next tensor.
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
