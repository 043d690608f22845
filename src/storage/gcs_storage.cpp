// The GCS backend of Storage: GcsClient seen as an ObjectStore (object_store.hpp), whose
// Storage does the listing, splitting and checking shared with every object store.
#include <algorithm>

#include "storage/gcs_client.hpp"
#include "storage/object_store.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream {
namespace {

class GcsBucket final : public storage::ObjectStore {
 public:
  GcsBucket(std::string bucket, const GcsOptions& options, const S3Options& transfer)
      : bucket_(std::move(bucket)), client_(options, transfer) {}

  std::string uri(std::string_view key) const override { return gcs::gcs_uri(bucket_, key); }

  std::vector<storage::ListedKey> list(std::string_view prefix) override {
    // The delimiter keeps "subdirectories" out: the root is one level, like a directory.
    return client_.list_objects(bucket_, prefix, "/");
  }

  storage::ObjectMetadata metadata(std::string_view key, bool) override { return client_.metadata(bucket_, key); }

  void read(std::string_view key, uint64_t offset, std::span<const std::span<std::byte>> segments,
            std::optional<uint64_t> whole_object_size) override {
    client_.get_range(bucket_, key, offset, segments, whole_object_size);
  }

  const S3Options& transfer() const override { return client_.transfer(); }
  StorageStats stats() const override { return client_.stats(); }

 private:
  std::string bucket_;
  gcs::GcsClient client_;
};

}  // namespace

bool gcs::valid_bucket_name(std::string_view bucket) {
  // https://cloud.google.com/storage/docs/buckets#naming: 3-63 characters (up to 222 with
  // dots) of lowercase letters, digits, '-', '_' and '.', starting and ending with a letter or digit.
  auto alphanumeric = [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); };
  const size_t limit = bucket.find('.') == std::string_view::npos ? 63 : 222;
  return bucket.size() >= 3 && bucket.size() <= limit && alphanumeric(bucket.front()) && alphanumeric(bucket.back()) &&
         std::all_of(bucket.begin(), bucket.end(),
                     [&](char c) { return alphanumeric(c) || c == '-' || c == '_' || c == '.'; });
}

std::unique_ptr<Storage> open_gcs_storage(const std::string& bucket, const std::string& prefix, const Options& options) {
  WS_EXPECT(gcs::valid_bucket_name(bucket), ErrorCode::kInvalidArgument,
            "'" + bucket + "' is not a valid GCS bucket name (3-63 characters: a-z, 0-9, '-', '_', '.')");
  std::unique_ptr<GcsBucket> store;
  try {
    store = std::make_unique<GcsBucket>(bucket, options.gcs, options.s3);
  } catch (const Error& error) {
    // A key file that cannot be used fails here, before any request: say which root it was for.
    std::string root = gcs::gcs_uri(bucket, prefix);
    while (root.ends_with('/')) root.pop_back();
    WS_FAIL(error.code(), "cannot open " + root + ": " + error.what());
  }
  return storage::make_object_store_storage(std::move(store), prefix);
}

}  // namespace weightstream
