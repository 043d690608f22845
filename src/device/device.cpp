// The host half of the device layer, built with and without CUDA.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

#include <charconv>
#include <cstdlib>
#include <utility>

#include "device/host_memory.hpp"
#include "device/shared/host_registration.hpp"
#include "weightstream/device.hpp"
#include "weightstream/error.hpp"
#include "weightstream/options.hpp"
#include "base/errno_text.hpp"

namespace weightstream {

std::string Device::name() const {
  return kind == Kind::kCpu ? std::string("cpu") : "cuda:" + std::to_string(index);
}

Device parse_device(std::string_view text) {
  // The same spellings as torch.device, without its "cuda:" aliases for other backends.
  constexpr int kMaxIndex = 1023;
  auto invalid = [&] {
    return "invalid device '" + std::string(text) + "': expected cpu, cuda or cuda:N (N from 0 to " +
           std::to_string(kMaxIndex) + ")";
  };
  if (text == "cpu") return Device{};
  if (text == "cuda") return Device{Device::Kind::kCuda, 0};
  constexpr std::string_view kPrefix = "cuda:";
  WS_EXPECT(text.starts_with(kPrefix) && text.size() > kPrefix.size(), ErrorCode::kInvalidArgument, invalid());
  auto digits = text.substr(kPrefix.size());
  int index = -1;
  auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
  WS_EXPECT(error == std::errc() && end == digits.data() + digits.size() && index >= 0 && index <= kMaxIndex,
            ErrorCode::kInvalidArgument, invalid());
  return Device{Device::Kind::kCuda, index};
}

Buffer::Buffer(Buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      device_(other.device_),
      pinned_(std::exchange(other.pinned_, false)) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    device_ = other.device_;
    pinned_ = std::exchange(other.pinned_, false);
  }
  return *this;
}

Buffer::~Buffer() { release(); }

HostRegistration::HostRegistration(HostRegistration&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)), device_(other.device_) {}

HostRegistration& HostRegistration::operator=(HostRegistration&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    device_ = other.device_;
  }
  return *this;
}

HostRegistration::~HostRegistration() { release(); }

namespace detail {

// Host buffers are anonymous mappings: page-aligned (2 MiB aligned from 2 MiB up) and
// zero-filled by the kernel as each page is first touched, so an arena needs no zeroing pass
// of its own (that pass would be a whole extra first touch of every page).
//
// Transparent huge pages are asked for (MADV_HUGEPAGE) only up to kLargestHugePageAdvice:
// they make first touch cheaper when the kernel has them at hand, but where it must compact
// memory (or a hypervisor must back fresh memory) every advised fault stalls, and a large
// arena would load many times slower (bench/RESULTS.md, "Host memory"). A small buffer
// risks at most a fraction of a second.
constexpr size_t kLargestHugePageAdvice = 64 * 1024 * 1024;
constexpr size_t kHugePageBytes = 2 * 1024 * 1024;

namespace {

size_t page_size() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace

std::byte* allocate_host(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t length = round_up(bytes, page_size());
  const size_t alignment = bytes >= kHugePageBytes ? kHugePageBytes : page_size();
  const size_t reserved = length + alignment - page_size();
  void* base = ::mmap(nullptr, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  WS_EXPECT(base != MAP_FAILED, ErrorCode::kDevice,
            "cpu: cannot allocate " + format_size(bytes) + " of host memory: " + errno_text(errno));
  // Keep the aligned part of the reservation; give back what lies before and after it.
  auto* start = static_cast<std::byte*>(base);
  auto* aligned = reinterpret_cast<std::byte*>(round_up(reinterpret_cast<uintptr_t>(start), alignment));
  if (aligned > start) ::munmap(start, static_cast<size_t>(aligned - start));
  std::byte* end = start + reserved;
  if (aligned + length < end) ::munmap(aligned + length, static_cast<size_t>(end - (aligned + length)));
  // Advice only: where transparent huge pages are off it changes nothing.
  if (alignment == kHugePageBytes && length <= kLargestHugePageAdvice) {
    ::madvise(aligned, length / kHugePageBytes * kHugePageBytes, MADV_HUGEPAGE);
  }
  return aligned;
}

void free_host(std::byte* data, size_t bytes) noexcept {
  if (data) ::munmap(data, round_up(bytes, page_size()));
}

}  // namespace detail
}  // namespace weightstream
