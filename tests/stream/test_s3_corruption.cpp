// A body whose bytes are corrupted in transit while its length stays right (issue 7,
// faults). Streaming reads ranges of shards, and S3 keeps no checksum per range, so the
// loader cannot tell (docs/S3.md, "What checksums can and cannot catch"); a digest
// manifest of the source can. This test pins down both halves: the corrupted stream
// completes, and comparing its digests with the manifest names exactly the tensors
// that the spoiled response carried, while every other tensor matches. Whole-object
// reads, which S3 checksums do cover, are tested in tests/storage/test_s3_storage.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "storage/test_s3_fixture.hpp"
#include "support/test_support.hpp"
#include "weightstream/model.hpp"
#include "weightstream/synth.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {
namespace {

std::map<std::string, std::string> digest_map(const Checkpoint& checkpoint, const StreamOptions& options) {
  std::map<std::string, std::string> digests;
  for (auto& digest : digest_streamed(checkpoint, HashKind::kSha256, options)) {
    digests[digest.name] = digest.hex;
  }
  return digests;
}

TEST(S3Corruption, RangedReadsOfACorruptedBodyAreCaughtByTheDigestManifestOnly) {
  WS_REQUIRE_S3_SERVER();
  testing::TempDir directory;
  SynthOptions synth;
  synth.layers = 2;
  synth.hidden = 128;
  synth.shards = 2;
  synth.seed = 3;
  SynthResult written = synthesize_checkpoint(directory.path(), synth);

  S3Options s3 = testing::s3_test_options(*testing::s3_test_endpoint());
  const std::string bucket = testing::unique_bucket("corrupt");
  s3::S3Client setup(s3);
  setup.create_bucket(bucket);
  for (const std::string& file : written.files) {
    setup.put_object(bucket, "ckpt/" + std::filesystem::path(file).filename().string(), testing::read_file(file));
  }

  testing::FaultProxy proxy(*testing::s3_test_endpoint());
  s3.endpoint = proxy.endpoint();
  // One reader and small chunks: the spoiled response is one chunk of one shard.
  StreamOptions options;
  options.concurrency = 1;
  options.chunk_bytes = 64 * 1024;
  Checkpoint local = Checkpoint::open(directory.path().string(), Options{});
  Checkpoint remote = Checkpoint::open(std::shared_ptr<Storage>(open_s3_storage(bucket, "ckpt", s3)));
  const auto manifest = digest_map(local, options);
  ASSERT_EQ(digest_map(remote, options), manifest);  // the path is clean before the fault

  proxy.clear();
  proxy.arm("corrupt", 1);
  const auto streamed = digest_map(remote, options);
  EXPECT_EQ(proxy.faults(), 1);
  ASSERT_EQ(streamed.size(), manifest.size());
  std::vector<std::string> differing;
  for (const auto& [name, hex] : manifest) {
    if (streamed.at(name) != hex) differing.push_back(name);
  }
  // The loader delivered the spoiled bytes (nothing per range can show them wrong), and the
  // manifest flags them: the tensors of that one response, not the whole checkpoint.
  EXPECT_FALSE(differing.empty()) << "the corrupted response went unnoticed by the manifest comparison too";
  EXPECT_LE(differing.size(), manifest.size() / 2) << ::testing::PrintToString(differing);
  std::cout << "corrupted body: " << differing.size() << " of " << manifest.size()
            << " tensors differ from the manifest" << std::endl;
}

}  // namespace
}  // namespace weightstream
