// The S3 backend of Storage: a prefix of a bucket seen as a flat directory.
#include <algorithm>
#include <map>
#include <mutex>

#include "base/parallel.hpp"
#include "storage/s3_checksum.hpp"
#include "storage/read_destination.hpp"
#include "storage/s3_client.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream {
namespace {

class S3Storage final : public Storage {
 public:
  S3Storage(std::string bucket, std::string prefix, const S3Options& options)
      : bucket_(std::move(bucket)), prefix_(std::move(prefix)), client_(options) {}

  std::string root_uri() const override {
    std::string_view prefix = prefix_;
    if (prefix.ends_with('/')) prefix.remove_suffix(1);
    return "s3://" + bucket_ + (prefix.empty() ? "" : "/" + std::string(prefix));
  }

  std::string object_uri(std::string_view name) const override { return s3::s3_uri(bucket_, key_of(name)); }

  std::vector<ObjectInfo> list() override {
    // The delimiter keeps "subdirectories" out: the root is one level, like a directory.
    auto objects = client_.list_objects(bucket_, prefix_, "/");
    std::vector<ObjectInfo> result;
    std::lock_guard lock(mutex_);
    for (auto& object : objects) {
      // Keys outside the prefix would be a broken server; a key equal to the prefix is a
      // "directory marker" some tools create. Neither is an object of this root.
      if (!std::string_view(object.key).starts_with(prefix_) || object.key.size() == prefix_.size()) continue;
      std::string name = object.key.substr(prefix_.size());
      sizes_[name] = object.size;
      result.push_back({std::move(name), object.size});
    }
    return result;
  }

  ObjectInfo stat(std::string_view name) override {
    auto head = client_.head_object(bucket_, key_of(name));
    std::lock_guard lock(mutex_);
    sizes_[std::string(name)] = head.size;
    return {std::string(name), head.size};
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
    const uint64_t size = storage::segments_bytes(segments);
    const std::string key = key_of(name);
    WS_EXPECT(offset <= UINT64_MAX - size, ErrorCode::kInvalidArgument,
              "cannot read " + std::to_string(offset) + "+" + std::to_string(size) + " bytes of " +
                  s3::s3_uri(bucket_, key) + ": the range overflows");
    if (size == 0) return;
    std::optional<uint64_t> known_size;
    {
      std::lock_guard lock(mutex_);
      if (auto it = sizes_.find(std::string(name)); it != sizes_.end()) known_size = it->second;
    }
    if (known_size && offset + size > *known_size) {
      WS_FAIL(ErrorCode::kIo,
              "cannot read " + std::to_string(offset) + "+" + std::to_string(size) + " bytes of " +
                  s3::s3_uri(bucket_, key) + ": past the end of the " + std::to_string(*known_size) + "-byte object");
    }
    for (std::span<std::byte> segment : segments) storage::populate_destination(segment);
    // A whole object in one piece of memory is compared with the checksums S3 stored.
    const bool whole = known_size && offset == 0 && size == *known_size && segments.size() == 1;
    const uint64_t piece = std::max<uint64_t>(client_.options().request_bytes, 1);
    if (size <= piece) {
      client_.get_range(bucket_, key, offset, segments, whole ? known_size : std::nullopt);
      return;
    }
    if (!whole) {
      read_pieces(key, offset, segments, piece);
      return;
    }
    // A whole object read in pieces is compared with the checksums S3 stored, when it has
    // any; ranged GETs do not carry them, so one HEAD asks for them. A mismatch (bytes
    // spoiled in transit with their length intact) reads the object again, within the
    // same attempt bound as a single request.
    auto head = client_.head_object(bucket_, key, true);
    const unsigned attempts = std::max(1u, client_.options().max_attempts);
    for (unsigned attempt = 1;; ++attempt) {
      read_pieces(key, offset, segments, piece);
      auto mismatch = checksum_mismatch(head, segments[0]);
      if (!mismatch) return;
      WS_EXPECT(attempt < attempts, ErrorCode::kNetwork,
                "cannot read 0+" + std::to_string(size) + " bytes of " + s3::s3_uri(bucket_, key) + ": " + *mismatch +
                    ", after " + std::to_string(attempt) + (attempt == 1 ? " read" : " reads") + " of the whole object");
    }
  }

  unsigned preferred_concurrency() const override { return std::max(1u, client_.options().max_connections); }

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
    const uint64_t size = storage::segments_bytes(segments);
    const uint64_t pieces = (size + piece - 1) / piece;
    detail::run_parallel(pieces, std::max(1u, client_.options().max_connections), [&](size_t, size_t index) {
      const uint64_t begin = index * piece;
      const uint64_t length = std::min(piece, size - begin);
      client_.get_range(bucket_, key, offset + begin, storage::slice_segments(segments, begin, length));
    });
  }

  // Why `bytes` do not match the checksums of `head`, or nullopt when they match or there
  // are none (a multipart object's composite checksum, "…-N", covers parts, not the whole).
  static std::optional<std::string> checksum_mismatch(const s3::ObjectHead& head, std::span<const std::byte> bytes) {
    auto differs = [](const std::string& expected, const std::string& actual) {
      return !expected.empty() && expected.find('-') == std::string::npos && expected != actual;
    };
    if (!head.checksum_crc32c.empty()) {
      auto actual = s3::crc32c_header_value(bytes);
      if (differs(head.checksum_crc32c, actual))
        return "checksum mismatch: x-amz-checksum-crc32c is " + head.checksum_crc32c.substr(0, 20) +
               " but the bytes received give " + actual;
    }
    if (!head.checksum_sha256.empty()) {
      auto actual = s3::sha256_header_value(bytes);
      if (differs(head.checksum_sha256, actual))
        return "checksum mismatch: x-amz-checksum-sha256 is " + head.checksum_sha256.substr(0, 60) +
               " but the bytes received give " + actual;
    }
    return std::nullopt;
  }

  std::string bucket_;
  std::string prefix_;  ///< empty, or ends with '/'
  s3::S3Client client_;
  std::mutex mutex_;
  std::map<std::string, uint64_t, std::less<>> sizes_;  ///< sizes seen by list() and stat()
};

}  // namespace

std::unique_ptr<Storage> open_s3_storage(const std::string& bucket, const std::string& prefix,
                                         const S3Options& options) {
  // Bucket names: 3-63 characters of lowercase letters, digits, dots and hyphens
  // (https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html); some
  // S3-compatible stores allow uppercase and underscores, so only the URL-breaking ones are refused.
  WS_EXPECT(!bucket.empty() && bucket.find_first_of("/?#% ") == std::string::npos, ErrorCode::kInvalidArgument,
            "'" + bucket + "' is not a valid S3 bucket name");
  std::string normalized = prefix;
  while (normalized.starts_with('/')) normalized.erase(0, 1);
  if (!normalized.empty() && !normalized.ends_with('/')) normalized += '/';
  return std::make_unique<S3Storage>(bucket, std::move(normalized), options);
}

std::string presign_s3_url(const std::string& bucket, const std::string& key, const S3Options& options,
                           uint64_t expires_seconds, const std::string& amz_date) {
  WS_EXPECT(!bucket.empty() && !key.empty(), ErrorCode::kInvalidArgument,
            "a presigned URL needs a bucket and a key (s3://BUCKET/KEY)");
  s3::S3Client client(options);
  return client.presign_get(bucket, key, expires_seconds, amz_date.empty() ? s3::amz_date_now() : amz_date);
}

}  // namespace weightstream
