// The stream layer's contracts: every requested byte exactly once, bounded staging memory,
// the first error cancels the other readers and is the one the caller sees.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <numeric>
#include <condition_variable>
#include <mutex>
#include <random>
#include <set>

#include "stream/stream_fixtures.hpp"
#include "support/test_support.hpp"
#include "weightstream/error.hpp"
#include "weightstream/load.hpp"  // Load.*: the plain load is the identity layout
#include "weightstream/stream.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using testing::expected_byte;
using testing::RecordingSink;
using testing::TempDir;
using testing::write_checkpoint;

struct StreamCase {
  unsigned concurrency;
  uint64_t memory_limit;
  uint64_t chunk;
  bool ordered;
  bool direct;
};

class StreamExactlyOnce : public ::testing::TestWithParam<StreamCase> {};

TEST_P(StreamExactlyOnce, EveryByteOnceInBoundedMemory) {
  TempDir directory;
  auto sizes = write_checkpoint(directory.path(), 60, 3, 42);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  ASSERT_EQ(checkpoint.tensors().size(), sizes.size());
  auto requests = all_tensors(checkpoint);
  const auto& param = GetParam();
  RecordingSink sink(checkpoint, requests, param.ordered, param.direct);
  StreamOptions options;
  options.concurrency = param.concurrency;
  options.memory_limit = param.memory_limit;
  options.chunk_bytes = param.chunk;
  auto stats = stream_tensors(checkpoint, requests, sink, options);
  sink.expect_exactly_once();
  EXPECT_EQ(stats.tensors, requests.size());
  EXPECT_EQ(stats.bytes, checkpoint.tensor_bytes());
  EXPECT_LE(stats.peak_staging_bytes, param.memory_limit);
  if (param.direct) EXPECT_EQ(stats.peak_staging_bytes, 0u);
  // The readers' time: some in reads, and no more in all three than the readers had.
  EXPECT_GT(stats.read_seconds, 0.0);
  EXPECT_GE(stats.deliver_seconds, 0.0);
  EXPECT_GE(stats.staging_wait_seconds, 0.0);
  EXPECT_LE(stats.read_seconds + stats.deliver_seconds + stats.staging_wait_seconds,
            param.concurrency * stats.seconds * 1.01 + 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Configurations, StreamExactlyOnce,
                         ::testing::Values(StreamCase{1, 64 * kKiB, 16 * kKiB, false, false},
                                           StreamCase{8, 256 * kKiB, 64 * kKiB, false, false},
                                           StreamCase{8, 256 * kKiB, 64 * kKiB, true, false},
                                           StreamCase{16, 64 * kMiB, 16 * kMiB, false, false},
                                           StreamCase{3, 16 * kKiB, 4 * kKiB, true, false},
                                           StreamCase{4, 64 * kKiB, 16 * kKiB, false, true}));

TEST(Streamer, PartialRangesOfTensorsAreDeliveredExactly) {
  TempDir directory;
  auto sizes = write_checkpoint(directory.path(), 20, 2, 7);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  std::vector<TensorRequest> requests;
  for (size_t i = 0; i < checkpoint.tensors().size(); ++i) {
    uint64_t bytes = checkpoint.tensors()[i].bytes;
    if (bytes < 4) continue;
    requests.push_back({i, {bytes / 4, bytes / 2}});  // a middle slice, as a tensor-parallel rank reads
  }
  RecordingSink sink(checkpoint, requests, true, false);
  StreamOptions options;
  options.memory_limit = 128 * kKiB;
  options.chunk_bytes = 32 * kKiB;
  auto stats = stream_tensors(checkpoint, requests, sink, options);
  sink.expect_exactly_once();
  EXPECT_LT(stats.bytes_read, checkpoint.tensor_bytes());
}

/// Records where in the files each piece came from, and wants every piece in file order.
class FileOrderSink final : public RecordingSink {
 public:
  using RecordingSink::RecordingSink;
  bool wants_file_order() const override { return true; }
  void consume(TensorPiece&& piece) override {
    {
      std::lock_guard lock(order_mutex_);
      positions.emplace_back(piece.tensor->shard, piece.tensor->offset + piece.offset);
    }
    RecordingSink::consume(std::move(piece));
  }
  std::vector<std::pair<uint32_t, uint64_t>> positions;  ///< (shard, file offset) of each piece

 private:
  std::mutex order_mutex_;
};

TEST(Streamer, ASinkThatWantsFileOrderGetsEveryPieceInShardAndOffsetOrder) {
  TempDir directory;
  write_checkpoint(directory.path(), 80, 3, 11);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  auto requests = all_tensors(checkpoint);
  FileOrderSink sink(checkpoint, requests, false, false);
  StreamOptions options;
  options.concurrency = 8;  // readers finish out of order; the pieces must not
  options.memory_limit = 256 * kKiB;
  options.chunk_bytes = 16 * kKiB;
  stream_tensors(checkpoint, requests, sink, options);
  sink.expect_exactly_once();
  ASSERT_GT(sink.positions.size(), 100u);
  EXPECT_TRUE(std::is_sorted(sink.positions.begin(), sink.positions.end()));
  EXPECT_EQ(std::adjacent_find(sink.positions.begin(), sink.positions.end()), sink.positions.end());
}

/// Takes pieces straight from storage's views (an update sender's way: it copies them into
/// its bucket), in file order.
class ViewTakingSink final : public RecordingSink {
 public:
  using RecordingSink::RecordingSink;
  bool wants_file_order() const override { return true; }
  bool takes_views() const override { return true; }
};

TEST(Streamer, ASinkThatTakesViewsOfLocalFilesGetsEveryByteWithoutStaging) {
  TempDir directory;
  write_checkpoint(directory.path(), 60, 3, 5);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  auto requests = all_tensors(checkpoint);
  ViewTakingSink sink(checkpoint, requests, true, false);
  StreamOptions options;
  options.concurrency = 8;
  options.memory_limit = 256 * kKiB;
  options.chunk_bytes = 16 * kKiB;
  auto stats = stream_tensors(checkpoint, requests, sink, options);
  sink.expect_exactly_once();
  EXPECT_EQ(stats.bytes, checkpoint.tensor_bytes());
  EXPECT_EQ(stats.peak_staging_bytes, 0u);  // every piece pointed into the files' mapping
}

/// Gathers the runs of each request (of several runs) from the pieces, as a session's
/// column slice does, taking pieces straight from storage's views.
/// With `packed`, it takes staged pieces, packed (TensorSink::takes_packed_runs()).
class RunGatheringSink final : public TensorSink {
 public:
  explicit RunGatheringSink(std::span<const TensorRequest> requests, bool packed = false)
      : requests_(requests), packed_(packed) {
    for (const TensorRequest& request : requests) gathered.emplace_back(request.run_bytes());
  }
  bool takes_views() const override { return !packed_; }
  bool takes_packed_runs() const override { return packed_; }
  void consume(TensorPiece&& piece) override {
    const TensorRequest& request = requests_[piece.request];
    std::lock_guard lock(mutex_);
    ++pieces;
    if (piece.packed) {
      // Whole runs, back to back, from the run at piece.offset.
      EXPECT_TRUE(packed_);
      EXPECT_EQ(piece.offset % request.stride, 0u);
      EXPECT_EQ(piece.bytes.size() % request.range.length, 0u);
      ++packed_pieces;
      const uint64_t first_run = piece.offset / request.stride;
      std::memcpy(gathered[piece.request].data() + first_run * request.range.length, piece.bytes.data(),
                  piece.bytes.size());
      return;
    }
    for (uint64_t run = 0; run < std::max<uint64_t>(request.runs, 1); ++run) {
      const uint64_t begin = run * request.stride, end = begin + request.range.length;  // in the extent
      const uint64_t lo = std::max(begin, piece.offset), hi = std::min(end, piece.offset + piece.bytes.size());
      if (lo >= hi) continue;
      std::memcpy(gathered[piece.request].data() + run * request.range.length + (lo - begin),
                  piece.bytes.data() + (lo - piece.offset), hi - lo);
    }
  }
  std::vector<std::vector<std::byte>> gathered;  ///< the runs of each request, one after another
  size_t pieces = 0, packed_pieces = 0;

 private:
  std::span<const TensorRequest> requests_;
  bool packed_;
  std::mutex mutex_;
};

/// Whether every request's runs arrived with the bytes of the checkpoint (write_checkpoint's).
void expect_runs_gathered(const Checkpoint& checkpoint, std::span<const TensorRequest> requests,
                          const RunGatheringSink& sink) {
  for (size_t r = 0; r < requests.size(); ++r) {
    const TensorRequest& request = requests[r];
    const size_t source = std::stoul(checkpoint.tensors()[request.tensor].name.substr(1));
    uint64_t wrong = 0;
    for (uint64_t run = 0; run < std::max<uint64_t>(request.runs, 1); ++run) {
      for (uint64_t i = 0; i < request.range.length; ++i) {
        const uint64_t offset = request.range.offset + run * request.stride + i;
        wrong += sink.gathered[r][run * request.range.length + i] != expected_byte(source, offset);
      }
    }
    EXPECT_EQ(wrong, 0u) << "request " << r;
  }
}

TEST(Streamer, ASinkThatTakesPackedRunsGetsColumnWindowsAndScatteredSlicesInFewReads) {
  TempDir directory;
  auto sizes = write_checkpoint(directory.path(), 30, 2, 9, 48 * kKiB);  // several windows fit one read
  std::vector<TensorRequest> requests;
  for (LocalIo io : {LocalIo::kPread, LocalIo::kMmap}) {
    Options open_options;
    open_options.stream.local_io = io;
    auto checkpoint = Checkpoint::open(directory.path().string(), open_options);
    requests.clear();
    for (size_t i = 0; i < checkpoint.tensors().size(); ++i) {
      const uint64_t bytes = checkpoint.tensors()[i].bytes;
      if (bytes >= 4096) {
        requests.push_back({i, {256, 256}, bytes / 512, 512});  // a column window: the right half of each row
      } else if (bytes >= 64) {
        requests.push_back({i, {bytes / 4, bytes / 2}});  // a slice of a small tensor: apart from the next
      }
    }
    ASSERT_GT(requests.size(), 4u);
    RunGatheringSink sink(requests, true);
    StreamOptions options;
    options.concurrency = 4;
    options.memory_limit = 256 * kKiB;
    options.chunk_bytes = 64 * kKiB;
    options.local_io = io;
    auto stats = stream_tensors(checkpoint, requests, sink, options);
    expect_runs_gathered(checkpoint, requests, sink);
    uint64_t run_bytes = 0;
    for (const TensorRequest& request : requests) run_bytes += request.run_bytes();
    EXPECT_EQ(stats.bytes, run_bytes) << local_io_name(io);
    EXPECT_EQ(stats.tensors, requests.size());
    EXPECT_GT(sink.packed_pieces, 0u);
    EXPECT_LE(stats.peak_staging_bytes, options.memory_limit);
    // Each read stages at most a chunk of the requests' own bytes: about their sum over the
    // chunk, not a read per request or per chunk of the extents they lie in.
    EXPECT_LE(stats.reads, run_bytes / options.chunk_bytes + 2) << local_io_name(io);
    EXPECT_LT(stats.reads, requests.size());
    if (io == LocalIo::kMmap) EXPECT_EQ(stats.bytes_read, run_bytes) << "copied out of the mapping: no gap read";
  }
}

TEST(Streamer, ASinkThatTakesViewsGetsTheRunsOfAStridedRequestWithoutStaging) {
  TempDir directory;
  auto sizes = write_checkpoint(directory.path(), 30, 2, 9, 2 * kMiB);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  std::vector<TensorRequest> requests;
  for (size_t i = 0; i < checkpoint.tensors().size(); ++i) {
    const uint64_t bytes = checkpoint.tensors()[i].bytes;
    if (bytes < 4096) continue;
    // The right half of each 512-byte row, as a tensor-parallel rank's column slice.
    requests.push_back({i, {256, 256}, bytes / 512, 512});
  }
  ASSERT_GT(requests.size(), 2u);
  RunGatheringSink sink(requests);
  StreamOptions options;
  options.concurrency = 4;
  options.memory_limit = 256 * kKiB;
  options.chunk_bytes = 64 * kKiB;
  auto stats = stream_tensors(checkpoint, requests, sink, options);
  EXPECT_EQ(stats.peak_staging_bytes, 0u);
  EXPECT_EQ(sink.packed_pieces, 0u);  // lent views: pieces as they lie
  expect_runs_gathered(checkpoint, requests, sink);
}

TEST(Streamer, RequestOutsideTensorIsRejected) {
  TempDir directory;
  write_checkpoint(directory.path(), 5, 1, 1);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  std::vector<TensorRequest> requests = {{0, {0, checkpoint.tensors()[0].bytes + 1}}};
  RecordingSink sink(checkpoint, requests, false, false);
  try {
    stream_tensors(checkpoint, requests, sink, StreamOptions{});
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(error.what(), HasSubstr("lies outside"));
    EXPECT_THAT(error.what(), HasSubstr("t00000"));
  }
}

TEST(Streamer, MemoryLimitBelowOnePageIsRefused) {
  // A staging buffer is at least one page: a smaller limit cannot be honoured, so a library
  // caller who asks for one gets an error, not a pool above its limit.
  TempDir directory;
  write_checkpoint(directory.path(), 5, 1, 1);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  auto requests = all_tensors(checkpoint);
  RecordingSink sink(checkpoint, requests, false, false);
  StreamOptions options;
  options.memory_limit = 1024;
  try {
    stream_tensors(checkpoint, requests, sink, options);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(error.what(), HasSubstr("memory_limit 1024 bytes is too small: at least 4KiB"));
  }
  options.memory_limit = kMinStagingBytes;
  auto stats = stream_tensors(checkpoint, requests, sink, options);
  sink.expect_exactly_once();
  EXPECT_LE(stats.peak_staging_bytes, kMinStagingBytes);
}

/// A storage whose reads wait until the test opens the gate.
class GatedStorage : public Storage {
 public:
  explicit GatedStorage(std::unique_ptr<Storage> inner) : inner_(std::move(inner)) {}
  std::string root_uri() const override { return inner_->root_uri(); }
  std::string object_uri(std::string_view name) const override { return inner_->object_uri(name); }
  std::vector<ObjectInfo> list() override { return inner_->list(); }
  ObjectInfo stat(std::string_view name) override { return inner_->stat(name); }
  void read(std::string_view name, uint64_t offset, std::span<std::byte> destination) override {
    {
      std::unique_lock lock(mutex_);
      opened_.wait(lock, [&] { return open_; });
    }
    inner_->read(name, offset, destination);
  }
  void open() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    opened_.notify_all();
  }
  void close() {
    std::lock_guard lock(mutex_);
    open_ = false;
  }

 private:
  std::unique_ptr<Storage> inner_;
  std::mutex mutex_;
  std::condition_variable opened_;
  bool open_ = true;
};

TEST(Streamer, ProgressKeepsComingWhileReadsWaitAndEndsWithTheTotal) {
  TempDir directory;
  write_checkpoint(directory.path(), 8, 1, 2);
  auto gated = std::make_shared<GatedStorage>(open_local_storage(directory.path().string(), LocalIo::kPread));
  auto checkpoint = Checkpoint::open(gated, "");
  gated->close();
  auto requests = all_tensors(checkpoint);
  RecordingSink sink(checkpoint, requests, false, false);
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  // The gate opens from the progress callback after a few calls, so the stream can end only
  // if the callback goes on being called while every read waits.
  auto stats = stream_tensors(checkpoint, requests, sink, StreamOptions{}, [&](uint64_t done, uint64_t total) {
    calls.emplace_back(done, total);
    if (calls.size() == 3) gated->open();
  });
  sink.expect_exactly_once();
  ASSERT_GE(calls.size(), 4u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(calls[i].first, 0u);
  EXPECT_EQ(calls.back(), std::make_pair(stats.bytes, stats.bytes));
}

/// A storage that fails every read at or past `fail_from` bytes of `fail_object`.
class FailingStorage : public Storage {
 public:
  FailingStorage(std::unique_ptr<Storage> inner, std::string fail_object, uint64_t fail_from)
      : inner_(std::move(inner)), fail_object_(std::move(fail_object)), fail_from_(fail_from) {}
  std::string root_uri() const override { return inner_->root_uri(); }
  std::string object_uri(std::string_view name) const override { return inner_->object_uri(name); }
  std::vector<ObjectInfo> list() override { return inner_->list(); }
  ObjectInfo stat(std::string_view name) override { return inner_->stat(name); }
  void read(std::string_view name, uint64_t offset, std::span<std::byte> destination) override {
    ++reads_;
    if (armed_ && name == fail_object_ && offset + destination.size() > fail_from_) {
      WS_FAIL(ErrorCode::kIo, "cannot read " + std::to_string(offset) + "+" + std::to_string(destination.size()) +
                                  " bytes of " + object_uri(name) + ": injected fault");
    }
    inner_->read(name, offset, destination);
  }
  bool armed_ = false;
  std::atomic<uint64_t> reads_{0};

 private:
  std::unique_ptr<Storage> inner_;
  std::string fail_object_;
  uint64_t fail_from_;
};

TEST(Streamer, FirstStorageErrorCancelsTheOtherReadersAndIsReported) {
  TempDir directory;
  write_checkpoint(directory.path(), 200, 1, 3);
  auto failing = std::make_shared<FailingStorage>(open_local_storage(directory.path().string(), LocalIo::kPread),
                                                  "model-1.safetensors", 0);
  auto checkpoint = Checkpoint::open(failing, "");
  failing->armed_ = true;
  failing->reads_ = 0;
  auto requests = all_tensors(checkpoint);
  RecordingSink sink(checkpoint, requests, false, false);
  StreamOptions options;
  options.concurrency = 4;
  options.memory_limit = 64 * kKiB;
  options.chunk_bytes = 16 * kKiB;
  try {
    stream_tensors(checkpoint, requests, sink, options);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kIo);
    EXPECT_THAT(error.what(), HasSubstr("model-1.safetensors: injected fault"));
  }
  // Every read fails, so the readers stop after at most one failed read each.
  EXPECT_LE(failing->reads_.load(), options.concurrency);
}

TEST(Streamer, SinkErrorStopsTheStream) {
  TempDir directory;
  write_checkpoint(directory.path(), 100, 2, 5);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  auto requests = all_tensors(checkpoint);
  struct ThrowingSink : TensorSink {
    std::atomic<int> consumed{0};
    void consume(TensorPiece&& piece) override {
      if (++consumed == 10) WS_FAIL(ErrorCode::kModel, "tensor '" + piece.tensor->name + "' rejected by the sink");
    }
  } sink;
  StreamOptions options;
  options.concurrency = 4;
  options.memory_limit = 64 * kKiB;
  options.chunk_bytes = 16 * kKiB;
  EXPECT_THROW(
      {
        try {
          stream_tensors(checkpoint, requests, sink, options);
        } catch (const Error& error) {
          EXPECT_THAT(error.what(), HasSubstr("rejected by the sink"));
          throw;
        }
      },
      Error);
  // Stopped early: fewer pieces than a whole stream of the same options delivers.
  struct CountingSink : TensorSink {
    std::atomic<int> consumed{0};
    void consume(TensorPiece&&) override { ++consumed; }
  } whole;
  stream_tensors(checkpoint, requests, whole, options);
  EXPECT_LT(sink.consumed.load(), whole.consumed.load() / 2);
}

TEST(Digest, MatchesHashOfTheWholeTensor) {
  TempDir directory;
  auto sizes = write_checkpoint(directory.path(), 30, 2, 11);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  StreamOptions options;
  options.memory_limit = 64 * kKiB;
  options.chunk_bytes = 16 * kKiB;
  options.concurrency = 8;
  for (auto kind : {HashKind::kSha256, HashKind::kXxh64}) {
    StreamStats stats;
    auto digests = digest_streamed(checkpoint, kind, options, &stats);
    ASSERT_EQ(digests.size(), checkpoint.tensors().size());
    EXPECT_LE(stats.peak_staging_bytes, options.memory_limit);
    for (size_t i = 0; i < digests.size(); ++i) {
      size_t source = std::stoul(digests[i].name.substr(1));
      std::vector<std::byte> bytes(sizes[source]);
      for (uint64_t offset = 0; offset < bytes.size(); ++offset) bytes[offset] = expected_byte(source, offset);
      Hasher hasher(kind);
      hasher.update(bytes);
      EXPECT_EQ(digests[i].hex, hasher.finish()) << digests[i].name;
    }
  }
}

/// "code: message" of the Error `action` throws, or "no error".
std::string thrown_text(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    return std::string(error_code_name(error.code())) + ": " + error.what();
  }
  return "no error";
}

TEST(Digest, SeveralKindsInOnePassEqualEachAlone) {
  TempDir directory;
  write_checkpoint(directory.path(), 12, 2, 17);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  StreamOptions options;
  options.memory_limit = 64 * kKiB;
  options.chunk_bytes = 16 * kKiB;
  auto both = digest_streamed(checkpoint, {HashKind::kSha256, HashKind::kXxh64}, options);
  ASSERT_EQ(both.size(), 2u);
  auto sha = digest_streamed(checkpoint, HashKind::kSha256, options);
  auto xxh = digest_streamed(checkpoint, HashKind::kXxh64, options);
  for (size_t i = 0; i < sha.size(); ++i) {
    EXPECT_EQ(both[0][i].hex, sha[i].hex) << sha[i].name;
    EXPECT_EQ(both[1][i].hex, xxh[i].hex) << xxh[i].name;
  }
  EXPECT_THAT(thrown_text([&] { digest_streamed(checkpoint, std::vector<HashKind>{}, options); }),
              HasSubstr("no hash kind asked for"));
}

// The content digest (issue 45): xxh64 over every tensor's name, dtype, shape and xxh64, in
// name order; one byte of one tensor changes it, and the shards' layout does not enter it.
TEST(Digest, ContentDigestCoversEveryTensorsBytesInNameOrder) {
  TempDir directory;
  write_checkpoint(directory.path(), 9, 2, 23);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  auto xxh = digest_streamed(checkpoint, HashKind::kXxh64, StreamOptions{});
  const std::string root = content_digest(checkpoint, xxh);
  ASSERT_EQ(root.size(), 16u);
  EXPECT_EQ(root, checkpoint_content_digest(checkpoint, StreamOptions{}));

  std::vector<size_t> order(checkpoint.tensors().size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return checkpoint.tensors()[a].name < checkpoint.tensors()[b].name; });
  Hasher expected(HashKind::kXxh64);
  for (size_t i : order) {
    const CheckpointTensor& tensor = checkpoint.tensors()[i];
    for (const std::string& field : {tensor.name, std::string(dtype_name(tensor.dtype)), shape_text(tensor.shape), xxh[i].hex}) {
      const std::string line = field + "\n";
      expected.update(std::as_bytes(std::span(line.data(), line.size())));
    }
  }
  EXPECT_EQ(root, expected.finish());

  // One byte of one tensor, in a copy of the shard.
  const CheckpointTensor& tensor = checkpoint.tensors()[checkpoint.tensors().size() / 2];
  ASSERT_GT(tensor.bytes, 0u);
  const auto shard = directory.path() / checkpoint.shards()[tensor.shard].name;
  {
    std::fstream file(shard, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(static_cast<std::streamoff>(tensor.offset + tensor.bytes / 2));
    char byte = 0;
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x01);
    file.seekp(static_cast<std::streamoff>(tensor.offset + tensor.bytes / 2));
    file.write(&byte, 1);
  }
  auto flipped = Checkpoint::open(directory.path().string(), Options{});
  const std::string changed = checkpoint_content_digest(flipped, StreamOptions{});
  EXPECT_NE(changed, root);

  EXPECT_THAT(thrown_text([&] { content_digest(checkpoint, std::span(xxh).first(xxh.size() - 1)); }),
              HasSubstr("invalid_argument: cannot compute the content digest of " + checkpoint.uri() + ": " +
                        std::to_string(xxh.size() - 1) + " tensor digests for its " + std::to_string(xxh.size()) +
                        " tensors"));
  auto sha = digest_streamed(checkpoint, HashKind::kSha256, StreamOptions{});
  EXPECT_THAT(thrown_text([&] { content_digest(checkpoint, sha); }), HasSubstr("is not the xxh64 of tensor"));
}

TEST(Hasher, KnownVectors) {
  Hasher sha(HashKind::kSha256);
  std::string abc = "abc";
  sha.update(std::as_bytes(std::span(abc.data(), abc.size())));
  EXPECT_EQ(sha.finish(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  Hasher empty(HashKind::kXxh64);
  EXPECT_EQ(empty.finish(), "ef46db3751d8e999");
}

TEST(Load, HostArenaHoldsEveryTensor) {
  TempDir directory;
  auto sizes = write_checkpoint(directory.path(), 40, 3, 13);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  StreamOptions options;
  options.memory_limit = 64 * kKiB;
  options.local_io = LocalIo::kPread;  // copies into the arena (the default takes them in place)
  auto loaded = load_checkpoint(checkpoint, Device{}, options);
  ASSERT_EQ(loaded.tensors.size(), checkpoint.tensors().size());
  EXPECT_EQ(loaded.stats.bytes, checkpoint.tensor_bytes());
  for (size_t i = 0; i < loaded.tensors.size(); ++i) {
    size_t source = std::stoul(checkpoint.tensors()[i].name.substr(1));
    ASSERT_EQ(loaded.tensors[i].bytes, sizes[source]);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(loaded.tensors[i].data) % 256, 0u);
    for (uint64_t offset = 0; offset < loaded.tensors[i].bytes; ++offset) {
      ASSERT_EQ(loaded.tensors[i].data[offset], expected_byte(source, offset)) << checkpoint.tensors()[i].name;
    }
  }
}

TEST(Load, EveryLocalIoModeReadsTheSameBytes) {
  TempDir directory;
  write_checkpoint(directory.path(), 30, 2, 17);
  std::vector<LocalIo> modes = {LocalIo::kPread, LocalIo::kDirect, LocalIo::kMmap};
#ifdef WS_HAVE_URING
  modes.push_back(LocalIo::kUring);
#endif
  std::vector<std::string> reference;
  for (auto mode : modes) {
    Options options;
    options.stream.local_io = mode;
    options.stream.memory_limit = 256 * kKiB;
    options.stream.chunk_bytes = 64 * kKiB;
    Checkpoint checkpoint = [&] {
      try {
        return Checkpoint::open(directory.path().string(), options);
      } catch (const Error& error) {
        // Some file systems (tmpfs) refuse O_DIRECT; that is reported, not hidden.
        EXPECT_THAT(error.what(), HasSubstr("O_DIRECT"));
        return Checkpoint::open(directory.path().string(), Options{});
      }
    }();
    auto digests = digest_streamed(checkpoint, HashKind::kXxh64, options.stream);
    std::vector<std::string> hexes;
    for (auto& digest : digests) hexes.push_back(digest.name + ":" + digest.hex);
    if (reference.empty()) reference = hexes;
    else EXPECT_EQ(hexes, reference);
  }
}

// Prefetchers map reads ahead of the readers and drop them behind (--io mmap): with more
// of them than readers, few readers, reads of a few pages and a slow consumer, every byte
// still arrives once and equal to what pread delivers; an error still cancels the stream.
TEST(Stream, PrefetchersChangeNoByteOfAMappedStream) {
  TempDir directory;
  write_checkpoint(directory.path(), 60, 3, 29);
  Options pread_options;
  pread_options.stream.memory_limit = 256 * kKiB;
  pread_options.stream.chunk_bytes = 16 * kKiB;
  auto reference = digest_streamed(Checkpoint::open(directory.path().string(), pread_options), HashKind::kXxh64,
                                   pread_options.stream);
  for (unsigned prefetchers : {0u, 1u, 6u}) {
    Options options = pread_options;
    options.stream.local_io = LocalIo::kMmap;
    options.stream.concurrency = 2;
    options.stream.prefetchers = prefetchers;
    auto checkpoint = Checkpoint::open(directory.path().string(), options);
    auto digests = digest_streamed(checkpoint, HashKind::kXxh64, options.stream);
    ASSERT_EQ(digests.size(), reference.size());
    for (size_t i = 0; i < digests.size(); ++i) {
      EXPECT_EQ(digests[i].hex, reference[i].hex) << digests[i].name << " with " << prefetchers << " prefetchers";
    }
    auto loaded = load_checkpoint(checkpoint, Device{}, options.stream);
    EXPECT_EQ(loaded.stats.bytes, checkpoint.tensor_bytes());
  }
}

TEST(Stream, ACancelledStreamWithPrefetchersReturnsTheCallersError) {
  TempDir directory;
  write_checkpoint(directory.path(), 60, 3, 29);
  Options options;
  options.stream.local_io = LocalIo::kMmap;
  options.stream.memory_limit = 256 * kKiB;
  options.stream.chunk_bytes = 16 * kKiB;
  options.stream.concurrency = 2;
  options.stream.prefetchers = 4;
  auto checkpoint = Checkpoint::open(directory.path().string(), options);
  struct Stop {};
  EXPECT_THROW(digest_streamed(checkpoint, HashKind::kXxh64, options.stream, nullptr,
                               [](uint64_t, uint64_t) { throw Stop{}; }),
               Stop);
}

}  // namespace
}  // namespace weightstream
