// The Azure Blob backend of Storage: BlobClient seen as an ObjectStore (object_store.hpp), whose
// Storage does the listing, splitting and checking shared with every object store.
#include "storage/azure_client.hpp"
#include "storage/object_store.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream {
namespace {

class AzureContainer final : public storage::ObjectStore {
 public:
  AzureContainer(std::string account, std::string container, std::string_view endpoint, const AzureOptions& options,
                 const S3Options& transfer)
      : container_(std::move(container)), client_(std::move(account), endpoint, options, transfer) {}

  std::string uri(std::string_view key) const override { return azure::azure_uri(client_.account(), container_, key); }

  std::vector<storage::ListedKey> list(std::string_view prefix) override {
    // The delimiter keeps "subdirectories" out: the root is one level, like a directory.
    return client_.list_blobs(container_, prefix, "/");
  }

  storage::ObjectMetadata metadata(std::string_view key, bool) override { return client_.metadata(container_, key); }

  void read(std::string_view key, uint64_t offset, std::span<const std::span<std::byte>> segments,
            std::optional<uint64_t> whole_object_size) override {
    client_.get_range(container_, key, offset, segments, whole_object_size);
  }

  const S3Options& transfer() const override { return client_.transfer(); }
  StorageStats stats() const override { return client_.stats(); }

 private:
  std::string container_;
  azure::BlobClient client_;
};

}  // namespace

std::unique_ptr<Storage> open_azure_storage(const std::string& account, const std::string& container,
                                            const std::string& prefix, const Options& options,
                                            const std::string& endpoint) {
  WS_EXPECT(azure::valid_account_name(account), ErrorCode::kInvalidArgument,
            "'" + account + "' is not a valid Azure storage account name (3-24 characters: a-z, 0-9)");
  WS_EXPECT(azure::valid_container_name(container), ErrorCode::kInvalidArgument,
            "'" + container + "' is not a valid Azure container name (3-63 characters: a-z, 0-9, '-')");
  std::unique_ptr<AzureContainer> store;
  try {
    store = std::make_unique<AzureContainer>(account, container, endpoint, options.azure, options.s3);
  } catch (const Error& error) {
    // Credentials that cannot be used fail here, before any request: say which root they were for.
    std::string root = azure::azure_uri(account, container, prefix);
    while (root.ends_with('/')) root.pop_back();
    WS_FAIL(error.code(), "cannot open " + root + ": " + error.what());
  }
  return storage::make_object_store_storage(std::move(store), prefix);
}

}  // namespace weightstream
