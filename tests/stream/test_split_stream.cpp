// split_stream: two sources at once into one sink (the GPU's "both" path runs the staged
// and the mapped source this way). Here both sources are the host streamer, so the
// composition is checked on any machine: every byte once under its original request index,
// each request completed once, one finish(), shares and limits divided, the first error wins.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <functional>
#include <set>
#include <thread>

#include "stream/split_stream.hpp"
#include "stream/stream_fixtures.hpp"
#include "support/test_support.hpp"
#include "weightstream/error.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using testing::RecordingSink;
using testing::TempDir;
using testing::write_checkpoint;

/// A host streamer as one source, recording what it was given.
struct RecordedSource {
  const Checkpoint& checkpoint;
  uint64_t bytes = 0;
  unsigned concurrency = 0;
  uint64_t memory_limit = 0;
  std::set<uint32_t> shards;
  std::function<void()> before;  ///< runs in the source before it streams
  StreamStats operator()(std::span<const TensorRequest> requests, TensorSink& sink, const StreamOptions& options,
                         const ProgressCallback& progress) {
    for (const auto& request : requests) {
      const CheckpointTensor& tensor = checkpoint.tensors()[request.tensor];
      bytes += request.range.length ? request.range.length : tensor.bytes - request.range.offset;
      shards.insert(tensor.shard);
    }
    concurrency = options.concurrency;
    memory_limit = options.memory_limit;
    if (before) before();
    return stream_tensors(checkpoint, requests, sink, options, progress);
  }
};

SplitSource source_of(RecordedSource& recorded) {
  return [&recorded](std::span<const TensorRequest> requests, TensorSink& sink, const StreamOptions& options,
                     const ProgressCallback& progress) { return recorded(requests, sink, options, progress); };
}

TEST(SplitStream, EveryByteOnceUnderItsOwnRequestWithTheSharesAskedFor) {
  TempDir directory;
  write_checkpoint(directory.path(), 80, 4, 7);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  auto requests = all_tensors(checkpoint);
  // Part of a tensor too, so a request's range travels with it.
  requests.push_back({0, {5, 11}});
  RecordingSink sink(checkpoint, requests, false, false);
  RecordedSource first{checkpoint}, second{checkpoint};
  StreamOptions options;
  options.concurrency = 8;
  options.memory_limit = 4 * kMiB;
  options.chunk_bytes = 256 * kKiB;
  std::vector<std::pair<uint64_t, uint64_t>> calls;
  std::thread::id caller = std::this_thread::get_id();
  auto stats = split_stream(checkpoint, requests, sink, options,
                            [&](uint64_t done, uint64_t total) {
                              EXPECT_EQ(std::this_thread::get_id(), caller);
                              calls.emplace_back(done, total);
                            },
                            SplitPlan{0.4, 3}, source_of(first), source_of(second));
  sink.expect_exactly_once();
  EXPECT_EQ(sink.finishes(), 1);
  uint64_t total = first.bytes + second.bytes;
  EXPECT_EQ(stats.bytes, total);
  EXPECT_EQ(stats.tensors, requests.size());
  EXPECT_EQ(stats.shards_read, 4u);
  EXPECT_NEAR(static_cast<double>(second.bytes) / static_cast<double>(total), 0.4, 0.1);
  // Both sources work along the whole checkpoint, not one half each.
  EXPECT_EQ(first.shards.size(), 4u);
  EXPECT_EQ(second.shards.size(), 4u);
  EXPECT_EQ(second.concurrency, 3u);
  EXPECT_EQ(first.concurrency, 5u);
  EXPECT_LE(first.memory_limit + second.memory_limit, options.memory_limit);
  ASSERT_FALSE(calls.empty());
  EXPECT_EQ(calls.back(), std::make_pair(total, total));
}

TEST(SplitStream, ASourceWithNoShareIsNotRun) {
  TempDir directory;
  write_checkpoint(directory.path(), 20, 2, 3);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  auto requests = all_tensors(checkpoint);
  for (double share : {0.0, 1.0}) {
    RecordingSink sink(checkpoint, requests, false, false);
    RecordedSource first{checkpoint}, second{checkpoint};
    split_stream(checkpoint, requests, sink, StreamOptions{}, {}, SplitPlan{share, 4}, source_of(first),
                 source_of(second));
    sink.expect_exactly_once();
    EXPECT_EQ(sink.finishes(), 1);
    EXPECT_EQ(share == 0.0 ? second.concurrency : first.concurrency, 0u) << "share " << share;
  }
}

TEST(SplitStream, AFailureInEitherSourceStopsTheOtherAndIsTheErrorThrown) {
  TempDir directory;
  write_checkpoint(directory.path(), 40, 2, 11);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  auto requests = all_tensors(checkpoint);
  for (bool fail_in_second : {false, true}) {
    RecordingSink sink(checkpoint, requests, false, false);
    RecordedSource healthy{checkpoint};
    healthy.before = [] { std::this_thread::sleep_for(std::chrono::milliseconds(150)); };
    SplitSource failing = [&](std::span<const TensorRequest>, TensorSink&, const StreamOptions&,
                              const ProgressCallback&) -> StreamStats {
      WS_FAIL(ErrorCode::kIo, std::string("planted failure in the ") + (fail_in_second ? "second" : "first") + " source");
    };
    try {
      if (fail_in_second) split_stream(checkpoint, requests, sink, StreamOptions{}, {}, SplitPlan{0.5, 2}, source_of(healthy), failing);
      else split_stream(checkpoint, requests, sink, StreamOptions{}, {}, SplitPlan{0.5, 2}, failing, source_of(healthy));
      ADD_FAILURE() << "no error";
    } catch (const Error& error) {
      EXPECT_THAT(error.what(), HasSubstr(std::string("planted failure in the ") + (fail_in_second ? "second" : "first")));
    }
    EXPECT_EQ(sink.finishes(), 1);
  }
}

TEST(SplitStream, AProgressCallbackThatThrowsIsTheErrorThrown) {
  TempDir directory;
  write_checkpoint(directory.path(), 30, 2, 5);
  auto checkpoint = Checkpoint::open(directory.path().string(), Options{});
  auto requests = all_tensors(checkpoint);
  RecordingSink sink(checkpoint, requests, false, false);
  RecordedSource first{checkpoint}, second{checkpoint};
  // The second source is still waiting to start when the caller interrupts.
  second.before = [] { std::this_thread::sleep_for(std::chrono::milliseconds(300)); };
  struct Interrupted {};
  int calls = 0;
  auto progress = [&](uint64_t, uint64_t) {
    ++calls;
    throw Interrupted{};
  };
  EXPECT_THROW(split_stream(checkpoint, requests, sink, StreamOptions{}, progress, SplitPlan{0.5, 2}, source_of(first),
                            source_of(second)),
               Interrupted);
  EXPECT_EQ(calls, 1) << "the callback is not called again once it has thrown";
  EXPECT_EQ(sink.finishes(), 1);
}

}  // namespace
}  // namespace weightstream
