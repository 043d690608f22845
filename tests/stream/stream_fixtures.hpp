#pragma once
// Shared by the stream layer's tests: a checkpoint of pseudo-random U8 tensors whose bytes
// are known, and a sink that checks every byte lands once at its place with its value.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "weightstream/format.hpp"
#include "weightstream/options.hpp"
#include "weightstream/stream.hpp"

namespace weightstream::testing {

/// Deterministic bytes of tensor `index` at `offset`.
inline std::byte expected_byte(size_t index, uint64_t offset) {
  return static_cast<std::byte>((index * 131 + offset * 7 + (offset >> 9)) & 0xff);
}

/// Writes `shards` files holding `count` U8 tensors of pseudo-random sizes (some larger than
/// 1 MiB) and returns the directory's tensor sizes.
inline std::vector<uint64_t> write_checkpoint(const std::filesystem::path& directory, size_t count, size_t shards,
                                       uint64_t seed, uint64_t max_bytes = 3 * kMiB) {
  std::mt19937_64 random(seed);
  std::vector<uint64_t> sizes(count);
  std::vector<SafetensorsWriter> writers(shards);
  for (size_t i = 0; i < count; ++i) {
    uint64_t size = (i % 7 == 0) ? random() % max_bytes : random() % 9000;
    if (i == 3) size = 0;  // an empty tensor
    sizes[i] = size;
    std::vector<std::byte> bytes(size);
    for (uint64_t offset = 0; offset < size; ++offset) bytes[offset] = expected_byte(i, offset);
    char name[32];
    std::snprintf(name, sizeof(name), "t%05zu", i);
    writers[i % shards].add(name, Dtype::kU8, {static_cast<int64_t>(size)}, bytes);
  }
  for (size_t shard = 0; shard < shards; ++shard) {
    writers[shard].write(directory / ("model-" + std::to_string(shard + 1) + ".safetensors"));
  }
  return sizes;
}

/// Records every delivered byte and checks it lands once, at the right place, with the
/// right value; also tracks staging memory held by pieces at once.
class RecordingSink : public TensorSink {
 public:
  RecordingSink(const Checkpoint& checkpoint, std::span<const TensorRequest> requests, bool ordered, bool direct)
      : checkpoint_(checkpoint), requests_(requests), ordered_(ordered), direct_(direct) {
    for (const auto& request : requests) {
      uint64_t length = request.range.length ? request.range.length : checkpoint.tensors()[request.tensor].bytes;
      coverage_.emplace_back(length, 0);
      destinations_.emplace_back(length);
    }
    next_offset_.assign(requests.size(), 0);
    completed_.assign(requests.size(), 0);
  }
  std::byte* direct_destination(size_t request) override { return direct_ ? destinations_[request].data() : nullptr; }
  bool wants_ordered_pieces() const override { return ordered_; }
  void consume(TensorPiece&& piece) override {
    std::lock_guard lock(mutex_);
    ASSERT_EQ(piece.tensor, &checkpoint_.tensors()[requests_[piece.request].tensor]);
    if (ordered_) {
      EXPECT_EQ(piece.offset, next_offset_[piece.request]) << "pieces out of order";
      next_offset_[piece.request] += piece.bytes.size();
    }
    auto& coverage = coverage_[piece.request];
    ASSERT_LE(piece.offset + piece.bytes.size(), coverage.size());
    uint64_t base = requests_[piece.request].range.offset;
    size_t tensor_index = requests_[piece.request].tensor;
    const auto& name = checkpoint_.tensors()[tensor_index].name;
    size_t source_index = std::stoul(name.substr(1));
    for (uint64_t i = 0; i < piece.bytes.size(); ++i) {
      ++coverage[piece.offset + i];
      if (piece.bytes[i] != expected_byte(source_index, base + piece.offset + i)) ++wrong_bytes_;
    }
    if (piece.keepalive) held_.insert(piece.keepalive.get());
  }
  void request_complete(size_t request) override {
    std::lock_guard lock(mutex_);
    ++completed_[request];
  }
  void finish() override { ++finishes_; }
  int finishes() const { return finishes_; }
  void expect_exactly_once() {
    EXPECT_EQ(wrong_bytes_, 0u);
    for (size_t r = 0; r < coverage_.size(); ++r) {
      EXPECT_EQ(completed_[r], 1) << "request " << r << " completed " << completed_[r] << " times";
      for (uint64_t i = 0; i < coverage_[r].size(); ++i) {
        if (coverage_[r][i] != 1) {
          ADD_FAILURE() << "request " << r << " byte " << i << " delivered " << int(coverage_[r][i]) << " times";
          return;
        }
      }
    }
  }
  size_t distinct_buffers() const { return held_.size(); }

 private:
  const Checkpoint& checkpoint_;
  std::span<const TensorRequest> requests_;
  bool ordered_;
  bool direct_;
  std::mutex mutex_;
  std::vector<std::vector<uint8_t>> coverage_;
  std::vector<std::vector<std::byte>> destinations_;
  std::vector<uint64_t> next_offset_;
  std::vector<int> completed_;
  uint64_t wrong_bytes_ = 0;
  std::set<const void*> held_;
  std::atomic<int> finishes_{0};
};

}  // namespace weightstream::testing
