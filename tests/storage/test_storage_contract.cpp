// One contract for every Storage backend (after Arrow's generic filesystem tests): the
// same cases run against local files, against S3 (moto's server), against GCS
// (fake-gcs-server) and against Azure Blob (an emulator, where a run has one: see
// test_azure_fixture.hpp). A backend passes
// when it lists, stats and reads as the interface in weightstream/storage.hpp promises,
// and fails with errors that name the object.
#include <fcntl.h>
#include <sys/mman.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <thread>
#include <vector>

#include "storage/local_io.hpp"
#include "storage/azure_client.hpp"
#include "storage/gcs_client.hpp"
#include "storage/test_azure_fixture.hpp"
#include "storage/test_gcs_fixture.hpp"
#include "storage/test_s3_fixture.hpp"
#include "support/test_support.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;

/// Creates objects in one backend and opens a Storage over them.
class Backend {
 public:
  virtual ~Backend() = default;
  /// An object directly under the root.
  virtual void put(const std::string& name, const std::string& bytes) = 0;
  /// An object one level below the root (a "subdirectory"), which list() must not show.
  virtual void put_below(const std::string& directory, const std::string& name, const std::string& bytes) = 0;
  virtual std::unique_ptr<Storage> open() = 0;
};

class LocalBackend final : public Backend {
 public:
  explicit LocalBackend(LocalIo io) : io_(io) {}
  void put(const std::string& name, const std::string& bytes) override { testing::write_file(directory_ / name, bytes); }
  void put_below(const std::string& directory, const std::string& name, const std::string& bytes) override {
    std::filesystem::create_directories(directory_ / directory);
    testing::write_file(directory_ / directory / name, bytes);
  }
  std::unique_ptr<Storage> open() override { return open_local_storage(directory_.path().string(), io_); }

 private:
  LocalIo io_;
  testing::TempDir directory_;
};

class S3Backend final : public Backend {
 public:
  explicit S3Backend(const std::string& endpoint)
      : options_(testing::s3_test_options(endpoint)), bucket_(testing::unique_bucket("contract")), client_(options_) {
    // Small requests so that reads over 64 KiB take the split, parallel path.
    options_.request_bytes = 64 * 1024;
    client_.create_bucket(bucket_);
    // An object beside the prefix, which the root must not see.
    client_.put_object(bucket_, "checkpoint-other/outside.bin", "outside");
  }
  void put(const std::string& name, const std::string& bytes) override {
    client_.put_object(bucket_, std::string(kPrefix) + name, bytes);
  }
  void put_below(const std::string& directory, const std::string& name, const std::string& bytes) override {
    client_.put_object(bucket_, std::string(kPrefix) + directory + "/" + name, bytes);
  }
  std::unique_ptr<Storage> open() override { return open_s3_storage(bucket_, kPrefix, options_); }

 private:
  static constexpr const char* kPrefix = "checkpoint/";
  S3Options options_;
  std::string bucket_;
  s3::S3Client client_;
};

class GcsBackend final : public Backend {
 public:
  explicit GcsBackend(const std::string& endpoint)
      : options_(testing::gcs_test_options(endpoint)),
        bucket_(testing::unique_bucket("contract")),
        client_(options_.gcs, options_.s3) {
    // Small requests so that reads over 64 KiB take the split, parallel path.
    options_.s3.request_bytes = 64 * 1024;
    client_.create_bucket(bucket_);
    // An object beside the prefix, which the root must not see.
    client_.put_object(bucket_, "checkpoint-other/outside.bin", "outside");
  }
  void put(const std::string& name, const std::string& bytes) override {
    client_.put_object(bucket_, std::string(kPrefix) + name, bytes);
  }
  void put_below(const std::string& directory, const std::string& name, const std::string& bytes) override {
    client_.put_object(bucket_, std::string(kPrefix) + directory + "/" + name, bytes);
  }
  std::unique_ptr<Storage> open() override { return open_gcs_storage(bucket_, kPrefix, options_); }

 private:
  static constexpr const char* kPrefix = "checkpoint/";
  Options options_;
  std::string bucket_;
  gcs::GcsClient client_;
};

class AzureBackend final : public Backend {
 public:
  explicit AzureBackend(const std::string& connection_string)
      : options_(testing::azure_test_options(connection_string)),
        container_(testing::unique_container("contract")),
        client_(azure::parse_connection_string(connection_string).account, "", options_.azure, options_.s3) {
    // Small requests so that reads over 64 KiB take the split, parallel path.
    options_.s3.request_bytes = 64 * 1024;
    client_.create_container(container_);
    // A blob beside the prefix, which the root must not see.
    client_.put_blob(container_, "checkpoint-other/outside.bin", "outside");
  }
  void put(const std::string& name, const std::string& bytes) override {
    client_.put_blob(container_, std::string(kPrefix) + name, bytes);
  }
  void put_below(const std::string& directory, const std::string& name, const std::string& bytes) override {
    client_.put_blob(container_, std::string(kPrefix) + directory + "/" + name, bytes);
  }
  std::unique_ptr<Storage> open() override {
    return open_azure_storage(client_.account(), container_, kPrefix, options_);
  }

 private:
  static constexpr const char* kPrefix = "checkpoint/";
  Options options_;
  std::string container_;
  azure::BlobClient client_;
};

class StorageContract : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "local") {
      backend_ = std::make_unique<LocalBackend>(LocalIo::kPread);
    } else if (GetParam() == "local_mmap") {
      backend_ = std::make_unique<LocalBackend>(LocalIo::kMmap);
    } else if (GetParam() == "gs") {
      WS_REQUIRE_GCS_SERVER();
      backend_ = std::make_unique<GcsBackend>(*testing::gcs_test_endpoint());
    } else if (GetParam() == "az") {
      WS_REQUIRE_AZURE_SERVER();
      backend_ = std::make_unique<AzureBackend>(*testing::azure_test_connection_string());
    } else {
      WS_REQUIRE_S3_SERVER();
      backend_ = std::make_unique<S3Backend>(*testing::s3_test_endpoint());
    }
    small_ = testing::pattern_bytes(4096 + 17, 1);
    large_ = testing::pattern_bytes(1024 * 1024 + 3, 2);
    backend_->put("small.bin", small_);
    backend_->put("model-00001-of-00002.safetensors", large_);
    backend_->put("empty.json", "");
    backend_->put_below("nested", "hidden.bin", "hidden");
    storage_ = backend_->open();
  }

  std::string read(const std::string& name, uint64_t offset, size_t size) {
    std::string bytes(size, '\0');
    storage_->read(name, offset, std::as_writable_bytes(std::span(bytes.data(), bytes.size())));
    return bytes;
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Storage> storage_;
  std::string small_;
  std::string large_;
};

TEST_P(StorageContract, ListsTheObjectsDirectlyUnderTheRoot) {
  auto objects = storage_->list();
  std::map<std::string, uint64_t> sizes;
  for (const auto& object : objects) sizes[object.name] = object.size;
  std::map<std::string, uint64_t> expected = {
      {"small.bin", small_.size()}, {"model-00001-of-00002.safetensors", large_.size()}, {"empty.json", 0}};
  EXPECT_EQ(sizes, expected);
}

// Reads populate their destination's pages first (storage/read_destination.hpp): a read into
// fresh memory at unaligned ends lands its bytes and leaves the bytes around it, on the
// pages it shares with them, as they were.
TEST_P(StorageContract, ReadsIntoFreshMemoryLeavingTheBytesAroundIt) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t length = large_.size() - 12345;
  const size_t pages = (length + 2 * page) / page + 2;
  void* mapped = ::mmap(nullptr, pages * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mapped, MAP_FAILED);
  auto* memory = static_cast<std::byte*>(mapped);
  std::memset(memory + page, 0x77, 100);  // a neighbour's bytes before the destination, on its first page
  std::byte* destination = memory + page + 100;
  storage_->read("model-00001-of-00002.safetensors", 12345, std::span(destination, length));
  std::string got(reinterpret_cast<const char*>(destination), length);
  EXPECT_EQ(got, large_.substr(12345));
  for (size_t i = 0; i < pages * page; ++i) {
    if (memory + i >= destination && memory + i < destination + length) continue;
    std::byte expected = i >= page && i < page + 100 ? std::byte{0x77} : std::byte{0};
    ASSERT_EQ(memory[i], expected) << "byte " << i << " outside the destination";
  }
  ::munmap(mapped, pages * page);
}

TEST_P(StorageContract, StatsAnObject) {
  auto info = storage_->stat("small.bin");
  EXPECT_EQ(info.name, "small.bin");
  EXPECT_EQ(info.size, small_.size());
  EXPECT_EQ(storage_->stat("empty.json").size, 0u);
}

TEST_P(StorageContract, MissingObjectIsNotFoundAndNamed) {
  try {
    storage_->stat("absent.safetensors");
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNotFound);
    EXPECT_THAT(error.what(), HasSubstr(storage_->object_uri("absent.safetensors")));
  }
  try {
    read("absent.safetensors", 0, 16);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kNotFound);
    EXPECT_THAT(error.what(), HasSubstr("absent.safetensors"));
  }
}

TEST_P(StorageContract, ReadsExactRanges) {
  EXPECT_EQ(read("small.bin", 0, small_.size()), small_);
  EXPECT_EQ(read("small.bin", 100, 1000), small_.substr(100, 1000));
  EXPECT_EQ(read("small.bin", small_.size() - 1, 1), small_.substr(small_.size() - 1));
  EXPECT_EQ(read("small.bin", 0, 1), small_.substr(0, 1));
}

// The runs of a strided read (a column window of each row) land where they lie in the
// range; a backend reads a gap with its runs only up to its merge gap, so what it reports
// read lies between the runs' bytes and the whole range.
TEST_P(StorageContract, ReadsRunsEachToItsPlaceAndReportsTheBytesItRead) {
  const std::string name = "model-00001-of-00002.safetensors";
  std::vector<ByteRange> runs;
  uint64_t run_bytes = 0;
  for (uint64_t row = 0; row < 40; ++row) runs.push_back({1000 + row * 3000, 700});  // small gaps
  runs.push_back({400000, 5});                                                        // a gap of 280 KiB
  runs.push_back({1024 * 1024 - 10, 13});                                              // up to the last byte
  for (const ByteRange& run : runs) run_bytes += run.length;
  const uint64_t offset = 900;
  std::vector<std::byte> destination(large_.size() - offset, std::byte{0x5a});
  uint64_t read = storage_->read_runs(name, offset, destination, runs);
  for (const ByteRange& run : runs) {
    std::string got(reinterpret_cast<const char*>(destination.data() + (run.offset - offset)), run.length);
    ASSERT_EQ(got, large_.substr(run.offset, run.length)) << "run at " << run.offset;
  }
  EXPECT_GE(read, run_bytes);
  EXPECT_LE(read, large_.size() - runs.front().offset);
  if (GetParam() == "local") EXPECT_EQ(read, 39 * 3000 + 700 + 5 + 13) << "gaps up to 64 KiB read, the larger not";
  if (GetParam() == "local_mmap") EXPECT_EQ(read, run_bytes) << "copied out of the mapping: no gap read";
  std::vector<ByteRange> past_the_end = {{0, 10}, {large_.size() - 2, 4}};
  std::vector<std::byte> beyond(large_.size() + 2);
  EXPECT_THROW(storage_->read_runs(name, 0, beyond, past_the_end), Error);
}

// Packed, the same runs land back to back from the destination's first byte, and exactly
// their bytes are written there: a rank's column window staged as nothing else.
TEST_P(StorageContract, ReadsRunsPackedBackToBack) {
  const std::string name = "model-00001-of-00002.safetensors";
  std::vector<ByteRange> runs;
  for (uint64_t row = 0; row < 40; ++row) runs.push_back({1000 + row * 3000, 700});  // small gaps
  runs.push_back({400000, 5});                                                        // a gap of 280 KiB
  runs.push_back({1024 * 1024 - 10, 13});                                              // up to the last byte
  std::string expected;
  for (const ByteRange& run : runs) expected += large_.substr(run.offset, run.length);
  std::vector<std::byte> destination(expected.size() + 16, std::byte{0x5a});
  uint64_t read = storage_->read_runs(name, 0, std::span(destination).first(expected.size()), runs,
                                      RunPlacement::kPacked);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(destination.data()), expected.size()), expected);
  for (size_t i = expected.size(); i < destination.size(); ++i) ASSERT_EQ(destination[i], std::byte{0x5a}) << i;
  EXPECT_GE(read, expected.size());
  if (GetParam() == "local") EXPECT_EQ(read, 39 * 3000 + 700 + 5 + 13) << "gaps up to 64 KiB read, the larger not";
  std::vector<ByteRange> past_the_end = {{0, 10}, {large_.size() - 2, 4}};
  std::vector<std::byte> beyond(14);
  EXPECT_THROW(storage_->read_runs(name, 0, beyond, past_the_end, RunPlacement::kPacked), Error);
}

TEST_P(StorageContract, ReadsLargeRangesWhole) {
  EXPECT_EQ(read("model-00001-of-00002.safetensors", 0, large_.size()), large_);
  EXPECT_EQ(read("model-00001-of-00002.safetensors", 12345, 700000), large_.substr(12345, 700000));
}

TEST_P(StorageContract, ZeroLengthReadIsANoOp) {
  // Nothing is read or written, at any offset up to the end, and the storage reads on as before.
  std::string sentinel = "untouched";
  auto nothing = std::as_writable_bytes(std::span(sentinel.data(), size_t{0}));
  EXPECT_NO_THROW(storage_->read("small.bin", 10, nothing));
  EXPECT_NO_THROW(storage_->read("small.bin", small_.size(), nothing));
  EXPECT_NO_THROW(storage_->read("empty.json", 0, nothing));
  EXPECT_EQ(sentinel, "untouched");
  EXPECT_EQ(read("small.bin", 10, 5), small_.substr(10, 5));
  EXPECT_EQ(read("small.bin", 0, small_.size()), small_);
}

TEST_P(StorageContract, ReadPastTheEndFailsNamingObjectAndRange) {
  storage_->list();  // whether sizes are known or not, the answer is the same error
  for (int pass = 0; pass < 2; ++pass) {
    try {
      read("small.bin", small_.size() - 10, 20);
      FAIL() << "expected an error";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kIo) << error.what();
      EXPECT_THAT(error.what(), HasSubstr(storage_->object_uri("small.bin")));
      EXPECT_THAT(error.what(), HasSubstr(std::to_string(small_.size() - 10) + "+20"));
    }
    storage_ = backend_->open();  // a fresh root knows no sizes
  }
}

TEST_P(StorageContract, RejectsNamesThatAreNotPlain) {
  for (std::string name : {"nested/hidden.bin", "..", ""}) {
    try {
      storage_->stat(name);
      ADD_FAILURE() << "expected an error for '" << name << "'";
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << name << ": " << error.what();
    }
  }
}

TEST_P(StorageContract, ConcurrentReadsAreCorrect) {
  std::vector<std::string> results(8);
  {
    std::vector<std::jthread> threads;
    for (size_t i = 0; i < results.size(); ++i) {
      threads.emplace_back([&, i] { results[i] = read("model-00001-of-00002.safetensors", i * 100000, 90000); });
    }
  }
  for (size_t i = 0; i < results.size(); ++i) EXPECT_EQ(results[i], large_.substr(i * 100000, 90000)) << i;
}

TEST_P(StorageContract, UrisNameTheRootAndTheObject) {
  auto root = storage_->root_uri();
  EXPECT_FALSE(root.empty());
  EXPECT_FALSE(root.ends_with("/"));
  EXPECT_EQ(storage_->object_uri("small.bin"), root + "/small.bin");
}

TEST_P(StorageContract, ReadObjectReadsSmallFilesAndRefusesLargeOnes) {
  EXPECT_EQ(read_object(*storage_, "small.bin", 1 << 20), small_);
  EXPECT_EQ(read_object(*storage_, "empty.json", 16), "");
  try {
    read_object(*storage_, "small.bin", 100);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("small.bin"));
  }
}

// --io mmap copies out of a mapping: a file that shrinks after it was mapped must fail the
// read with an error naming the file, not kill the process with SIGBUS.
// Every backend lends bytes: local files as views of their mapping (shared, or private and
// writable without reaching the file), the others as a copy of their own.
TEST_P(StorageContract, LendsViewsOfLocalFilesAndCopiesElsewhere) {
  const std::string name = "model-00001-of-00002.safetensors";
  auto as_text = [](const Bytes& bytes) { return std::string(reinterpret_cast<const char*>(bytes.span.data()), bytes.span.size()); };
  Bytes shared = storage_->borrow(name, 5, large_.size() - 5);
  EXPECT_EQ(as_text(shared), large_.substr(5));
  EXPECT_EQ(shared.view, storage_->lends_views());
  EXPECT_EQ(storage_->lends_views(), GetParam().starts_with("local"));
  Bytes mine = storage_->borrow(name, 0, 100, {.sharing = BorrowOptions::Sharing::kPrivate});
  ASSERT_NE(mine.writable, nullptr);
  mine.writable[0] = static_cast<std::byte>(~large_[0]);
  EXPECT_EQ(read(name, 0, 100), large_.substr(0, 100));  // the object is unchanged
  EXPECT_EQ(as_text(storage_->borrow("small.bin", 17, 100)), small_.substr(17, 100));
  try {
    storage_->borrow("small.bin", small_.size() - 10, 100);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), HasSubstr("small.bin"));
  }
}

TEST_P(StorageContract, CountsItsRequestsWhereItSendsAny) {
  const StorageStats before = storage_->stats();
  EXPECT_EQ(read("small.bin", 17, 100), small_.substr(17, 100));
  const StorageStats after = storage_->stats();
  if (GetParam().starts_with("local")) {
    EXPECT_EQ(after.requests, 0u);  // local files send no requests
  } else {
    EXPECT_EQ(after.requests - before.requests, 1u);  // one ranged GET
  }
  EXPECT_EQ(after.retries, 0u);
  EXPECT_EQ(after.checksum_failures, 0u);
}

/// Reading 4096 bytes at 2 * 65536 of shard.safetensors, cut to 65536 bytes after it was
/// mapped, fails with the size error rather than SIGBUS.
void expect_read_of_truncated_shard_fails(Storage& storage) {
  std::string out(4096, '\0');
  try {
    storage.read("shard.safetensors", 2 * 65536, std::as_writable_bytes(std::span(out.data(), out.size())));
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kIo);
    EXPECT_THAT(error.what(), ::testing::HasSubstr("shard.safetensors: the file is now 65536 bytes (truncated while loading?)"));
  }
}

TEST(LocalMmap, AFileTruncatedAfterMappingFailsTheReadWithAnError) {
  testing::TempDir directory;
  auto bytes = testing::pattern_bytes(3 * 65536, 7);
  testing::write_file(directory / "shard.safetensors", bytes);
  auto storage = open_local_storage(directory.path().string(), LocalIo::kMmap);
  std::string first(4096, '\0');
  storage->read("shard.safetensors", 65536, std::as_writable_bytes(std::span(first.data(), first.size())));
  EXPECT_EQ(first, bytes.substr(65536, 4096));
  std::filesystem::resize_file(directory / "shard.safetensors", 65536);
  expect_read_of_truncated_shard_fails(*storage);
}

// A prefetcher borrows a range with populate ahead of its read, and the reader's view
// dropped when returned drops its pages: neither changes a byte that a read returns; a
// borrow of what is not there throws, as the read does.
TEST(LocalMmap, PopulatedAndDroppedViewsReadTheSameBytes) {
  testing::TempDir directory;
  auto bytes = testing::pattern_bytes(5 * 65536 + 123, 11);
  testing::write_file(directory / "shard.safetensors", bytes);
  auto storage = open_local_storage(directory.path().string(), LocalIo::kMmap);
  ASSERT_TRUE(storage->reads_through_views());
  EXPECT_FALSE(open_local_storage(directory.path().string(), LocalIo::kPread)->reads_through_views());
  auto read = [&](uint64_t offset, uint64_t length) {
    std::string out(length, '\0');
    storage->read("shard.safetensors", offset, std::as_writable_bytes(std::span(out.data(), out.size())));
    return out;
  };
  storage->borrow("shard.safetensors", 1000, 70000, {.populate = true});  // unaligned at both ends
  {
    Bytes held = storage->borrow("shard.safetensors", 1000, 70000, {.drop_when_returned = true});
    EXPECT_EQ(read(1000, 70000), bytes.substr(1000, 70000));
  }
  EXPECT_EQ(read(1000, 70000), bytes.substr(1000, 70000));  // mapped again by the read itself
  storage->borrow("shard.safetensors", 4 * 65536, 65536 + 123, {.populate = true});  // to the end
  storage->borrow("shard.safetensors", 4 * 65536, 65536 + 123, {.drop_when_returned = true});  // dropped before its read
  EXPECT_EQ(read(4 * 65536, 65536 + 123), bytes.substr(4 * 65536));
  EXPECT_THROW(storage->borrow("shard.safetensors", bytes.size() - 10, 100, {.populate = true}), Error);
  EXPECT_THROW(storage->borrow("missing.safetensors", 0, 100, {.populate = true}), Error);
  try {
    read(bytes.size() - 10, 100);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), ::testing::HasSubstr("past the end of the"));
  }
}

// A range mapped by a prefetcher whose file then shrinks: the read still fails with an
// error, as an unprefetched one does, rather than raising SIGBUS in its copy.
TEST(LocalMmap, APopulatedRangeOfATruncatedFileFailsTheReadWithAnError) {
  testing::TempDir directory;
  testing::write_file(directory / "shard.safetensors", testing::pattern_bytes(3 * 65536, 5));
  auto storage = open_local_storage(directory.path().string(), LocalIo::kMmap);
  storage->borrow("shard.safetensors", 2 * 65536, 4096, {.populate = true});
  std::filesystem::resize_file(directory / "shard.safetensors", 65536);
  expect_read_of_truncated_shard_fails(*storage);
}

/// The fraction of the first `size` bytes of `fd` whose pages the page cache holds, by
/// mincore(2) on a mapping of them: the oracle for local_io::cached_fraction.
double resident_fraction(int fd, size_t size) {
  void* mapping = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (mapping == MAP_FAILED) throw std::runtime_error("mmap of the probed file failed");
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> pages((size + page - 1) / page);
  int result = ::mincore(mapping, size, pages.data());
  ::munmap(mapping, size);
  if (result != 0) throw std::runtime_error("mincore of the probed file failed");
  return static_cast<double>(std::count_if(pages.begin(), pages.end(), [](unsigned char p) { return p & 1; })) /
         static_cast<double>(pages.size());
}

// The probe behind the GPU's warm shape (GpuPath::kAuto): a file just read is in the page
// cache, one whose pages were dropped is not.
TEST(LocalCacheProbe, TellsAReadFileFromADroppedOne) {
  testing::TempDir directory;
  auto path = (directory / "shard.safetensors").string();
  testing::write_file(path, testing::pattern_bytes(4 << 20, 3));
  local_io::FileDescriptor file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(static_cast<bool>(file));
  std::string bytes(4 << 20, '\0');
  local_io::pread_exact(file.get(), path, 0, std::as_writable_bytes(std::span(bytes.data(), bytes.size())));
  auto warm = local_io::cached_fraction(file.get(), bytes.size(), 32);
  if (!warm) GTEST_SKIP() << "this file system does not answer RWF_NOWAIT reads";
  EXPECT_EQ(*warm, 1.0);
  // The kernel drops only clean pages that nothing holds: on a busy machine some may still be
  // under writeback or held for a moment, so the drop is asked again until mincore(2), the
  // oracle, sees most of the file gone.
  double resident = 1.0;
  for (int attempt = 0; attempt < 20 && resident >= 0.5; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_EQ(::fdatasync(file.get()), 0);
    ASSERT_EQ(::posix_fadvise(file.get(), 0, 0, POSIX_FADV_DONTNEED), 0);
    resident = resident_fraction(file.get(), bytes.size());
  }
  if (resident == 1.0) GTEST_SKIP() << "this file system keeps dropped pages (tmpfs)";
  if (resident >= 0.5) GTEST_SKIP() << "the kernel kept " << resident * 100 << "% of the pages after 20 drops";
  auto cold = local_io::cached_fraction(file.get(), bytes.size(), 32);
  ASSERT_TRUE(cold.has_value());
  EXPECT_LT(*cold, 0.5) << "mincore sees " << resident * 100 << "% of the pages resident";
  EXPECT_EQ(local_io::cached_fraction(file.get(), 0, 32), 1.0);  // nothing to read: nothing missing
}

INSTANTIATE_TEST_SUITE_P(Backends, StorageContract, ::testing::Values("local", "local_mmap", "s3", "gs", "az"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace weightstream
