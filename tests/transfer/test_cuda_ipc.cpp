// CUDA IPC updates on a real GPU: a sender process (this test binary again, running only
// CudaIpcChild.Sender) pushes engine-format tensors of which some live in one large
// allocation (shared in place: the receiver reads them straight from the sender's memory)
// and some in small allocations of their own (copied through the bucket buffers), so
// buckets mix both. Every parameter must hold exactly the sender's bytes. Skipped on a
// machine without a CUDA GPU; the GPU run (scripts/gpu.sh) runs it.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cstdlib>
#include <cstring>

#include "weightstream/device.hpp"
#include "weightstream/error.hpp"
#include "weightstream/transfer.hpp"

extern char** environ;

namespace weightstream {
namespace {

using namespace std::chrono_literals;

constexpr const char* kAddressVariable = "WS_TEST_CUDA_IPC_ADDRESS";
constexpr size_t kTensors = 48;
constexpr uint64_t kBucketBytes = 1 << 20;
constexpr uint64_t kShareMinimumBytes = 4 << 20;  // the arena is shared; single tensors are not

/// Tensor i: BF16, sizes from 8 KiB to about 1.5 MiB (some larger than a bucket, so
/// copied tensors travel in pieces); even tensors live in the shared arena.
std::vector<int64_t> shape_of(size_t i) { return {static_cast<int64_t>(4096 + (i * 37'000) % 800'000)}; }
uint64_t bytes_of(size_t i) { return static_cast<uint64_t>(shape_of(i)[0]) * 2; }
bool in_arena(size_t i) { return i % 2 == 0; }
std::string name_of(size_t i) { return "p" + std::to_string(i); }

std::vector<std::byte> pattern_of(size_t i) {
  std::vector<std::byte> bytes(bytes_of(i));
  for (size_t b = 0; b < bytes.size(); ++b) bytes[b] = static_cast<std::byte>((b * 131 + i * 7 + 1) & 0xFF);
  return bytes;
}

ModelLayout receiver_layout(const Device& device) {
  ModelLayout layout;
  layout.set_description("cuda-ipc test layout");
  for (size_t i = 0; i < kTensors; ++i) {
    Parameter parameter;
    parameter.name = name_of(i);
    parameter.dtype = Dtype::kBF16;
    parameter.load_dtype = Dtype::kBF16;
    parameter.shape = shape_of(i);
    parameter.layer = static_cast<int64_t>(i / 4);
    layout.add_parameter(std::move(parameter));
  }
  layout.allocate(device);
  LoadSession session(layout);
  session.begin(LoadMode::kCold, TensorFormat::kEngine);
  for (const Parameter& parameter : layout.parameters()) {
    std::vector<std::byte> zeros(parameter.bytes());
    session.load(TensorView{parameter.name, parameter.dtype, parameter.shape, zeros.data(), Device{}, 0, zeros.size()});
  }
  session.finish();
  return layout;
}

TEST(CudaIpc, SharedAndCopiedTensorsLandExactly) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "cuda-ipc needs a CUDA GPU; this machine has none";
  const Device device{Device::Kind::kCuda, 0};
  ModelLayout layout = receiver_layout(device);
  ReceiverOptions options;
  options.transport = TransportKind::kCudaIpc;
  options.token = "shared-secret";
  options.device = device;
  options.timeout = 20s;
  UpdateReceiver receiver(layout, options);

  ::setenv(kAddressVariable, receiver.address().c_str(), 1);
  std::vector<std::string> arguments = {"/proc/self/exe", "--gtest_filter=CudaIpcChild.Sender"};
  std::vector<char*> argv;
  for (auto& argument : arguments) argv.push_back(argument.data());
  argv.push_back(nullptr);
  pid_t child = -1;
  ASSERT_EQ(::posix_spawn(&child, "/proc/self/exe", nullptr, nullptr, argv.data(), environ), 0);
  ::unsetenv(kAddressVariable);

  UpdateReport report = receiver.receive(60s);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "sender status " << status;
  EXPECT_EQ(report.tensors, kTensors);
  EXPECT_EQ(report.counters.model_hook_runs, 0u);  // the layout has no hooks
  uint64_t copied = 0;
  for (size_t i = 0; i < kTensors; ++i) copied += in_arena(i) ? 0 : bytes_of(i);
  // Only the copied tensors occupy bucket bytes (plus alignment); the shared ones none.
  EXPECT_GE(report.bytes, copied);
  EXPECT_LT(report.bytes, copied + kTensors * 256 + report.buckets * 256);
  for (size_t i = 0; i < kTensors; ++i) {
    EXPECT_EQ(parameter_bytes(layout.parameter(name_of(i))), pattern_of(i)) << name_of(i);
  }
}

// The sender half of SharedAndCopiedTensorsLandExactly, in its own process: skipped unless
// that test started it.
TEST(CudaIpcChild, Sender) {
  const char* address = std::getenv(kAddressVariable);
  if (address == nullptr) GTEST_SKIP() << "runs only as the sender process of CudaIpc.SharedAndCopiedTensorsLandExactly";
  const Device device{Device::Kind::kCuda, 0};
  uint64_t arena_bytes = 0;
  for (size_t i = 0; i < kTensors; ++i) arena_bytes += in_arena(i) ? (bytes_of(i) + 255) / 256 * 256 : 0;
  Buffer arena(device, std::max(arena_bytes, kShareMinimumBytes));
  std::vector<Buffer> singles;
  std::vector<const std::byte*> data(kTensors);
  uint64_t offset = 0;
  for (size_t i = 0; i < kTensors; ++i) {
    std::vector<std::byte> pattern = pattern_of(i);
    if (in_arena(i)) {
      data[i] = arena.data() + offset;
      offset += (pattern.size() + 255) / 256 * 256;
    } else {
      singles.emplace_back(device, pattern.size());
      data[i] = singles.back().data();
    }
    copy_bytes(const_cast<std::byte*>(data[i]), device, pattern.data(), Device{}, pattern.size());
  }
  SenderOptions options;
  options.transport = TransportKind::kCudaIpc;
  options.token = "shared-secret";
  options.device = device;
  options.bucket_bytes = kBucketBytes;
  options.share_minimum_bytes = kShareMinimumBytes;
  options.timeout = 20s;
  UpdateSender sender(address, options);
  std::vector<DeclaredTensor> manifest;
  for (size_t i = 0; i < kTensors; ++i) manifest.push_back({name_of(i), Dtype::kBF16, shape_of(i)});
  sender.start(TensorFormat::kEngine, manifest);
  for (size_t i = 0; i < kTensors; ++i) {
    std::vector<int64_t> shape = shape_of(i);
    sender.send(TensorView{name_of(i), Dtype::kBF16, shape, data[i], device, 0, bytes_of(i)});
  }
  UpdateReport report = sender.finish();
  EXPECT_EQ(report.tensors, kTensors);
}

}  // namespace
}  // namespace weightstream
