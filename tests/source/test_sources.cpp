// The sources of the load path (source.hpp): one kind per URI, chosen by open_source, and
// the one fallback: a source wrapping two.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "support/test_support.hpp"
#include "weightstream/error.hpp"
#include "weightstream/load.hpp"
#include "weightstream/source.hpp"
#include "weightstream/synth.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

Options test_options() { return options_from_environment(process_environment()); }

/// A small llama checkpoint in `directory`.
std::string synth_llama(const testing::TempDir& directory) {
  SynthOptions options;
  options.hidden = 64;
  options.vocab = 256;
  synthesize_checkpoint(directory.path(), options);
  return directory.path().string();
}

/// Peers nothing listens for: the connect is refused at once.
SourceOptions unreachable_peers() {
  SourceOptions options = source_options(test_options());
  options.peer.token = "a token";
  options.peer.timeout = std::chrono::milliseconds(2000);
  return options;
}

EngineLayoutOptions host_layout() {
  EngineLayoutOptions options;
  options.device = Device{};
  return options;
}

TEST(SourceKind, OneKindPerUri) {
  EXPECT_EQ(source_kind("/models/llama"), SourceKind::kFile);
  EXPECT_EQ(source_kind("file:///models/llama"), SourceKind::kFile);
  EXPECT_EQ(source_kind("s3://bucket/llama"), SourceKind::kS3);
  EXPECT_EQ(source_kind("gs://bucket/llama"), SourceKind::kGcs);
  EXPECT_EQ(source_kind("az://account/container/llama"), SourceKind::kAzure);
  EXPECT_EQ(source_kind("peer://127.0.0.1:7000,127.0.0.1:7001"), SourceKind::kPeer);
  EXPECT_EQ(source_kind_name(SourceKind::kPeer), "peer");
  EXPECT_EQ(source_kind_name(SourceKind::kGcs), "gs");
  EXPECT_TRUE(source_is_checkpoint(SourceKind::kS3));
  EXPECT_FALSE(source_is_checkpoint(SourceKind::kPeer));
  EXPECT_FALSE(source_is_checkpoint(SourceKind::kFallback));
}

TEST(SourceKind, MalformedPeersAreTheCallersMistake) {
  try {
    source_kind("peer://");
    FAIL() << "a peer URI without addresses was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(error.what(), HasSubstr("peer://"));
  }
}

TEST(CheckpointSource, LoadsTheEngineLayoutOfTheCheckpoint) {
  testing::TempDir directory;
  const std::string uri = synth_llama(directory);
  std::unique_ptr<Source> source = open_source(uri, source_options(test_options()));
  EXPECT_EQ(source->kind(), SourceKind::kFile);
  SourceLayout loaded = source->load_new(host_layout());
  EXPECT_EQ(loaded.load.kind, SourceKind::kFile);
  EXPECT_EQ(loaded.load.uri, source->uri());
  EXPECT_TRUE(loaded.load.failure.empty());
  EXPECT_GT(loaded.load.stream.bytes, 0u);
  EXPECT_EQ(loaded.layout.loads_finished(), 1u);
  // The layout every front end builds: engine_layout of the checkpoint, hooks included.
  Checkpoint checkpoint = Checkpoint::open(uri, test_options());
  ModelLayout expected = engine_layout(checkpoint, host_layout());
  ASSERT_EQ(loaded.layout.parameters().size(), expected.parameters().size());
  ASSERT_EQ(loaded.layout.hooks().size(), expected.hooks().size());
  EXPECT_FALSE(loaded.layout.hooks().empty());
  for (size_t i = 0; i < expected.parameters().size(); ++i) {
    EXPECT_EQ(loaded.layout.parameters()[i].name, expected.parameters()[i].name);
    EXPECT_EQ(loaded.layout.parameters()[i].shape, expected.parameters()[i].shape);
  }
}

TEST(EngineLayout, WithoutADeviceHasNeitherStorageNorHooks) {
  testing::TempDir directory;
  Checkpoint checkpoint = Checkpoint::open(synth_llama(directory), test_options());
  ModelLayout layout = engine_layout(checkpoint, EngineLayoutOptions{});
  EXPECT_TRUE(layout.hooks().empty());
  EXPECT_EQ(layout.allocated_bytes(), 0u);
  std::vector<std::string> names;
  for (const auto& hook : engine_hooks(layout, checkpoint_layout_config(checkpoint))) names.push_back(hook->name());
  EXPECT_EQ(names, std::vector<std::string>{"fused_kv"});
}

TEST(OpenSource, AFallbackIsForPeers) {
  testing::TempDir directory;
  SourceOptions options = source_options(test_options());
  options.fallback = synth_llama(directory);
  try {
    open_source(directory.path().string(), options);
    FAIL() << "a checkpoint with a fallback was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(error.what(), HasSubstr("is a checkpoint"));
  }
}

TEST(FallbackSource, LoadsTheSecondWhenTheFirstFails) {
  testing::TempDir directory;
  SourceOptions options = unreachable_peers();
  options.fallback = synth_llama(directory);
  std::unique_ptr<Source> source = open_source("peer://127.0.0.1:1", options);
  EXPECT_EQ(source->kind(), SourceKind::kFallback);
  SourceLayout loaded = source->load_new(host_layout());
  EXPECT_EQ(loaded.load.kind, SourceKind::kFile);
  EXPECT_THAT(loaded.load.uri, HasSubstr(directory.path().string()));
  EXPECT_THAT(loaded.load.failure, HasSubstr("127.0.0.1:1"));
  EXPECT_GT(loaded.load.stream.bytes, 0u);
  EXPECT_EQ(loaded.layout.loads_finished(), 1u);
}

TEST(FallbackSource, NamesBothSourcesWhenNeitherLoads) {
  testing::TempDir directory;
  SourceOptions options = unreachable_peers();
  options.fallback = (directory.path() / "missing").string();
  try {
    open_source("peer://127.0.0.1:1", options)->load_new(host_layout());
    FAIL() << "a load with no source that serves succeeded";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), StartsWith("cannot load from any source: peer://127.0.0.1:1: "));
    EXPECT_THAT(error.what(), HasSubstr("; " + options.fallback + ": "));
  }
}

// A load into a layout the caller holds names that layout too (as the engine plugins' loads do).
TEST(FallbackSource, ALoadIntoALayoutNamesItWhenNeitherSourceLoads) {
  testing::TempDir directory;
  const std::string checkpoint = synth_llama(directory);
  ModelLayout layout = engine_layout(Checkpoint::open(checkpoint, test_options()), host_layout());
  layout.allocate(Device{});
  SourceOptions options = unreachable_peers();
  options.fallback = (directory.path() / "missing").string();
  try {
    open_source("peer://127.0.0.1:1", options)->load(layout, LoadMode::kCold, nullptr);
    FAIL() << "a load with no source that serves succeeded";
  } catch (const Error& error) {
    EXPECT_THAT(error.what(), StartsWith("cannot load " + layout.description() + " from any source: peer://127.0.0.1:1: "));
    EXPECT_THAT(error.what(), HasSubstr("; " + options.fallback + ": "));
  }
}

TEST(FallbackSource, DoesNotFallBackFromTheCallersMistake) {
  testing::TempDir directory;
  SourceOptions options = unreachable_peers();
  options.peer.expect_digest = "not a digest";
  options.fallback = synth_llama(directory);
  try {
    open_source("peer://127.0.0.1:1", options)->load_new(host_layout());
    FAIL() << "a malformed expected digest fell back";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(error.what(), StartsWith("cannot load from peer://127.0.0.1:1: "));
  }
}

}  // namespace
}  // namespace weightstream
