// Loading and digesting into CUDA memory: every byte lands at its tensor's offset by both
// GPU paths, host memory stays within the limit, digests equal the host digests. The GPU
// tests skip with a message where there is no GPU (scripts/gpu.sh runs them on one).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>

#include "weightstream/load.hpp"
#include "support/test_support.hpp"
#include "weightstream/error.hpp"
#include "weightstream/stream.hpp"
#include "weightstream/synth.hpp"
#include "weightstream/model.hpp"
#include "support/skip_without_gpu.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

const Device kCuda0{Device::Kind::kCuda, 0};

/// Writes `shards` shard files of `count` tensors with sizes from `seed`: mostly small,
/// every fifth up to `max_bytes` (so tensors straddle staging buffers and mapped windows),
/// one empty, in several dtypes. Bytes are pseudo-random from the seed.
void write_checkpoint(const std::filesystem::path& directory, size_t count, size_t shards, uint64_t seed,
                      uint64_t max_bytes) {
  std::mt19937_64 random(seed);
  std::vector<SafetensorsWriter> writers(shards);
  for (size_t i = 0; i < count; ++i) {
    uint64_t elements = (i % 5 == 0) ? random() % (max_bytes / 2) : random() % 5000;
    if (i == 2) elements = 0;
    std::vector<std::byte> bytes(elements * 2);
    for (auto& byte : bytes) byte = static_cast<std::byte>(random());
    writers[i % shards].add("layers." + std::to_string(i) + ".weight", i % 2 ? Dtype::kBF16 : Dtype::kF16,
                            {static_cast<int64_t>(elements)}, bytes);
  }
  for (size_t shard = 0; shard < shards; ++shard) {
    writers[shard].write(directory / ("model-0000" + std::to_string(shard + 1) + ".safetensors"));
  }
}

/// Every tensor's bytes on the device equal those of the host load.
void expect_same_bytes(const Checkpoint& checkpoint, const LoadedCheckpoint& on_device, const LoadedCheckpoint& on_host) {
  ASSERT_EQ(on_device.tensors.size(), checkpoint.tensors().size());
  ASSERT_EQ(on_host.tensors.size(), checkpoint.tensors().size());
  EXPECT_EQ(on_device.layout.device(), kCuda0);
  for (size_t i = 0; i < on_device.tensors.size(); ++i) {
    const auto& tensor = on_device.tensors[i];
    ASSERT_EQ(tensor.bytes, checkpoint.tensors()[i].bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(tensor.data) % 256, 0u);
    std::vector<std::byte> back(tensor.bytes);
    copy_bytes(back.data(), Device{}, tensor.data, kCuda0, back.size());
    ASSERT_TRUE(std::memcmp(back.data(), on_host.tensors[i].data, back.size()) == 0) << checkpoint.tensors()[i].name;
  }
}

/// Objects in memory: a storage that is not the local file system (no local_path).
class MemoryStorage final : public Storage {
 public:
  explicit MemoryStorage(const std::filesystem::path& directory) {
    for (const auto& entry : std::filesystem::directory_iterator(directory)) {
      objects_[entry.path().filename().string()] = testing::read_file(entry.path());
    }
  }
  std::string root_uri() const override { return "memory://test"; }
  std::string object_uri(std::string_view name) const override { return "memory://test/" + std::string(name); }
  std::vector<ObjectInfo> list() override {
    std::vector<ObjectInfo> objects;
    for (const auto& [name, bytes] : objects_) objects.push_back({name, bytes.size()});
    return objects;
  }
  ObjectInfo stat(std::string_view name) override {
    auto it = objects_.find(std::string(name));
    WS_EXPECT(it != objects_.end(), ErrorCode::kNotFound, object_uri(name) + " does not exist");
    return {it->first, it->second.size()};
  }
  void read(std::string_view name, uint64_t offset, std::span<std::byte> destination) override {
    const auto& bytes = objects_.at(std::string(name));
    WS_EXPECT(offset + destination.size() <= bytes.size(), ErrorCode::kIo, "read past the end of " + object_uri(name));
    std::memcpy(destination.data(), bytes.data() + offset, destination.size());
  }

 private:
  std::map<std::string, std::string> objects_;
};

TEST(GpuPathOption, FromEnvironment) {
  EXPECT_EQ(options_from_environment({}).stream.gpu_path, GpuPath::kAuto);
  EXPECT_EQ(options_from_environment({{"WEIGHTSTREAM_GPU_PATH", "staged"}}).stream.gpu_path, GpuPath::kStaged);
  EXPECT_EQ(options_from_environment({{"WEIGHTSTREAM_GPU_PATH", "mapped"}}).stream.gpu_path, GpuPath::kMapped);
  EXPECT_EQ(options_from_environment({{"WEIGHTSTREAM_GPU_PATH", "auto"}}).stream.gpu_path, GpuPath::kAuto);
  EXPECT_EQ(options_from_environment({{"WEIGHTSTREAM_GPU_PATH", "both"}}).stream.gpu_path, GpuPath::kBoth);
  try {
    options_from_environment({{"WEIGHTSTREAM_GPU_PATH", "pinned"}});
    FAIL() << "a malformed WEIGHTSTREAM_GPU_PATH was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kConfig);
    EXPECT_THAT(error.what(), HasSubstr("WEIGHTSTREAM_GPU_PATH='pinned': expected auto, staged, mapped or both"));
  }
}

TEST(CudaLoad, WithoutGpuSaysSo) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "this machine has a GPU";
  TempDir directory;
  write_checkpoint(directory.path(), 4, 1, 1, 4096);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  try {
    load_checkpoint(checkpoint, kCuda0, StreamOptions{}, {});
    FAIL() << "loading onto a missing GPU succeeded";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), cuda_compiled() ? ErrorCode::kDevice : ErrorCode::kUnsupported);
    EXPECT_THAT(error.what(), HasSubstr("cuda:0"));
  }
  EXPECT_THROW(digest_checkpoint(checkpoint, HashKind::kXxh64, kCuda0, StreamOptions{}, nullptr, {}), Error);
}

struct CudaLoadCase {
  GpuPath path;
  uint64_t memory_limit;
  uint64_t chunk_bytes;
  unsigned concurrency;
};

class CudaLoadPaths : public ::testing::TestWithParam<CudaLoadCase> {};

TEST_P(CudaLoadPaths, EveryByteAtItsOffsetInBoundedMemory) {
  WS_SKIP_WITHOUT_GPU();
  const auto& param = GetParam();
  TempDir directory;
  write_checkpoint(directory.path(), 60, 3, 7, 3 * kMiB);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  StreamOptions options;
  options.gpu_path = param.path;
  options.memory_limit = param.memory_limit;
  options.chunk_bytes = param.chunk_bytes;
  options.concurrency = param.concurrency;
  uint64_t last_done = 0;
  bool monotonic = true;
  auto on_device = load_checkpoint(checkpoint, kCuda0, options, [&](uint64_t done, uint64_t total) {
    monotonic = monotonic && done >= last_done && done <= total;
    last_done = done;
  });
  EXPECT_TRUE(monotonic);
  EXPECT_EQ(last_done, checkpoint.tensor_bytes());
  EXPECT_EQ(on_device.stats.bytes, checkpoint.tensor_bytes());
  EXPECT_GT(on_device.stats.peak_staging_bytes, 0u);
  EXPECT_LE(on_device.stats.peak_staging_bytes, options.memory_limit);
  auto on_host = load_checkpoint(checkpoint, Device{}, StreamOptions{});
  expect_same_bytes(checkpoint, on_device, on_host);
}

INSTANTIATE_TEST_SUITE_P(
    Configurations, CudaLoadPaths,
    ::testing::Values(CudaLoadCase{GpuPath::kStaged, 1 * kGiB, 16 * kMiB, 16},
                      CudaLoadCase{GpuPath::kStaged, 256 * kKiB, 64 * kKiB, 4},
                      CudaLoadCase{GpuPath::kStaged, 64 * kKiB, 16 * kKiB, 1},
                      CudaLoadCase{GpuPath::kMapped, 1 * kGiB, 16 * kMiB, 16},
                      CudaLoadCase{GpuPath::kMapped, 256 * kKiB, 64 * kKiB, 4},
                      CudaLoadCase{GpuPath::kMapped, 64 * kKiB, 16 * kKiB, 1},
                      CudaLoadCase{GpuPath::kBoth, 1 * kGiB, 16 * kMiB, 16},
                      CudaLoadCase{GpuPath::kBoth, 256 * kKiB, 64 * kKiB, 4},
                      CudaLoadCase{GpuPath::kBoth, 64 * kKiB, 16 * kKiB, 2},
                      CudaLoadCase{GpuPath::kAuto, 1 * kMiB, 1 * kMiB, 8}),
    [](const auto& info) {
      std::string path(gpu_path_name(info.param.path));
      path[0] = static_cast<char>(std::toupper(path[0]));
      return std::string(path) + "Limit" + std::to_string(info.param.memory_limit / kKiB) + "KiB" +
             std::to_string(info.param.concurrency) + "Readers";
    });

TEST(CudaLoad, DigestsEqualHostDigests) {
  WS_SKIP_WITHOUT_GPU();
  TempDir directory;
  write_checkpoint(directory.path(), 40, 2, 9, 2 * kMiB);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  for (auto path : {GpuPath::kStaged, GpuPath::kMapped, GpuPath::kBoth}) {
    for (auto kind : {HashKind::kSha256, HashKind::kXxh64}) {
      StreamOptions options;
      options.gpu_path = path;
      options.memory_limit = 512 * kKiB;  // smaller than the largest tensor: readback in chunks
      options.chunk_bytes = 128 * kKiB;
      StreamStats stats;
      auto on_device = digest_checkpoint(checkpoint, kind, kCuda0, options, &stats, {});
      auto on_host = digest_checkpoint(checkpoint, kind, Device{}, StreamOptions{});
      ASSERT_EQ(on_device.size(), on_host.size());
      for (size_t i = 0; i < on_host.size(); ++i) {
        EXPECT_EQ(on_device[i].name, on_host[i].name);
        EXPECT_EQ(on_device[i].hex, on_host[i].hex) << on_host[i].name;
      }
      EXPECT_EQ(stats.bytes, checkpoint.tensor_bytes());
      EXPECT_LE(stats.peak_staging_bytes, options.memory_limit);
    }
    // Both kinds in one pass over what the device holds (digest --hash sha256 with the content digest).
    StreamOptions options;
    options.gpu_path = path;
    auto both = digest_checkpoint(checkpoint, {HashKind::kSha256, HashKind::kXxh64}, kCuda0, options);
    ASSERT_EQ(both.size(), 2u);
    auto sha = digest_checkpoint(checkpoint, HashKind::kSha256, Device{}, StreamOptions{});
    auto xxh = digest_checkpoint(checkpoint, HashKind::kXxh64, Device{}, StreamOptions{});
    for (size_t i = 0; i < sha.size(); ++i) {
      EXPECT_EQ(both[0][i].hex, sha[i].hex) << sha[i].name;
      EXPECT_EQ(both[1][i].hex, xxh[i].hex) << xxh[i].name;
    }
  }
}

// The ranks of an FP8 block-scaled MoE land their small tensors (experts, block scales) and
// column windows (down_proj, the experts' w2 and their scales) through one landing copy per
// read and a scatter kernel: every parameter equals the same rank's host load, on every GPU
// path and with reads that split tensors and rows.
TEST(CudaLoad, RanksOfAnFp8MoeEqualTheirHostLoads) {
  WS_SKIP_WITHOUT_GPU();
  TempDir directory;
  SynthOptions synth;
  synth.arch = "qwen3_moe";
  synth.quantize = SynthOptions::Quantization::kFp8Block;
  synth.hidden = 512;
  synth.layers = 2;
  synth.experts = 4;
  synth.shards = 3;
  synth.seed = 5;
  synthesize_checkpoint(directory.path(), synth);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  const ModelConfig config = checkpoint_model_config(checkpoint);
  StreamOptions pieces;
  pieces.chunk_bytes = 4096;  // reads that split rows and tensors
  pieces.memory_limit = 256 * kKiB;
  pieces.gpu_path = GpuPath::kStaged;
  for (Parallelism parallel : {Parallelism{2, 0, 1, 0}, Parallelism{2, 1, 1, 0}, Parallelism{4, 3, 1, 0},
                               Parallelism{2, 1, 2, 1}}) {
    SCOPED_TRACE("tp " + std::to_string(parallel.tp_size) + " rank " + std::to_string(parallel.tp_rank) + ", ep " +
                 std::to_string(parallel.ep_size) + " rank " + std::to_string(parallel.ep_rank));
    ModelLayout reference = build_model_layout(config, {.parallel = parallel});
    reference.allocate(Device{});
    load_layout(reference, checkpoint, LoadMode::kCold, StreamOptions{});
    for (GpuPath path : {GpuPath::kAuto, GpuPath::kStaged, GpuPath::kMapped}) {
      for (const StreamOptions& base : {StreamOptions{}, pieces}) {
        StreamOptions options = base;
        options.gpu_path = path;
        ModelLayout layout = build_model_layout(config, {.parallel = parallel});
        layout.allocate(kCuda0, ModelLayout::ArenaContents::kUnwritten);
        load_layout(layout, checkpoint, LoadMode::kCold, options);
        LayoutComparison comparison = compare_layouts(layout, reference);
        EXPECT_EQ(comparison.mismatched, 0u)
            << gpu_path_name(path) << " path, chunks of " << options.chunk_bytes << ": "
            << (comparison.mismatches.empty() ? "" : comparison.mismatches[0]);
      }
    }
  }
}

// A rank of tp 8 keeps an eighth of every row of o_proj and down_proj: those rows are
// gathered on the CPU into pinned buffers and land in one copy each; every parameter equals the
// same rank's host load.
TEST(CudaLoad, RanksOfTp8EqualTheirHostLoads) {
  WS_SKIP_WITHOUT_GPU();
  TempDir directory;
  SynthOptions synth;
  synth.arch = "llama";
  synth.hidden = 1024;
  synth.layers = 2;
  synth.shards = 2;
  synth.seed = 8;
  synthesize_checkpoint(directory.path(), synth);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  const ModelConfig config = checkpoint_model_config(checkpoint);
  for (int64_t rank : {0, 5}) {
    SCOPED_TRACE("tp 8 rank " + std::to_string(rank));
    ModelLayout reference = build_model_layout(config, {.parallel = {8, rank, 1, 0}});
    reference.allocate(Device{});
    load_layout(reference, checkpoint, LoadMode::kCold, StreamOptions{});
    for (GpuPath path : {GpuPath::kAuto, GpuPath::kStaged}) {
      StreamOptions options;
      options.gpu_path = path;
      ModelLayout layout = build_model_layout(config, {.parallel = {8, rank, 1, 0}});
      layout.allocate(kCuda0, ModelLayout::ArenaContents::kUnwritten);
      load_layout(layout, checkpoint, LoadMode::kCold, options);
      LayoutComparison comparison = compare_layouts(layout, reference);
      EXPECT_EQ(comparison.mismatched, 0u)
          << gpu_path_name(path) << " path: " << (comparison.mismatches.empty() ? "" : comparison.mismatches[0]);
    }
  }
}

// A reload commits whole layers: pieces of a layer not yet complete that arrive in staging
// buffers are held on the GPU (copied there at once, written by a device-to-device copy
// with their layer); the parameters stay where they were and equal
// a host load of the new checkpoint.
TEST(CudaLoad, AReloadHoldsPiecesOfIncompleteLayersOnTheGpu) {
  WS_SKIP_WITHOUT_GPU();
  TempDir old_directory;
  TempDir new_directory;
  SynthOptions synth;
  synth.arch = "llama";
  synth.hidden = 512;
  synth.layers = 3;
  synth.shards = 2;
  synth.seed = 1;
  synthesize_checkpoint(old_directory.path(), synth);
  synth.seed = 2;
  synthesize_checkpoint(new_directory.path(), synth);
  auto old_checkpoint = Checkpoint::open(old_directory.path().string(), Options{});
  auto new_checkpoint = Checkpoint::open(new_directory.path().string(), Options{});
  const ModelConfig config = checkpoint_model_config(new_checkpoint);
  for (Parallelism parallel : {Parallelism{1, 0, 1, 0}, Parallelism{2, 1, 1, 0}}) {
    {
      SCOPED_TRACE("tp " + std::to_string(parallel.tp_size));
      ModelLayout reference = build_model_layout(config, {.parallel = parallel});
      reference.allocate(Device{});
      load_layout(reference, new_checkpoint, LoadMode::kCold, StreamOptions{});
      ModelLayout layout = build_model_layout(config, {.parallel = parallel});
      layout.allocate(kCuda0, ModelLayout::ArenaContents::kUnwritten);
      load_layout(layout, old_checkpoint, LoadMode::kCold, StreamOptions{});
      std::vector<std::byte*> addresses;
      for (const Parameter& parameter : layout.parameters()) addresses.push_back(parameter.data);
      StreamOptions pieces;
      pieces.chunk_bytes = 64 * kKiB;  // reads that split layers
      pieces.memory_limit = 1 * kMiB;
      pieces.gpu_path = GpuPath::kStaged;
      const LayoutLoad reload = load_layout(layout, new_checkpoint, LoadMode::kReload, pieces);
      EXPECT_GT(reload.counters.held_bytes_on_device, 0u);
      EXPECT_EQ(reload.counters.held_bytes_on_device, reload.counters.held_bytes_copied);
      LayoutComparison comparison = compare_layouts(layout, reference);
      EXPECT_EQ(comparison.compared, layout.parameters().size());
      EXPECT_EQ(comparison.mismatched, 0u) << (comparison.mismatches.empty() ? "" : comparison.mismatches[0]);
      for (size_t i = 0; i < addresses.size(); ++i) EXPECT_EQ(layout.parameters()[i].data, addresses[i]);
    }
  }
}

TEST(CudaLoad, MappedPathNeedsLocalFiles) {
  WS_SKIP_WITHOUT_GPU();
  TempDir directory;
  write_checkpoint(directory.path(), 10, 2, 5, 64 * kKiB);
  auto checkpoint = Checkpoint::open(std::make_shared<MemoryStorage>(directory.path()));
  StreamOptions options;
  for (GpuPath path : {GpuPath::kMapped, GpuPath::kBoth}) {
    options.gpu_path = path;
    try {
      load_checkpoint(checkpoint, kCuda0, options, {});
      FAIL() << "the " << gpu_path_name(path) << " path accepted storage without local files";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kUnsupported);
      EXPECT_THAT(error.what(), HasSubstr("the " + std::string(gpu_path_name(path)) + " GPU path maps local files"));
      EXPECT_THAT(error.what(), HasSubstr("memory://test"));
      EXPECT_THAT(error.what(), HasSubstr("--gpu-path staged"));
    }
  }
  // Auto falls back to staging, which any storage can feed.
  options.gpu_path = GpuPath::kAuto;
  auto on_device = load_checkpoint(checkpoint, kCuda0, options, {});
  auto on_host = load_checkpoint(checkpoint, Device{}, StreamOptions{});
  expect_same_bytes(checkpoint, on_device, on_host);
}

TEST(CudaLoad, MissingDeviceIsNamed) {
  WS_SKIP_WITHOUT_GPU();
  TempDir directory;
  write_checkpoint(directory.path(), 4, 1, 3, 4096);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  Device missing{Device::Kind::kCuda, cuda_device_count()};
  try {
    load_checkpoint(checkpoint, missing, StreamOptions{}, {});
    FAIL() << "loading onto " << missing.name() << " succeeded";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kDevice);
    EXPECT_THAT(error.what(), HasSubstr(missing.name() + ": invalid device ordinal"));
  }
}

}  // namespace
}  // namespace weightstream
