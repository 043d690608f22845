#include "model/parameter_writer.hpp"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "weightstream/error.hpp"
#include "weightstream/model.hpp"
#include "weightstream/options.hpp"

namespace weightstream::model {
namespace {

const Device kHost{};

uint64_t element_bytes(Dtype dtype) { return dtype_bits(dtype) / 8; }

/// Rows narrower than this cross from the host as their whole span, not as a 2-D copy: a
/// DMA of rows a few hundred bytes long runs at a fraction of the link (bench/HISTORY.md,
/// "Narrow rows": a tp-2 rank of an FP8 MoE, whose w2 rows are 384 bytes of 768).
constexpr uint64_t kNarrowRowBytes = 4096;
/// ... unless the span holds more than this many times the rows' bytes (a rank of tp 8):
/// then the extra bytes over the link cost more than the short DMAs.
constexpr uint64_t kMostSpanPerRowBytes = 4;
/// copy_from_host(): runs this large cross on their own (a landing would add a pass through
/// device memory and hold scratch for nothing), and a landing copy is at most this large...
constexpr uint64_t kLandingBytes = 4 * kMiB;
/// ... and spans gaps of at most this many bytes between the sources it lands.
constexpr uint64_t kLandingGapBytes = 64 * 1024;

/// Narrow rows further apart than kMostSpanPerRowBytes times their width are gathered on the
/// CPU into pinned buffers of this size (a rank of tp 8 keeps an eighth of every row of
/// o_proj and down_proj: a 2-D copy of such rows runs at a fraction of the link, and a span
/// would carry eight times the bytes) ...
constexpr uint64_t kGatherBufferBytes = 4 * kMiB;
/// ... of which a writer keeps at most this many; rows that find none free take a 2-D copy.
constexpr size_t kMostGatherBuffers = 16;

/// The first byte past a rectangle's source.
const std::byte* source_end(const ParameterWriter::HostCopy& copy) {
  return copy.source + (copy.rows - 1) * copy.source_pitch + copy.width;
}

}  // namespace

/// Pinned host buffers of kGatherBufferBytes, made on demand up to kMostGatherBuffers and
/// lent out; a buffer comes back when the last holder of what lent it lets go (the copy out
/// of it has landed).
class ParameterWriter::GatherPool : public std::enable_shared_from_this<GatherPool> {
 public:
  /// A free buffer, or null when all kMostGatherBuffers are lent. Throws Error(kDevice) when
  /// pinning a new one fails.
  std::shared_ptr<std::byte> take() {
    Buffer buffer;
    {
      std::lock_guard lock(mutex_);
      if (!free_.empty()) {
        buffer = std::move(free_.back());
        free_.pop_back();
      } else if (made_ < kMostGatherBuffers) {
        ++made_;
      } else {
        return nullptr;
      }
    }
    if (buffer.size() == 0) {
      try {
        buffer = Buffer(kHost, kGatherBufferBytes, HostMemory::kPinned);
      } catch (...) {
        std::lock_guard lock(mutex_);
        --made_;
        throw;
      }
    }
    auto* held = new Buffer(std::move(buffer));
    return std::shared_ptr<std::byte>(held->data(), [pool = shared_from_this(), held](std::byte*) {
      std::lock_guard lock(pool->mutex_);
      pool->free_.push_back(std::move(*held));
      delete held;
    });
  }

 private:
  std::mutex mutex_;
  std::vector<Buffer> free_;
  size_t made_ = 0;
};

ParameterWriter::ParameterWriter(const Device& device) : device_(device) {
  if (device.is_cuda()) {
    copier_ = std::make_unique<DeviceCopier>(device);
    gather_pool_ = std::make_shared<GatherPool>();
  }
}

bool ParameterWriter::gather_rows(std::byte* destination, uint64_t destination_pitch, const std::byte* source,
                                  uint64_t source_pitch, uint64_t width, uint64_t rows, unsigned lane,
                                  std::string_view what) {
  std::shared_ptr<std::byte> gathered = gather_pool_->take();
  if (!gathered) return false;
  for (uint64_t row = 0; row < rows; ++row) std::memcpy(gathered.get() + row * width, source + row * source_pitch, width);
  if (destination_pitch == width) {
    // A compact part (every part is, in its parameter or its staging): one contiguous copy.
    copier_->copy_to_device(destination, gathered.get(), rows * width, gathered, lane, what);
  } else {
    const ScatterRange range{destination, destination_pitch, 0, width, width, rows};
    land_and_scatter(*copier_, lane, gathered.get(), rows * width, std::span(&range, 1), gathered, what);
  }
  return true;
}

ParameterWriter::~ParameterWriter() = default;  // the copier waits for its copies

void ParameterWriter::copy(std::byte* destination, const std::byte* source, const Device& source_device,
                           uint64_t bytes, std::shared_ptr<const void> keepalive, std::string_view what,
                           std::optional<unsigned> lane) {
  if (bytes == 0 || destination == source) return;
  if (copier_ && (!source_device.is_cuda() || source_device == device_)) {
    copier_->copy_to_device(destination, source, bytes, std::move(keepalive), lane ? *lane : take_lane(), what);
    return;
  }
  copy_bytes(destination, device_, source, source_device, bytes);
  if (copier_) copied_between_devices();
}

void ParameterWriter::copy_rows(std::byte* destination, uint64_t destination_pitch, const std::byte* source,
                                const Device& source_device, uint64_t source_pitch, uint64_t width, uint64_t rows,
                                std::shared_ptr<const void> keepalive, std::string_view what,
                                std::optional<unsigned> lane) {
  if (width == 0 || rows == 0) return;
  if (rows == 1 || (width == source_pitch && width == destination_pitch)) {
    return copy(destination, source, source_device, (rows - 1) * source_pitch + width, std::move(keepalive), what, lane);
  }
  if (copier_ && !source_device.is_cuda() && gathers(width, rows, source_pitch, destination_pitch) &&
      gather_rows(destination, destination_pitch, source, source_pitch, width, rows, lane ? *lane : take_lane(), what)) {
    return;  // the source is no longer needed: its rows were copied out on the CPU
  }
  if (copier_ && !source_device.is_cuda() && lands(width, rows, source_pitch, destination_pitch)) {
    // Narrow rows from the host: the span that holds them (the other ranks' columns too)
    // crosses in one copy into device scratch, and a kernel picks the rows out at the
    // device memory's rate. The same lane orders the two.
    const uint64_t span = (rows - 1) * source_pitch + width;
    const ScatterRange range{destination, destination_pitch, 0, source_pitch, width, rows};
    land_and_scatter(*copier_, lane ? *lane : take_lane(), source, span, std::span(&range, 1), std::move(keepalive), what);
    return;
  }
  if (copier_ && (!source_device.is_cuda() || source_device == device_)) {
    copier_->copy_rows_to_device(destination, destination_pitch, source, source_pitch, width, rows,
                                 std::move(keepalive), lane ? *lane : take_lane(), what);
    return;
  }
  for (uint64_t row = 0; row < rows; ++row) {
    copy_bytes(destination + row * destination_pitch, device_, source + row * source_pitch, source_device, width);
  }
  if (copier_) copied_between_devices();
}

bool ParameterWriter::gathers(uint64_t width, uint64_t rows, uint64_t source_pitch, uint64_t destination_pitch) const {
  return copier_ && width < kNarrowRowBytes && source_pitch > kMostSpanPerRowBytes * width &&
         rows * width <= kGatherBufferBytes && (destination_pitch == width || device_scatters());
}

bool ParameterWriter::lands(uint64_t width, uint64_t rows, uint64_t source_pitch, uint64_t destination_pitch) const {
  if (!copier_ || !device_scatters() || width == 0 || rows == 0) return false;
  if (width > kMostScatterField || rows > kMostScatterField || source_pitch > kMostScatterField ||
      destination_pitch > kMostScatterField) {
    return false;
  }
  if (rows == 1) return width < kLandingBytes;
  return width < kNarrowRowBytes && source_pitch <= kMostSpanPerRowBytes * width;
}

void ParameterWriter::copy_from_host(std::span<const HostCopy> copies, std::shared_ptr<const void> keepalive,
                                     std::string_view what) {
  std::vector<const HostCopy*> landed;
  std::vector<HostCopy> compact;  // rectangles whose rows meet on both sides, as one run each
  compact.reserve(copies.size());
  for (const HostCopy& copy : copies) {
    compact.push_back(copy);
    if (copy.rows > 1 && copy.source_pitch == copy.width && copy.destination_pitch == copy.width) {
      compact.back().width = copy.width * copy.rows;  // a packed column window into a compact part
      compact.back().source_pitch = compact.back().destination_pitch = compact.back().width;
      compact.back().rows = 1;
    }
  }
  for (const HostCopy& copy : compact) {
    // Bytes a transport landed in place already (source == destination) copy nothing.
    if (copy.width == 0 || copy.rows == 0 || copy.source == copy.destination) continue;
    if (copies.size() > 1 && copy.allocation != nullptr &&
        lands(copy.width, copy.rows, copy.source_pitch, copy.destination_pitch) &&
        static_cast<uint64_t>(source_end(copy) - copy.source) <= kLandingBytes) {
      landed.push_back(&copy);
      continue;
    }
    copy_rows(copy.destination, copy.destination_pitch, copy.source, kHost, copy.source_pitch, copy.width, copy.rows,
              keepalive, what);
  }
  // The rest in groups of close sources, in source order: one landing copy and one launch each.
  std::sort(landed.begin(), landed.end(), [](const HostCopy* a, const HostCopy* b) {
    return a->allocation != b->allocation ? std::less<const void*>()(a->allocation, b->allocation) : a->source < b->source;
  });
  std::vector<ScatterRange> ranges;
  for (size_t first = 0; first < landed.size();) {
    const std::byte* begin = landed[first]->source;
    const std::byte* end = source_end(*landed[first]);
    size_t last = first + 1;
    for (; last < landed.size(); ++last) {
      const std::byte* next_end = std::max(end, source_end(*landed[last]));
      if (landed[last]->allocation != landed[first]->allocation || landed[last]->source > end + kLandingGapBytes ||
          static_cast<uint64_t>(next_end - begin) > kLandingBytes) {
        break;
      }
      end = next_end;
    }
    if (last - first == 1 && landed[first]->rows == 1) {
      const HostCopy& copy = *landed[first];
      this->copy(copy.destination, copy.source, kHost, copy.width, keepalive, what);
    } else {
      ranges.clear();
      for (size_t i = first; i < last; ++i) {
        const HostCopy& copy = *landed[i];
        ranges.push_back({copy.destination, copy.destination_pitch, static_cast<uint64_t>(copy.source - begin),
                          copy.source_pitch, copy.width, copy.rows});
      }
      land_and_scatter(*copier_, take_lane(), begin, static_cast<uint64_t>(end - begin), ranges, keepalive, what);
    }
    first = last;
  }
}

void ParameterWriter::copy_ranges(std::span<const CopyRange> ranges, const Device& source_device,
                                  std::vector<std::shared_ptr<const void>> keepalives) {
  if (ranges.empty()) return;
  if (!copier_ || !source_device.is_cuda()) return copy_batch(device_, ranges);
  WS_EXPECT(source_device == device_, ErrorCode::kInvalidArgument,
            "a batch of copies into " + device_.name() + " has sources on " + source_device.name() +
                "; only sources in host memory or in " + device_.name() + " are batched");
  std::lock_guard lock(gather_mutex_);
  if (!gathers_) gathers_.emplace(device_);
  gathers_->gather(ranges);
  for (auto& keepalive : keepalives) {
    if (keepalive) gather_keepalives_.push_back(std::move(keepalive));
  }
}

std::shared_ptr<LaneScratch> ParameterWriter::scratch(uint64_t bytes, unsigned lane) {
  WS_EXPECT(copier_ != nullptr, ErrorCode::kInvalidArgument, "device scratch asked of a writer into " + device_.name());
  return std::make_shared<LaneScratch>(*copier_, lane, bytes);
}

void ParameterWriter::quantize_e4m3(std::span<const E4m3BlockJob> jobs, std::shared_ptr<const void> keepalive, unsigned lane,
                                    std::string_view what) {
  WS_EXPECT(copier_ != nullptr, ErrorCode::kUnsupported,
            std::string(what) + ": FP8 block quantization on the device asked of a writer into " +
                device_.name());
  quantize_e4m3_blocks(*copier_, lane, jobs, std::move(keepalive), what);
}

void ParameterWriter::wait() {
  if (!copier_) return;
  copier_->synchronize();
  {
    std::lock_guard lock(gather_mutex_);
    if (gathers_) gathers_->wait();
    gather_keepalives_.clear();
  }
  if (between_devices_.exchange(false, std::memory_order_relaxed)) wait_for_copies(device_);
}

void copy_elements(std::byte* destination, const Device& destination_device, Dtype destination_dtype,
                   const std::byte* source, const Device& source_device, Dtype source_dtype, uint64_t elements) {
  if (elements == 0) return;
  if (destination_dtype == source_dtype) {
    copy_bytes(destination, destination_device, source, source_device, elements * element_bytes(source_dtype));
    return;
  }
  // Conversion is host code: bring device bytes to the host first, land the result after.
  std::vector<std::byte> host_source;
  const std::byte* from = source;
  if (source_device.is_cuda()) {
    host_source.resize(elements * element_bytes(source_dtype));
    copy_bytes(host_source.data(), kHost, source, source_device, host_source.size());
    from = host_source.data();
  }
  if (!destination_device.is_cuda()) {
    convert_elements(destination, destination_dtype, from, source_dtype, elements);
    return;
  }
  std::vector<std::byte> host_destination(elements * element_bytes(destination_dtype));
  convert_elements(host_destination.data(), destination_dtype, from, source_dtype, elements);
  copy_bytes(destination, destination_device, host_destination.data(), kHost, host_destination.size());
}

}  // namespace weightstream::model
