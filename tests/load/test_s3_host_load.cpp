// A host load from S3 (issue 19): every tensor lands exactly, and neighbouring tensors share
// one ranged GET instead of costing one request each (real S3 charges each one a round trip
// and a fee). Against a real S3-compatible server (moto's) behind the fault-injecting proxy,
// which counts the requests.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "storage/test_s3_fixture.hpp"
#include "support/test_support.hpp"
#include "weightstream/load.hpp"
#include "weightstream/model.hpp"
#include "weightstream/synth.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {
namespace {

class S3HostLoad : public ::testing::Test {
 protected:
  void SetUp() override {
    WS_REQUIRE_S3_SERVER();
    SynthOptions synth;
    synth.layers = 3;
    synth.hidden = 128;
    synth.shards = 2;
    synth.seed = 5;
    written_ = synthesize_checkpoint(directory_.path(), synth);
    s3_ = testing::s3_test_options(*testing::s3_test_endpoint());
    bucket_ = testing::unique_bucket("hostload");
    s3::S3Client setup(s3_);
    setup.create_bucket(bucket_);
    for (const std::string& file : written_.files) {
      setup.put_object(bucket_, "ckpt/" + std::filesystem::path(file).filename().string(), testing::read_file(file));
    }
    proxy_ = std::make_unique<testing::FaultProxy>(*testing::s3_test_endpoint());
    s3_.endpoint = proxy_->endpoint();
  }

  /// Loads the checkpoint from S3 onto the host, with `fault` armed for its first GET, and
  /// compares every tensor with the local files.
  LoadedCheckpoint load_and_compare(const StreamOptions& options, const std::string& fault = "") {
    Checkpoint remote = Checkpoint::open(std::shared_ptr<Storage>(open_s3_storage(bucket_, "ckpt", s3_)));
    proxy_->clear();
    if (!fault.empty()) proxy_->arm(fault, 1, "GET");
    LoadedCheckpoint loaded = load_checkpoint(remote, Device{}, options);
    StreamOptions copy;
    copy.local_io = LocalIo::kPread;
    Checkpoint local = Checkpoint::open(directory_.path().string(), Options{});
    LoadedCheckpoint expected = load_checkpoint(local, Device{}, copy);
    EXPECT_EQ(loaded.tensors.size(), remote.tensors().size());
    for (size_t i = 0; i < loaded.tensors.size(); ++i) {
      const std::string& name = remote.tensors()[i].name;
      auto found = local.find(name);
      EXPECT_TRUE(found.has_value()) << name;
      if (!found) continue;
      const LoadedTensor& want = expected.tensors[*found];
      EXPECT_FALSE(loaded.tensors[i].in_place) << name;
      EXPECT_EQ(loaded.tensors[i].bytes, want.bytes) << name;
      EXPECT_EQ(std::memcmp(loaded.tensors[i].data, want.data, want.bytes), 0) << name << " differs";
    }
    return loaded;
  }

  testing::TempDir directory_;
  SynthResult written_;
  S3Options s3_;
  std::string bucket_;
  std::unique_ptr<testing::FaultProxy> proxy_;
};

TEST_F(S3HostLoad, NeighbouringTensorsShareOneRangedGet) {
  StreamOptions options;  // the defaults: reads of up to 16 MiB
  LoadedCheckpoint loaded = load_and_compare(options);
  EXPECT_GT(loaded.stats.tensors, 20u);
  // Each shard's tensors are smaller together than one read: one GET a shard.
  EXPECT_EQ(loaded.stats.reads, 2u);
  EXPECT_EQ(proxy_->requests("GET"), 2);
}

TEST_F(S3HostLoad, SmallReadsStillCoverEveryTensorOnceAndARetriedGetRewritesItsTensors) {
  StreamOptions options;
  options.chunk_bytes = 256 * 1024;  // several tensors a read, several reads a shard
  options.concurrency = 2;
  LoadedCheckpoint loaded = load_and_compare(options, "truncate");
  EXPECT_EQ(proxy_->faults(), 1);
  EXPECT_GT(loaded.stats.reads, 2u);
  EXPECT_LT(loaded.stats.reads, loaded.stats.tensors);  // one a tensor, or more, before
  EXPECT_EQ(proxy_->requests("GET"), static_cast<int>(loaded.stats.reads) + 1);  // the cut one, read again
}

}  // namespace
}  // namespace weightstream
