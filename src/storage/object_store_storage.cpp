// The Storage of every object store (s3://, gs://, az://): a prefix of a bucket seen as a flat
// directory, read in parallel ranged requests.
#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>

#include "base/parallel.hpp"
#include "storage/object_store.hpp"
#include "storage/shared/read_destination.hpp"
#include "storage/s3_checksum.hpp"
#include "weightstream/error.hpp"

namespace weightstream::storage {
namespace {

class ObjectStoreStorage final : public Storage {
 public:
  ObjectStoreStorage(std::unique_ptr<ObjectStore> store, std::string prefix)
      : store_(std::move(store)), prefix_(std::move(prefix)) {}

  std::string root_uri() const override {
    std::string uri = store_->uri(prefix_);
    while (uri.ends_with('/')) uri.pop_back();
    return uri;
  }

  std::string object_uri(std::string_view name) const override { return store_->uri(key_of(name)); }

  std::vector<ObjectInfo> list() override {
    auto objects = store_->list(prefix_);
    std::vector<ObjectInfo> result;
    std::lock_guard lock(mutex_);
    for (auto& object : objects) {
      // Keys outside the prefix would be a broken server; a key equal to the prefix is a
      // "directory marker" some tools create. Neither is an object of this root.
      if (!std::string_view(object.key).starts_with(prefix_) || object.key.size() == prefix_.size()) continue;
      std::string name = object.key.substr(prefix_.size());
      if (name.find('/') != std::string::npos) continue;  // below the root: not ours to show
      sizes_[name] = object.size;
      result.push_back({std::move(name), object.size});
    }
    return result;
  }

  ObjectInfo stat(std::string_view name) override {
    auto metadata = store_->metadata(key_of(name), false);
    std::lock_guard lock(mutex_);
    sizes_[std::string(name)] = metadata.size;
    return {std::string(name), metadata.size};
  }

  void read(std::string_view name, uint64_t offset, std::span<std::byte> destination) override {
    const std::span<std::byte> segments[] = {destination};
    read_scattered(name, offset, segments);
  }

  // A GET's first byte takes tens of milliseconds; one connection moves about 1 MiB in 10-15
  // ms, so a gap up to 1 MiB between runs is cheaper fetched than skipped by another request.
  uint64_t run_merge_gap() const override { return 1024 * 1024; }

  // Neighbouring tensors read into their own memory come as one range: one GET (or one per
  // request_bytes) rather than one a tensor, as each costs a round trip and a request's fee.
  void read_scattered(std::string_view name, uint64_t offset, std::span<const std::span<std::byte>> segments) override {
    const uint64_t size = segments_bytes(segments);
    const std::string key = key_of(name);
    WS_EXPECT(offset <= UINT64_MAX - size, ErrorCode::kInvalidArgument,
              "cannot read " + std::to_string(offset) + "+" + std::to_string(size) + " bytes of " + store_->uri(key) +
                  ": the range overflows");
    if (size == 0) return;
    std::optional<uint64_t> known_size;
    {
      std::lock_guard lock(mutex_);
      if (auto it = sizes_.find(std::string(name)); it != sizes_.end()) known_size = it->second;
    }
    if (known_size && offset + size > *known_size) {
      WS_FAIL(ErrorCode::kIo, "cannot read " + std::to_string(offset) + "+" + std::to_string(size) + " bytes of " +
                                  store_->uri(key) + ": past the end of the " + std::to_string(*known_size) +
                                  "-byte object");
    }
    for (std::span<std::byte> segment : segments) populate_destination(segment);
    // A whole object in one piece of memory is compared with the checksums the store kept.
    const bool whole = known_size && offset == 0 && size == *known_size && segments.size() == 1;
    const uint64_t piece = std::max<uint64_t>(store_->transfer().request_bytes, 1);
    if (size <= piece) {
      store_->read(key, offset, segments, whole ? known_size : std::nullopt);
      return;
    }
    if (!whole) {
      read_pieces(key, offset, segments, piece);
      return;
    }
    // A whole object read in pieces is compared with the checksums the store kept, when it
    // has any; ranged GETs do not carry them, so one metadata request asks for them. A
    // mismatch (bytes spoiled in transit with their length intact) reads the object again,
    // within the same attempt bound as a single request.
    auto metadata = store_->metadata(key, true);
    const unsigned attempts = std::max(1u, store_->transfer().max_attempts);
    for (unsigned attempt = 1;; ++attempt) {
      read_pieces(key, offset, segments, piece);
      auto mismatch = checksum_mismatch(metadata, segments[0]);
      if (!mismatch) return;
      ++checksum_failures_;
      WS_EXPECT(attempt < attempts, ErrorCode::kNetwork,
                "cannot read 0+" + std::to_string(size) + " bytes of " + store_->uri(key) + ": " + *mismatch +
                    ", after " + std::to_string(attempt) + (attempt == 1 ? " read" : " reads") + " of the whole object");
    }
  }

  unsigned preferred_concurrency() const override { return std::max(1u, store_->transfer().max_connections); }

  StorageStats stats() const override {
    StorageStats stats = store_->stats();
    stats.checksum_failures += checksum_failures_.load();
    return stats;
  }

 private:
  // Names are plain object names under the prefix, as for local files: no '/', which
  // would reach into another "directory", and no dot segments.
  std::string key_of(std::string_view name) const {
    WS_EXPECT(!name.empty() && name.find('/') == std::string_view::npos && name != "." && name != "..",
              ErrorCode::kInvalidArgument, "'" + std::string(name) + "' is not a plain object name in " + root_uri());
    return prefix_ + std::string(name);
  }

  // A read larger than request_bytes becomes parallel ranged GETs: the caller sees one
  // result, and the first failure stops the other workers and is the error it gets.
  void read_pieces(const std::string& key, uint64_t offset, std::span<const std::span<std::byte>> segments,
                   uint64_t piece) {
    const uint64_t size = segments_bytes(segments);
    const uint64_t pieces = (size + piece - 1) / piece;
    detail::run_parallel(pieces, std::max(1u, store_->transfer().max_connections), [&](size_t, size_t index) {
      const uint64_t begin = index * piece;
      const uint64_t length = std::min(piece, size - begin);
      store_->read(key, offset + begin, slice_segments(segments, begin, length), std::nullopt);
    });
  }

  // Why `bytes` do not match the checksums of `metadata`, or nullopt when they match or
  // there are none (a multipart object's composite checksum, "…-N", covers parts, not the whole).
  static std::optional<std::string> checksum_mismatch(const ObjectMetadata& metadata, std::span<const std::byte> bytes) {
    auto differs = [](const std::string& expected, const std::string& actual) {
      return !expected.empty() && expected.find('-') == std::string::npos && expected != actual;
    };
    if (!metadata.crc32c.empty()) {
      auto actual = s3::crc32c_header_value(bytes);
      if (differs(metadata.crc32c, actual))
        return "checksum mismatch: " + metadata.crc32c_name + " is " + metadata.crc32c.substr(0, 20) +
               " but the bytes received give " + actual;
    }
    if (!metadata.sha256.empty()) {
      auto actual = s3::sha256_header_value(bytes);
      if (differs(metadata.sha256, actual))
        return "checksum mismatch: " + metadata.sha256_name + " is " + metadata.sha256.substr(0, 60) +
               " but the bytes received give " + actual;
    }
    return std::nullopt;
  }

  std::unique_ptr<ObjectStore> store_;
  std::string prefix_;  ///< empty, or ends with '/'
  std::mutex mutex_;
  std::map<std::string, uint64_t, std::less<>> sizes_;  ///< sizes seen by list() and stat()
  std::atomic<uint64_t> checksum_failures_{0};  ///< whole objects read in pieces that did not match
};

}  // namespace

std::unique_ptr<Storage> make_object_store_storage(std::unique_ptr<ObjectStore> store, std::string prefix) {
  while (prefix.starts_with('/')) prefix.erase(0, 1);
  if (!prefix.empty() && !prefix.ends_with('/')) prefix += '/';
  return std::make_unique<ObjectStoreStorage>(std::move(store), std::move(prefix));
}

}  // namespace weightstream::storage
