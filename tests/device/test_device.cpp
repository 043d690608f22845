// Tests of the device layer. Host paths run everywhere; CUDA paths skip with a message
// where the build has no CUDA or the machine no GPU (scripts/gpu.sh runs them on one).
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include <xxhash.h>

#include "support/test_support.hpp"
#include "device/shared/copies.hpp"
#include "device/shared/digests.hpp"
#include "device/shared/host_registration.hpp"
#include "weightstream/device.hpp"
#include "weightstream/error.hpp"
#include "weightstream/options.hpp"
#include "support/skip_without_gpu.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;

const Device kCpu{};
const Device kCuda0{Device::Kind::kCuda, 0};

/// The message and code of the Error that `call` throws.
template <typename Call>
Error thrown_by(Call&& call) {
  try {
    call();
  } catch (const Error& error) {
    return error;
  }
  ADD_FAILURE() << "expected a weightstream::Error";
  return Error(ErrorCode::kInternal, "nothing thrown");
}

std::vector<std::byte> pattern(size_t bytes, unsigned seed) {
  std::vector<std::byte> data(bytes);
  uint32_t state = seed * 2654435761u + 1;
  for (auto& byte : data) {
    state = state * 1664525u + 1013904223u;
    byte = static_cast<std::byte>(state >> 24);
  }
  return data;
}

TEST(Device, Names) {
  EXPECT_EQ(kCpu.name(), "cpu");
  EXPECT_EQ((Device{Device::Kind::kCuda, 3}).name(), "cuda:3");
  EXPECT_FALSE(kCpu.is_cuda());
  EXPECT_TRUE(kCuda0.is_cuda());
}

TEST(Device, ParsesTorchSpellings) {
  EXPECT_EQ(parse_device("cpu"), kCpu);
  EXPECT_EQ(parse_device("cuda"), kCuda0);
  EXPECT_EQ(parse_device("cuda:0"), kCuda0);
  EXPECT_EQ(parse_device("cuda:7"), (Device{Device::Kind::kCuda, 7}));
}

TEST(Device, RejectsMalformedNames) {
  for (const char* text : {"", "gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1x", "cuda:99999", "CUDA:0", " cpu"}) {
    auto error = thrown_by([&] { parse_device(text); });
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << text;
    EXPECT_THAT(error.what(), HasSubstr("invalid device '" + std::string(text) + "'"));
    EXPECT_THAT(error.what(), HasSubstr("expected cpu, cuda or cuda:N"));
  }
}

TEST(Device, CpuIsAlwaysUsable) { EXPECT_NO_THROW(require_device(kCpu)); }

TEST(Device, CountAgreesWithTheDevicesThatCanBeUsed) {
  const int count = cuda_device_count();
  if (!cuda_compiled()) EXPECT_EQ(count, 0);
  // Every index below the count is usable, and the first one past it is refused by name.
  for (int index = 0; index < count; ++index) {
    EXPECT_NO_THROW(require_device(Device{Device::Kind::kCuda, index})) << "cuda:" << index;
  }
  const Device past{Device::Kind::kCuda, count};
  auto error = thrown_by([&] { require_device(past); });
  EXPECT_THAT(error.what(), HasSubstr(past.name()));
}

TEST(Device, MissingGpuIsReportedNotCrashed) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has a GPU; see OutOfRangeIndex";
  auto error = thrown_by([] { require_device(kCuda0); });
  EXPECT_THAT(error.what(), HasSubstr("cuda:0"));
  if (cuda_compiled()) {
    EXPECT_EQ(error.code(), ErrorCode::kDevice);
    EXPECT_THAT(error.what(), HasSubstr("no usable CUDA device"));
  } else {
    EXPECT_EQ(error.code(), ErrorCode::kUnsupported);
    EXPECT_THAT(error.what(), HasSubstr("no CUDA support"));
  }
  // Every CUDA request fails the same way, and none of them crashes.
  EXPECT_THROW(Buffer(kCuda0, 4096), Error);
  std::byte host[16] = {};
  EXPECT_THROW(copy_bytes(host, kCpu, host, kCuda0, sizeof(host)), Error);
  EXPECT_THROW(DeviceCopier(kCuda0, 2), Error);
  EXPECT_THROW(HostRegistration(kCuda0, host, sizeof(host)), Error);
}

TEST(Buffer, HostMemoryIsPageAligned) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  for (auto kind : {HostMemory::kPageable, HostMemory::kPinned}) {
    Buffer buffer(kCpu, 3 * page + 5, kind);
    ASSERT_NE(buffer.data(), nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % page, 0u);
    EXPECT_EQ(buffer.size(), 3 * page + 5);
    EXPECT_EQ(buffer.device(), kCpu);
    // Pinned only where a GPU can pin it; page-aligned memory otherwise.
    EXPECT_EQ(buffer.pinned(), kind == HostMemory::kPinned && cuda_device_count() > 0);
    std::memset(buffer.data(), 0xab, buffer.size());
  }
}

TEST(Buffer, HostMemoryIsZeroFilledAndLargeBuffersAre2MiBAligned) {
  // A layout's host arena relies on this: it is not zeroed again (session 6).
  constexpr size_t kMiB = 1 << 20;
  for (size_t bytes : {size_t{1}, size_t{4097}, 3 * kMiB + 5, 80 * kMiB + 3}) {
    for (int round = 0; round < 2; ++round) {  // the second round gets memory the first freed
      Buffer buffer(kCpu, bytes);
      ASSERT_NE(buffer.data(), nullptr);
      if (bytes >= 2 * kMiB) EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % (2 * kMiB), 0u) << bytes;
      size_t nonzero = 0;
      for (size_t i = 0; i < bytes; i += (i % 4096 == 0 ? 1 : 4093)) nonzero += buffer.data()[i] != std::byte{0};
      nonzero += buffer.data()[bytes - 1] != std::byte{0};
      EXPECT_EQ(nonzero, 0u) << bytes << " bytes, round " << round;
      std::memset(buffer.data(), 0xcd, bytes);
    }
  }
}

TEST(Buffer, EmptyAndMoved) {
  Buffer empty(kCpu, 0);
  EXPECT_EQ(empty.data(), nullptr);
  EXPECT_EQ(empty.size(), 0u);

  Buffer first(kCpu, 4096);
  std::byte* data = first.data();
  Buffer second(std::move(first));
  EXPECT_EQ(second.data(), data);
  EXPECT_EQ(first.data(), nullptr);  // NOLINT(bugprone-use-after-move): moved-from state is specified
  Buffer third(kCpu, 8192, HostMemory::kPinned);
  third = std::move(second);
  EXPECT_EQ(third.data(), data);
  EXPECT_EQ(third.size(), 4096u);
}

TEST(Buffer, HostToHostCopy) {
  auto source = pattern(10000, 1);
  Buffer buffer(kCpu, source.size());
  copy_bytes(buffer.data(), kCpu, source.data(), kCpu, source.size());
  EXPECT_EQ(std::memcmp(buffer.data(), source.data(), source.size()), 0);
  copy_bytes(nullptr, kCpu, nullptr, kCpu, 0);  // an empty copy touches nothing
}

/// Ranges of `count` pieces of uneven sizes (0 included) that tile [0, total) of a and b.
std::vector<CopyRange> tiled_ranges(std::byte* destination, const std::byte* source, size_t count, size_t* total) {
  std::vector<CopyRange> ranges;
  size_t offset = 0;
  for (size_t i = 0; i < count; ++i) {
    size_t bytes = (i * 7919) % 5000;  // 0 to 4999 bytes
    ranges.push_back({destination + offset, source + offset, bytes});
    offset += bytes;
  }
  *total = offset;
  return ranges;
}

TEST(Buffer, HostBatchCopiesEveryRange) {
  auto source = pattern(5000 * 300, 4);
  std::vector<std::byte> destination(source.size());
  size_t total = 0;
  auto ranges = tiled_ranges(destination.data(), source.data(), 300, &total);
  copy_batch(kCpu, ranges);
  EXPECT_EQ(std::memcmp(destination.data(), source.data(), total), 0);
  copy_batch(kCpu, {});  // an empty batch touches nothing
}

TEST(CopyQueue, OnTheHostGathersCopyAtOnce) {
  auto source = pattern(3000 * 100, 6);
  std::vector<std::byte> destination(source.size());
  size_t total = 0;
  auto ranges = tiled_ranges(destination.data(), source.data(), 100, &total);
  CopyQueue queue(kCpu);
  queue.gather(ranges);
  EXPECT_FALSE(queue.pending());
  EXPECT_EQ(std::memcmp(destination.data(), source.data(), total), 0);
  queue.wait();
}

// ---- CUDA paths: skip without a GPU -------------------------------------------------------

TEST(Cuda, CopyQueueOverlapsGathersAndWaitsForAll) {
  WS_SKIP_WITHOUT_GPU();
  // Many gathers of many ranges, more work items than the queue's first arrays hold (it
  // must regrow after waiting, never under copies in flight), then one wait.
  constexpr size_t kRanges = 3000;
  constexpr int kGathers = 8;
  auto source = pattern(4000 * kRanges, 7);
  Buffer from(kCuda0, source.size());
  copy_bytes(from.data(), kCuda0, source.data(), kCpu, source.size());
  std::vector<Buffer> targets;
  CopyQueue queue(kCuda0);
  size_t total = 0;
  for (int g = 0; g < kGathers; ++g) {
    targets.emplace_back(kCuda0, source.size());
    auto ranges = tiled_ranges(targets.back().data(), from.data(), kRanges, &total);
    queue.gather(ranges);
    EXPECT_TRUE(queue.pending());
  }
  queue.wait();
  EXPECT_FALSE(queue.pending());
  std::vector<std::byte> back(total);
  for (const Buffer& target : targets) {
    copy_bytes(back.data(), kCpu, target.data(), kCuda0, total);
    ASSERT_EQ(std::memcmp(back.data(), source.data(), total), 0);
  }
}

TEST(Cuda, LandAndScatterWritesEveryRectangleOfOneLandedCopy) {
  WS_SKIP_WITHOUT_GPU();
  // 300 rectangles (more than one launch takes) out of one pinned source: runs of every
  // alignment and narrow rows of a column window, from 1 byte wide to 4 KiB.
  auto source = pattern(4 * kMiB, 11);
  Buffer pinned(kCpu, source.size(), HostMemory::kPinned);
  std::memcpy(pinned.data(), source.data(), source.size());
  Buffer target(kCuda0, 8 * kMiB);
  fill_zero(target.data(), kCuda0, target.size());
  std::vector<std::byte> expected(target.size(), std::byte{0});
  std::vector<ScatterRange> ranges;
  uint64_t read = 0, written = 0;
  for (unsigned i = 0; i < 300; ++i) {
    ScatterRange range;
    range.width = i % 3 == 2 ? 1 + (i * 37) % 4096 : 1 + (i * 97) % 9000;
    range.rows = i % 3 == 2 ? 1 + i % 17 : 1;
    range.source_pitch = range.width + (range.rows > 1 ? i % 29 : 0);
    range.destination_pitch = range.width + (i % 5);
    range.source_offset = read + i % 16;
    written += i % 16;  // destinations of every alignment too
    range.destination = target.data() + written;
    const uint64_t extent = (range.rows - 1) * range.source_pitch + range.width;
    const uint64_t landed_extent = (range.rows - 1) * range.destination_pitch + range.width;
    ASSERT_LE(range.source_offset + extent, source.size());
    ASSERT_LE(written + landed_extent, target.size());
    for (uint64_t row = 0; row < range.rows; ++row) {
      std::memcpy(expected.data() + written + row * range.destination_pitch,
                  source.data() + range.source_offset + row * range.source_pitch, range.width);
    }
    read = range.source_offset + extent;
    written += landed_extent;
    ranges.push_back(range);
  }
  DeviceCopier copier(kCuda0);
  std::atomic<bool> released{false};
  auto keepalive = std::shared_ptr<const void>(pinned.data(), [&](const void*) { released = true; });
  land_and_scatter(copier, 1, pinned.data(), read, ranges, std::move(keepalive), "test batch");
  copier.synchronize();
  EXPECT_TRUE(released.load());
  std::vector<std::byte> back(target.size());
  copy_bytes(back.data(), kCpu, target.data(), kCuda0, back.size());
  EXPECT_EQ(std::memcmp(back.data(), expected.data(), back.size()), 0);
}

TEST(Cuda, LandAndScatterRefusesARangeOutsideTheLandedBytes) {
  WS_SKIP_WITHOUT_GPU();
  Buffer pinned(kCpu, 4096, HostMemory::kPinned);
  Buffer target(kCuda0, 4096);
  DeviceCopier copier(kCuda0);
  ScatterRange range{target.data(), 100, 4000, 200, 100, 2};  // reads 4000+300 of 4096
  try {
    land_and_scatter(copier, 0, pinned.data(), 4096, std::span(&range, 1), nullptr, "batch 'x'");
    FAIL() << "a range past the landed bytes was scattered";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(error.what(), HasSubstr("cuda:0: cannot scatter batch 'x': 1 ranges landed in 4096 bytes: a range reads "
                                        "bytes 4000+300, outside them"));
  }
}

TEST(Cuda, Xxh64OnDeviceEqualsTheHostLibrary) {
  WS_SKIP_WITHOUT_GPU();
  auto data = pattern(3 * kMiB, 13);
  Buffer on_device(kCuda0, data.size());
  copy_bytes(on_device.data(), kCuda0, data.data(), kCpu, data.size());
  // Every tail length of the algorithm (stripes of 32, words of 8 and 4, single bytes), at
  // aligned and unaligned starts, and pieces of the manifest's 512 KiB.
  std::vector<DeviceDigestRange> ranges;
  std::vector<uint64_t> expected;
  for (uint64_t length : {0ull, 1ull, 3ull, 4ull, 7ull, 8ull, 12ull, 31ull, 32ull, 33ull, 63ull, 64ull, 100ull,
                          1000ull, 4096ull, 512ull * 1024, 512ull * 1024 + 5}) {
    for (uint64_t offset : {0ull, 1ull, 4ull, 8ull, 13ull}) {
      ranges.push_back({on_device.data() + offset * 1000, length});
      expected.push_back(XXH64(data.data() + offset * 1000, length, 0));
    }
  }
  EXPECT_EQ(xxh64_on_device(kCuda0, ranges), expected);
}

TEST(Cuda, DeviceBatchCopiesThousandsOfRanges) {
  WS_SKIP_WITHOUT_GPU();
  constexpr size_t kRanges = 5000;
  auto source = pattern(5000 * kRanges, 5);
  Buffer from(kCuda0, source.size());
  Buffer to(kCuda0, source.size());
  copy_bytes(from.data(), kCuda0, source.data(), kCpu, source.size());
  size_t total = 0;
  auto ranges = tiled_ranges(to.data(), from.data(), kRanges, &total);
  copy_batch(kCuda0, ranges);  // device to device, waited for
  std::vector<std::byte> back(total);
  copy_bytes(back.data(), kCpu, to.data(), kCuda0, total);
  EXPECT_EQ(std::memcmp(back.data(), source.data(), total), 0);
  // Host to device in one batch too (pageable sources).
  Buffer again(kCuda0, source.size());
  auto uploads = tiled_ranges(again.data(), source.data(), kRanges, &total);
  copy_batch(kCuda0, uploads);
  copy_bytes(back.data(), kCpu, again.data(), kCuda0, total);
  EXPECT_EQ(std::memcmp(back.data(), source.data(), total), 0);
}

TEST(Cuda, OutOfRangeIndex) {
  WS_SKIP_WITHOUT_GPU();
  Device missing{Device::Kind::kCuda, cuda_device_count()};
  auto error = thrown_by([&] { require_device(missing); });
  EXPECT_EQ(error.code(), ErrorCode::kDevice);
  EXPECT_THAT(error.what(), HasSubstr(missing.name() + ": invalid device ordinal"));
  EXPECT_THAT(error.what(), HasSubstr("this machine has " + std::to_string(cuda_device_count()) + " CUDA device"));
  EXPECT_THROW(Buffer(missing, 4096), Error);
}

TEST(Cuda, DeviceBufferRoundTrip) {
  WS_SKIP_WITHOUT_GPU();
  auto source = pattern(3 * 1024 * 1024 + 17, 2);
  Buffer device(kCuda0, source.size());
  EXPECT_EQ(device.device(), kCuda0);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(device.data()) % 256, 0u);
  copy_bytes(device.data(), kCuda0, source.data(), kCpu, source.size());
  Buffer other(kCuda0, source.size());
  copy_bytes(other.data(), kCuda0, device.data(), kCuda0, source.size());
  std::vector<std::byte> back(source.size());
  copy_bytes(back.data(), kCpu, other.data(), kCuda0, back.size());
  EXPECT_EQ(back, source);
}

TEST(Cuda, OutOfMemoryNamesDeviceAndCause) {
  WS_SKIP_WITHOUT_GPU();
  auto error = thrown_by([] { Buffer(kCuda0, size_t{1} << 50); });
  EXPECT_EQ(error.code(), ErrorCode::kDevice);
  EXPECT_THAT(error.what(), HasSubstr("cuda:0: cannot allocate 1024.00 TiB of device memory: cudaMalloc failed"));
  EXPECT_THAT(error.what(), HasSubstr("out of memory"));
  // The failure leaves the device usable.
  Buffer small(kCuda0, 4096);
  EXPECT_NE(small.data(), nullptr);
}

TEST(Cuda, CopierDeliversEveryPieceAndReleasesKeepalives) {
  WS_SKIP_WITHOUT_GPU();
  constexpr size_t kPiece = 1 << 20;
  constexpr size_t kPieces = 64;
  auto source = pattern(kPiece * kPieces, 3);
  Buffer device(kCuda0, source.size());
  std::atomic<int> released{0};
  {
    DeviceCopier copier(kCuda0, 4);
    EXPECT_EQ(copier.lanes(), 4u);
    EXPECT_EQ(copier.device(), kCuda0);
    // Four producers, each with pinned staging buffers whose release is counted.
    std::vector<std::thread> producers;
    for (unsigned producer = 0; producer < 4; ++producer) {
      producers.emplace_back([&, producer] {
        for (size_t piece = producer; piece < kPieces; piece += 4) {
          auto staging = std::make_shared<Buffer>(kCpu, kPiece, HostMemory::kPinned);
          std::memcpy(staging->data(), source.data() + piece * kPiece, kPiece);
          const std::byte* bytes = staging->data();
          std::shared_ptr<const void> keepalive(staging.get(), [staging, &released](const void*) mutable {
            staging.reset();
            ++released;
          });
          staging.reset();
          copier.copy_to_device(device.data() + piece * kPiece, bytes, kPiece, std::move(keepalive), producer, "t");
        }
      });
    }
    for (auto& producer : producers) producer.join();
    copier.synchronize();
    EXPECT_EQ(released.load(), static_cast<int>(kPieces));
    EXPECT_EQ(copier.bytes_in_flight(), 0u);
    std::vector<std::byte> back(source.size());
    copier.copy_to_host(back.data(), device.data(), back.size(), 1, "t");
    EXPECT_EQ(back, source);
  }
}

TEST(Cuda, CopierBoundsBytesInFlight) {
  WS_SKIP_WITHOUT_GPU();
  constexpr size_t kPiece = 4 << 20;
  Buffer staging(kCpu, kPiece, HostMemory::kPinned);
  Buffer device(kCuda0, 16 * kPiece);
  DeviceCopier copier(kCuda0, 2);
  for (size_t i = 0; i < 16; ++i) {
    copier.wait_until_in_flight_at_most(2 * kPiece);
    EXPECT_LE(copier.bytes_in_flight(), 2 * kPiece);
    copier.copy_to_device(device.data() + i * kPiece, staging.data(), kPiece, nullptr, static_cast<unsigned>(i));
  }
  copier.wait_until_in_flight_at_most(0);
  EXPECT_EQ(copier.bytes_in_flight(), 0u);
  copier.synchronize();
}

TEST(Cuda, RegisteredReadOnlyMappingCopiesDirectly) {
  WS_SKIP_WITHOUT_GPU();
  testing::TempDir directory;
  auto path = directory / "weights.bin";
  auto source = pattern((8 << 20) + 4096, 4);
  testing::write_file(path, std::string(reinterpret_cast<const char*>(source.data()), source.size()));
  int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  void* mapping = ::mmap(nullptr, source.size(), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  ASSERT_NE(mapping, MAP_FAILED);
  Buffer device(kCuda0, source.size());
  {
    DeviceCopier copier(kCuda0, 2);
    // Two registered windows; each is unregistered by the copier once its copy is done.
    size_t half = source.size() / 2 / 4096 * 4096;
    auto* bytes = static_cast<const std::byte*>(mapping);
    auto first = std::make_shared<HostRegistration>(kCuda0, bytes, half);
    auto second = std::make_shared<HostRegistration>(kCuda0, bytes + half, source.size() - half);
    EXPECT_EQ(first->size(), half);
    copier.copy_to_device(device.data(), bytes, half, std::move(first), 0, "w");
    copier.copy_to_device(device.data() + half, bytes + half, source.size() - half, std::move(second), 1, "w");
    copier.synchronize();
  }
  ::munmap(mapping, source.size());
  std::vector<std::byte> back(source.size());
  copy_bytes(back.data(), kCpu, device.data(), kCuda0, back.size());
  EXPECT_EQ(back, source);
}

TEST(Cuda, RegistrationErrorNamesDevice) {
  WS_SKIP_WITHOUT_GPU();
  Buffer pinned(kCpu, 8192, HostMemory::kPinned);
  // Registering memory that is already pinned is refused by the driver.
  auto error = thrown_by([&] { HostRegistration registration(kCuda0, pinned.data(), pinned.size()); });
  EXPECT_EQ(error.code(), ErrorCode::kDevice);
  EXPECT_THAT(error.what(), HasSubstr("cuda:0: cannot register 8.00 KiB of host memory read-only: cudaHostRegister failed"));
}

// Last in the file: should the driver report the bad copy asynchronously, the context is
// spoiled for later tests of this process (ctest runs each test in a process of its own).
TEST(Cuda, CopyErrorNamesDeviceTensorAndCause) {
  WS_SKIP_WITHOUT_GPU();
  Buffer staging(kCpu, 4096, HostMemory::kPinned);
  DeviceCopier copier(kCuda0, 1);
  // A null destination is refused when the copy is enqueued (cudaErrorInvalidValue).
  auto error = thrown_by([&] {
    copier.copy_to_device(nullptr, staging.data(), 4096, nullptr, 0, "model.embed.weight");
    copier.synchronize();
  });
  EXPECT_EQ(error.code(), ErrorCode::kDevice);
  EXPECT_THAT(error.what(), HasSubstr("cuda:0: tensor 'model.embed.weight': copy of 4096 bytes to the device failed"));
  // The first error fails the copier for good: later calls and synchronize() report it.
  EXPECT_THROW(copier.synchronize(), Error);
  EXPECT_THROW(copier.copy_to_device(nullptr, staging.data(), 1, nullptr, 0), Error);
}

}  // namespace
}  // namespace weightstream
