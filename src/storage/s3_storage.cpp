// The S3 backend of Storage: S3Client seen as an ObjectStore (object_store.hpp), whose
// Storage does the listing, splitting and checking shared with every object store.
#include "storage/object_store.hpp"
#include "storage/s3_client.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream {
namespace {

class S3Bucket final : public storage::ObjectStore {
 public:
  S3Bucket(std::string bucket, const S3Options& options) : bucket_(std::move(bucket)), client_(options) {}

  std::string uri(std::string_view key) const override { return s3::s3_uri(bucket_, key); }

  std::vector<storage::ListedKey> list(std::string_view prefix) override {
    // The delimiter keeps "subdirectories" out: the root is one level, like a directory.
    std::vector<storage::ListedKey> keys;
    for (auto& object : client_.list_objects(bucket_, prefix, "/")) keys.push_back({std::move(object.key), object.size});
    return keys;
  }

  storage::ObjectMetadata metadata(std::string_view key, bool checksums) override {
    auto head = client_.head_object(bucket_, key, checksums);
    return {head.size, head.checksum_crc32c, head.checksum_sha256, "x-amz-checksum-crc32c", "x-amz-checksum-sha256"};
  }

  void read(std::string_view key, uint64_t offset, std::span<const std::span<std::byte>> segments,
            std::optional<uint64_t> whole_object_size) override {
    client_.get_range(bucket_, key, offset, segments, whole_object_size);
  }

  const S3Options& transfer() const override { return client_.options(); }
  StorageStats stats() const override { return client_.stats(); }

 private:
  std::string bucket_;
  s3::S3Client client_;
};

}  // namespace

std::unique_ptr<Storage> open_s3_storage(const std::string& bucket, const std::string& prefix,
                                         const S3Options& options) {
  // Bucket names: 3-63 characters of lowercase letters, digits, dots and hyphens
  // (https://docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html); some
  // S3-compatible stores allow uppercase and underscores, so only the URL-breaking ones are refused.
  WS_EXPECT(!bucket.empty() && bucket.find_first_of("/?#% ") == std::string::npos, ErrorCode::kInvalidArgument,
            "'" + bucket + "' is not a valid S3 bucket name");
  return storage::make_object_store_storage(std::make_unique<S3Bucket>(bucket, options), prefix);
}

std::string presign_s3_url(const std::string& bucket, const std::string& key, const S3Options& options,
                           uint64_t expires_seconds, const std::string& amz_date) {
  WS_EXPECT(!bucket.empty() && !key.empty(), ErrorCode::kInvalidArgument,
            "a presigned URL needs a bucket and a key (s3://BUCKET/KEY)");
  s3::S3Client client(options);
  return client.presign_get(bucket, key, expires_seconds, amz_date.empty() ? s3::amz_date_now() : amz_date);
}

}  // namespace weightstream
