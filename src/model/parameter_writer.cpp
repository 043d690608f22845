#include "model/parameter_writer.hpp"

#include <cstring>
#include <vector>

#include "weightstream/error.hpp"
#include "weightstream/model.hpp"

namespace weightstream::model {
namespace {

const Device kHost{};

uint64_t element_bytes(Dtype dtype) { return dtype_bits(dtype) / 8; }

/// Rows narrower than this cross from the host as their whole span, not as a 2-D copy: a
/// DMA of rows a few hundred bytes long runs at a fraction of the link (H100, ccafe98: a tp-2
/// rank of an FP8 MoE, whose w2 rows are 384 bytes of 768, bound at 14 GB/s against 32 raw).
constexpr uint64_t kNarrowRowBytes = 4096;
/// ... unless the span holds more than this many times the rows' bytes (a rank of tp 8):
/// then the extra bytes over the link cost more than the short DMAs.
constexpr uint64_t kMostSpanPerRowBytes = 4;

}  // namespace

ParameterWriter::ParameterWriter(const Device& device) : device_(device) {
  if (device.is_cuda()) copier_ = std::make_unique<DeviceCopier>(device);
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
  if (copier_ && !source_device.is_cuda() && width < kNarrowRowBytes && source_pitch <= kMostSpanPerRowBytes * width) {
    // Narrow rows from the host: the span that holds them (the other ranks' columns too)
    // crosses in one copy into device scratch, and a 2-D copy within the GPU, at its memory's
    // rate, picks the rows out. The same lane orders the two copies.
    const unsigned chosen = lane ? *lane : take_lane();
    const uint64_t span = (rows - 1) * source_pitch + width;
    std::shared_ptr<LaneScratch> staged = scratch(span, chosen);
    copier_->copy_to_device(staged->data(), source, span, std::move(keepalive), chosen, what);
    copier_->copy_rows_to_device(destination, destination_pitch, staged->data(), source_pitch, width, rows, staged,
                                 chosen, what);
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

void ParameterWriter::quantize_e4m3(const E4m3BlockJob& job, std::shared_ptr<const void> keepalive, unsigned lane,
                                    std::string_view what) {
  WS_EXPECT(copier_ != nullptr, ErrorCode::kUnsupported,
            "tensor '" + std::string(what) + "': FP8 block quantization on the device asked of a writer into " +
                device_.name());
  quantize_e4m3_blocks(*copier_, lane, job, std::move(keepalive), what);
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
