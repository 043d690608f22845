// Peers in one process over loopback: a PeerServer publishes a loaded rank, a PeerSource
// pulls into another layout (the same one, or another tp size) and the result equals a
// load from the checkpoint; digests, tokens, disagreeing manifests, a version change and
// a server that goes away between the manifest and the reads. The cross-namespace runs of
// the command are in tests/python/test_peers.py.
#include <gmock/gmock.h>
#include <stdlib.h>
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <cstring>
#include <thread>

#include "support/test_support.hpp"
#include "transfer/transfer_fixtures.hpp"
#include "weightstream/load.hpp"
#include "weightstream/options.hpp"
#include "weightstream/peer.hpp"
#include "weightstream/synth.hpp"
#include "peer/peer_protocol.hpp"
#include "net/ucx.hpp"

namespace weightstream {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::error_text;
using testing::TempDir;

/// A synthetic checkpoint, opened.
struct Model {
  TempDir directory;
  std::optional<Checkpoint> checkpoint;
  ModelConfig config;
  /// `vocab` 16384 gives embeddings of 8 MiB (16 digest pieces): a pull's test hook pauses
  /// in the middle of reading them (PeerPullOptions::pause_after_bytes).
  explicit Model(uint64_t seed = 7, int64_t vocab = 0, int64_t layers = 2) {
    SynthOptions options;
    options.arch = "llama";
    options.layers = layers;
    options.hidden = 256;
    options.seed = seed;
    if (vocab > 0) options.vocab = vocab;
    config = synthesize_checkpoint(directory.path(), options).config;
    checkpoint.emplace(Checkpoint::open(directory.path().string(), Options{}));
  }
};

ModelLayout loaded_layout(const Model& model, int64_t tp_size, int64_t tp_rank, const Device& device = Device{}) {
  LayoutOptions options;
  options.parallel = {tp_size, tp_rank, 1, 0};
  ModelLayout layout = build_model_layout(model.config, options);
  layout.allocate(device);
  load_layout(layout, *model.checkpoint, LoadMode::kCold, StreamOptions{});
  return layout;
}

ModelLayout empty_layout(const Model& model, int64_t tp_size, int64_t tp_rank, const Device& device = Device{}) {
  LayoutOptions options;
  options.parallel = {tp_size, tp_rank, 1, 0};
  ModelLayout layout = build_model_layout(model.config, options);
  layout.allocate(device);
  return layout;
}

PeerServeInfo serve_info(const Model& model, int64_t tp_size, int64_t tp_rank) {
  return peer_serve_info(*model.checkpoint, {tp_size, tp_rank, 1, 0}, Processing::kNone);
}

PeerServeOptions serve_options() {
  PeerServeOptions options;
  options.token = "peer-secret";
  options.timeout = std::chrono::seconds(60);  // generous: the CI machine may be loaded
  return options;
}

PeerPullOptions pull_options(std::string token = "peer-secret") {
  PeerPullOptions options;
  options.token = std::move(token);
  options.timeout = std::chrono::seconds(60);  // generous: the CI machine may be loaded
  return options;
}

/// The servers of one instance at `tp_size`, each with its loaded layout.
struct Instance {
  std::vector<ModelLayout> layouts;
  std::vector<std::unique_ptr<PeerServer>> servers;
  Instance(const Model& model, int64_t tp_size, uint64_t digest_piece_bytes = 0) {
    for (int64_t rank = 0; rank < tp_size; ++rank) layouts.push_back(loaded_layout(model, tp_size, rank));
    PeerServeOptions options = serve_options();
    options.digest_piece_bytes = digest_piece_bytes;
    for (int64_t rank = 0; rank < tp_size; ++rank) {
      servers.push_back(std::make_unique<PeerServer>(layouts[rank], serve_info(model, tp_size, rank), options));
    }
  }
  std::string uri() const {
    std::string text(kPeerScheme);
    for (size_t i = 0; i < servers.size(); ++i) text += (i ? "," : "") + servers[i]->address();
    return text;
  }
};

class PeerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!transfer::ucx::compiled()) GTEST_SKIP() << "this build has no UCX (WS_WITH_UCX)";
  }
};

PeerPullReport pull_into(ModelLayout& layout, PeerSource& source) {
  LoadSession session(layout);
  session.begin(LoadMode::kCold);
  PeerPullReport report = source.pull(session);
  session.finish();
  return report;
}

TEST_F(PeerTest, PullsTheSameLayoutInPlaceAndEqualsTheCheckpoint) {
  Model model;
  Instance instance(model, 2);
  for (int64_t rank = 0; rank < 2; ++rank) {
    PeerSource source(instance.uri(), pull_options());
    ASSERT_EQ(source.manifests().size(), 2u);
    EXPECT_EQ(source.manifests()[0].model_type, "llama");
    EXPECT_EQ(source.manifests()[1].parallel.tp_rank, 1);
    ModelLayout layout = empty_layout(model, 2, rank);
    PeerPullReport report = pull_into(layout, source);
    EXPECT_GT(report.bytes_in_place, 0u);
    LayoutComparison comparison = compare_layouts(layout, instance.layouts[rank]);
    EXPECT_EQ(comparison.mismatched, 0u) << ::testing::PrintToString(comparison.mismatches);
    EXPECT_EQ(comparison.compared, layout.parameters().size());
  }
}

// Both ways UCX moves the bytes, forced: one-sided reads, and the server's tagged sends.
class PeerPathTest : public ::testing::TestWithParam<UcxPath> {
 protected:
  void SetUp() override {
    if (!transfer::ucx::compiled()) GTEST_SKIP() << "this build has no UCX (WS_WITH_UCX)";
  }
};

TEST_P(PeerPathTest, PullsInPlaceAndAcrossTpSizesEqualToTheCheckpoint) {
  Model model;
  Instance instance(model, 2);
  PeerPullOptions options = pull_options();
  options.ucx_path = GetParam();
  const std::string path(ucx_path_name(GetParam()));
  for (auto [tp_size, tp_rank] : std::vector<std::pair<int64_t, int64_t>>{{2, 1}, {1, 0}, {4, 2}}) {
    PeerSource source(instance.uri(), options);
    for (const PeerManifest& manifest : source.manifests()) EXPECT_EQ(manifest.ucx_path, path);
    ModelLayout layout = empty_layout(model, tp_size, tp_rank);
    PeerPullReport report = pull_into(layout, source);
    EXPECT_GT(report.bytes_from_peers, 0u);
    if (tp_size == 2) EXPECT_GT(report.bytes_in_place, 0u);
    // The bytes by peer (what `load --metrics-listen` shows per peer and transport) add up.
    const PeerPullStats stats = source.stats();
    ASSERT_EQ(stats.peers.size(), 2u);
    uint64_t by_peer = 0;
    for (size_t i = 0; i < stats.peers.size(); ++i) {
      EXPECT_EQ(stats.peers[i].address, source.manifests()[i].address);
      EXPECT_EQ(stats.peers[i].transports, source.manifests()[i].ucx_transports);
      by_peer += stats.peers[i].bytes;
    }
    EXPECT_EQ(by_peer, report.bytes_from_peers);
    EXPECT_EQ(stats.digest_failures, 0u);
    LayoutComparison comparison = compare_layouts(layout, loaded_layout(model, tp_size, tp_rank));
    EXPECT_EQ(comparison.mismatched, 0u) << path << ", tp " << tp_size << " rank " << tp_rank << ": "
                                         << ::testing::PrintToString(comparison.mismatches);
    EXPECT_EQ(comparison.compared, layout.parameters().size());
  }
}

TEST_P(PeerPathTest, AFlippedServedByteFailsThePullNamingTheParameter) {
  Model model;
  Instance instance(model, 1);
  const Parameter& victim = instance.layouts[0].parameters()[1];
  victim.data[7] ^= std::byte{0x40};
  PeerPullOptions options = pull_options();
  options.ucx_path = GetParam();
  PeerSource source(instance.uri(), options);
  ModelLayout layout = empty_layout(model, 1, 0);
  EXPECT_THAT(error_text([&] { pull_into(layout, source); }),
              AllOf(HasSubstr("parameter " + victim.name), HasSubstr("does not match its digest")));
}

INSTANTIATE_TEST_SUITE_P(Ucx, PeerPathTest, ::testing::Values(UcxPath::kRma, UcxPath::kRendezvous),
                         [](const auto& info) { return std::string(ucx_path_name(info.param)); });

// The shim's rendezvous reads: the server answers only from registered memory, and only a
// puller that presents its secret.
TEST_F(PeerTest, RendezvousReadsComeOnlyFromRegisteredMemoryAndOnlyWithTheSecret) {
  namespace ucx = transfer::ucx;
  std::vector<std::byte> served(1 << 20);
  for (size_t i = 0; i < served.size(); ++i) served[i] = static_cast<std::byte>(i * 131 + 7);
  ucx::Worker server;
  auto registration = server.register_memory(served.data(), served.size());
  const ucx::Secret secret = ucx::random_secret();
  server.answer_send_requests(secret);
  server.start_progress();
  ucx::Worker puller;
  const auto timeout = std::chrono::milliseconds(60'000);
  {
    auto endpoint = puller.connect(server.address(), "the test server", UcxPath::kRendezvous, secret);
    EXPECT_EQ(endpoint->path(), ucx::Path::kRendezvous);
    EXPECT_FALSE(endpoint->transports().empty());
    std::vector<std::byte> read(served.size() - 4096);
    endpoint->get(read.data(), registration->address() + 4096, 0, read.size(), timeout);
    endpoint->wait(timeout);
    EXPECT_TRUE(std::equal(read.begin(), read.end(), served.begin() + 4096));
    // One byte past the registration: refused, and the read fails naming the range.
    EXPECT_THAT(error_text([&] {
                  endpoint->get(read.data(), registration->address() + 4097, 0, read.size(), timeout);
                  endpoint->wait(timeout);
                }),
                AllOf(HasSubstr("the test server"), HasSubstr("sent 0 of the " + std::to_string(read.size())),
                      HasSubstr("outside the memory it serves")));
  }
  {
    // Without the secret nothing is sent: the read times out.
    auto endpoint = puller.connect(server.address(), "the test server", UcxPath::kRendezvous, ucx::Secret{});
    std::vector<std::byte> read(4096);
    EXPECT_THAT(error_text([&] {
                  endpoint->get(read.data(), registration->address(), 0, read.size(), timeout);
                  endpoint->wait(std::chrono::milliseconds(500));
                }),
                AllOf(HasSubstr("the test server"), HasSubstr("without progress")));
  }
  server.stop_progress();
}

// A server stopped while a puller takes none of its sends (paused or frozen with its reads
// posted: it turns no worker) ends them, closing the endpoints back to that puller by force,
// so that no send is left on an endpoint when its worker goes: UCX 1.13 can abort the process
// there (ucp_ep.c, the proto_reqs assertion). Before, stop_progress() waited 2 s and left them
// (the process then aborted in about 1 run of 10). Deterministic: in a child process, over tcp
// (UCX_TLS, set in the child only), the puller asks for four 16 MiB ranges and turns its worker
// only until the server has started every send; the last one cannot end without it, since
// more than the sockets buffer is still to move.
TEST_F(PeerTest, AServerStoppedWhileAPullerTakesNoneOfItsSendsEndsThemAndItsWorkerGoesCleanly) {
  namespace ucx = transfer::ucx;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto stop_under_a_stalled_puller = [] {
    testing::ScopedEnv tcp("UCX_TLS", "tcp");
    testing::ScopedEnv rendezvous("UCX_RNDV_THRESH", "65536");  // as a pull's reads travel
    constexpr uint64_t kReads = 4, kReadBytes = 16 << 20;
    std::vector<std::byte> served(kReads * kReadBytes), read(kReads * kReadBytes);
    ucx::Worker puller;
    auto server = std::make_unique<ucx::Worker>();
    auto registration = server->register_memory(served.data(), served.size());
    const ucx::Secret secret = ucx::random_secret();
    server->answer_send_requests(secret);
    server->start_progress();
    const auto timeout = std::chrono::milliseconds(60'000);
    auto endpoint = puller.connect(server->address(), "the test server", UcxPath::kRendezvous, secret);
    for (uint64_t k = 0; k < kReads; ++k) {
      endpoint->get(read.data() + k * kReadBytes, registration->address() + k * kReadBytes, 0, kReadBytes, timeout);
    }
    while (server->bytes_sent_on_request() < kReads * kReadBytes) endpoint->progress();
    server->stop_progress();
    std::fprintf(stderr, "in flight after stop: %llu; ended by force: %llu\n",
                 static_cast<unsigned long long>(server->sends_in_flight()),
                 static_cast<unsigned long long>(server->sends_ended_at_stop()));
    const bool ended = server->sends_in_flight() == 0 && server->sends_ended_at_stop() > 0;
    registration.reset();
    server.reset();  // ucp_worker_destroy
    endpoint->cancel();
    endpoint.reset();
    std::_Exit(ended ? 0 : 2);
  };
  EXPECT_EXIT(stop_under_a_stalled_puller(), ::testing::ExitedWithCode(0), "in flight after stop: 0; ended by force: [1-9]");
}

TEST_F(PeerTest, AutoPicksRendezvousOnlyWhereNoLaneHasRma) {
  namespace ucx = transfer::ucx;
  ucx::Worker server, puller;
  auto endpoint = puller.connect(server.address(), "the test server");
  const std::string transports = endpoint->transports();
  // A tcp-only endpoint (UCX_TLS=tcp, or workers UCX joins over tcp) has no native RMA.
  if (transports.find_first_of(",") == std::string::npos && transports.starts_with("tcp/")) {
    EXPECT_EQ(endpoint->path(), ucx::Path::kRendezvous) << transports;
  }
  EXPECT_EQ(puller.connect(server.address(), "the test server", UcxPath::kRma)->path(), ucx::Path::kRma);
}

TEST_F(PeerTest, PullsAnotherTpLayoutFromTheCheckpointCoordinates) {
  Model model;
  Instance instance(model, 4);
  for (auto [tp_size, tp_rank] : std::vector<std::pair<int64_t, int64_t>>{{2, 0}, {2, 1}, {1, 0}}) {
    PeerSource source(instance.uri(), pull_options());
    ModelLayout layout = empty_layout(model, tp_size, tp_rank);
    pull_into(layout, source);
    ModelLayout expected = loaded_layout(model, tp_size, tp_rank);
    LayoutComparison comparison = compare_layouts(layout, expected);
    EXPECT_EQ(comparison.mismatched, 0u) << "tp " << tp_size << " rank " << tp_rank << ": "
                                         << ::testing::PrintToString(comparison.mismatches);
  }
  // The reverse: a tp 4 rank from a tp 2 instance.
  Instance narrow(model, 2);
  PeerSource source(narrow.uri(), pull_options());
  ModelLayout layout = empty_layout(model, 4, 3);
  pull_into(layout, source);
  EXPECT_EQ(compare_layouts(layout, loaded_layout(model, 4, 3)).mismatched, 0u);
}

// A layout of another config (here a wider MLP) names the same tensors as the served
// checkpoint but other shapes: the pull is refused while it is planned, naming the
// parameter, the tensor, both shapes and the peers, before a byte is sent.
TEST_F(PeerTest, AServedTensorOfAnotherShapeIsRefusedByNameBeforeAByteIsSent) {
  Model model;
  Instance instance(model, 1);
  ModelConfig wider = model.config;
  wider.intermediate_size *= 2;
  LayoutOptions options;
  ModelLayout layout = build_model_layout(wider, options);
  layout.allocate(Device{});
  PeerPullOptions pull = pull_options();
  pull.ucx_path = UcxPath::kRendezvous;  // every byte the server sends is counted
  PeerSource source(instance.uri(), pull);
  std::string text = error_text([&] { pull_into(layout, source); });
  EXPECT_THAT(text, HasSubstr("mlp."));
  EXPECT_THAT(text, HasSubstr("of shape ["));
  EXPECT_THAT(text, HasSubstr("but the checkpoint served by " + instance.uri() + " holds it as ["));
  EXPECT_EQ(instance.servers[0]->stats().bytes_sent, 0u);
}

TEST_F(PeerTest, ARankOfALargerTpSizeReadsOnlyThePiecesHoldingItsRowsAndChecksEach) {
  Model model;
  uint64_t bytes_whole = 0;  // the serving parameters read whole (digest pieces larger than any)
  {
    Instance narrow(model, 2, 4ull << 20);
    PeerSource source(narrow.uri(), pull_options());
    ModelLayout layout = empty_layout(model, 4, 3);
    bytes_whole = pull_into(layout, source).bytes_from_peers;
  }
  Instance narrow(model, 2, 4096);
  ASSERT_EQ(PeerSource(narrow.uri(), pull_options()).manifests()[0].digest_piece_bytes, 4096u);
  PeerSource source(narrow.uri(), pull_options());
  ModelLayout layout = empty_layout(model, 4, 3);
  const PeerPullReport report = pull_into(layout, source);
  EXPECT_EQ(compare_layouts(layout, loaded_layout(model, 4, 3)).mismatched, 0u);
  uint64_t own = 0;
  for (const Parameter& parameter : layout.parameters()) own += parameter.bytes();
  // Whole serving parameters are twice a tp-4 rank's share of the split ones; pieces of 4 KiB
  // read its share and what rounding to pieces adds.
  EXPECT_GT(bytes_whole, own * 3 / 2);
  EXPECT_LE(report.bytes_from_peers, own * 5 / 4) << "whole parameters: " << bytes_whole;
  EXPECT_GE(report.bytes_from_peers, own);

  // A byte the rank does not need, changed in the server's memory, is not read; one it needs
  // fails the pull, naming the parameter and the piece.
  const Parameter& served = narrow.layouts[1].parameter("model.layers.0.mlp.gate_up_proj.weight");
  const uint64_t half = served.bytes() / 2;
  served.data[half / 4] ^= std::byte{0x10};  // in gate's rows of tp-4 rank 2
  ModelLayout again = empty_layout(model, 4, 3);
  PeerSource second(narrow.uri(), pull_options());
  pull_into(again, second);
  served.data[half - 1] ^= std::byte{0x10};  // gate's last row: tp-4 rank 3's
  PeerSource third(narrow.uri(), pull_options());
  ModelLayout failing = empty_layout(model, 4, 3);
  const std::string text = error_text([&] { pull_into(failing, third); });
  EXPECT_THAT(text, HasSubstr("model.layers.0.mlp.gate_up_proj.weight"));
  EXPECT_THAT(text, HasSubstr("does not match its digest (bytes "));
  EXPECT_THAT(text, HasSubstr(narrow.servers[1]->address()));
}

TEST_F(PeerTest, AFlippedByteInAServedParameterFailsThePullNamingIt) {
  Model model;
  Instance instance(model, 2);
  const Parameter& served = instance.layouts[1].parameter("model.layers.1.self_attn.o_proj.weight");
  served.data[3] ^= std::byte{0x10};
  PeerSource source(instance.uri(), pull_options());
  ModelLayout layout = empty_layout(model, 2, 1);
  std::string text = error_text([&] { pull_into(layout, source); });
  EXPECT_THAT(text, HasSubstr("model.layers.1.self_attn.o_proj.weight"));
  EXPECT_THAT(text, HasSubstr("does not match its digest"));
  EXPECT_THAT(text, HasSubstr(instance.servers[1]->address()));
  // Counted, and readable after the failed pull (the metrics' digest failures).
  EXPECT_EQ(source.stats().digest_failures, 1u);
  EXPECT_GT(source.stats().peers[1].bytes, 0u);
}

// Issue 45: a reload or update from a peer lands nothing before its digests are checked. The
// served bytes are another checkpoint's (seed 8 over the puller's seed 7) with one byte of a
// layer-1 parameter flipped; the model fits one staging batch, so the pull fails before any
// byte reaches the session, whatever the commit.
TEST_F(PeerTest, AReloadFromAPeerWithAFlippedByteFailsNamingItAndLeavesEveryParameterAsItWas) {
  Model puller_model(7);
  Model served_model(8);
  Instance instance(served_model, 1);
  const Parameter& served = instance.layouts[0].parameter("model.layers.1.mlp.down_proj.weight");
  served.data[100] ^= std::byte{0x01};
  const ModelLayout old_values = loaded_layout(puller_model, 1, 0);
  for (LoadMode mode : {LoadMode::kReload, LoadMode::kUpdate}) {
    for (std::optional<LayerCommit> commit : {std::optional<LayerCommit>(), std::optional(LayerCommit::kAsArrived)}) {
      const std::string round = std::string(load_mode_name(mode)) + (commit ? ", commit as arrived" : ", default commit");
      ModelLayout layout = loaded_layout(puller_model, 1, 0);
      PeerSource source(instance.uri(), pull_options());
      LoadSession session(layout);
      session.begin(mode, TensorFormat::kCheckpoint, commit);
      EXPECT_EQ(session.commit(), commit.value_or(LayerCommit::kWholeLayer)) << round;
      PeerPullReport report;
      const std::string text = error_text([&] { report = source.pull(session); });
      EXPECT_THAT(text, AllOf(HasSubstr("parameter model.layers.1.mlp.down_proj.weight read from peer " +
                                        instance.servers[0]->address()),
                              HasSubstr("does not match its digest"), HasSubstr("the pull is refused")))
          << round;
      EXPECT_EQ(session.counters().bytes_applied, 0u) << round;
      // Bit for bit: every parameter holds the puller's own checkpoint still.
      const LayoutComparison comparison = compare_layouts(layout, old_values);
      EXPECT_EQ(comparison.compared, layout.parameters().size()) << round;
      EXPECT_EQ(comparison.mismatched, 0u) << round << ": " << ::testing::PrintToString(comparison.mismatches);
    }
  }
}

TEST_F(PeerTest, AReloadFromAGoodPeerTakesItsBytesThroughStagingAndEqualsItsCheckpoint) {
  Model puller_model(7);
  Model served_model(8);
  Instance instance(served_model, 1);
  for (std::optional<LayerCommit> commit : {std::optional<LayerCommit>(), std::optional(LayerCommit::kAsArrived)}) {
    ModelLayout layout = loaded_layout(puller_model, 1, 0);
    PeerSource source(instance.uri(), pull_options());
    LoadSession session(layout);
    session.begin(LoadMode::kReload, TensorFormat::kCheckpoint, commit);
    PeerPullReport report = source.pull(session);
    session.finish();
    EXPECT_EQ(report.bytes_in_place, 0u);  // nothing read straight into a live parameter
    EXPECT_GT(report.bytes_from_peers, 0u);
    EXPECT_EQ(report.parameters_read, layout.parameters().size());
    const LayoutComparison comparison = compare_layouts(layout, instance.layouts[0]);
    EXPECT_EQ(comparison.mismatched, 0u) << ::testing::PrintToString(comparison.mismatches);
  }
}

uint64_t largest_parameter_bytes(const ModelLayout& layout) {
  uint64_t largest = 0;
  for (const Parameter& parameter : layout.parameters()) largest = std::max(largest, parameter.bytes());
  return largest;
}

uint64_t layout_bytes(const ModelLayout& layout) {
  uint64_t bytes = 0;
  for (const Parameter& parameter : layout.parameters()) bytes += parameter.bytes();
  return bytes;
}

// A reload stages a few layers at a time, never the model: with memory_limit 2 MiB, three
// buffers of a third of it each (or of one serving parameter, where one is larger), which
// every batch reuses, and the next pull of the source too.
TEST_F(PeerTest, AReloadStagesAFewLayersAtATimeInBuffersItReusesAndEqualsItsCheckpoint) {
  Model puller_model(7, 1024, 8);
  Model served_model(8, 1024, 8);
  Instance instance(served_model, 1);
  PeerPullOptions options = pull_options();
  options.memory_limit = 2 << 20;
  PeerSource source(instance.uri(), options);
  ModelLayout layout = loaded_layout(puller_model, 1, 0);
  const uint64_t largest = (largest_parameter_bytes(layout) + 63) / 64 * 64;
  ASSERT_GT(layout_bytes(layout), 8u << 20);  // several times what the staging holds
  for (int round = 0; round < 2; ++round) {
    LoadSession session(layout);
    session.begin(LoadMode::kReload);
    PeerPullReport report = source.pull(session);
    session.finish();
    EXPECT_EQ(report.bytes_in_place, 0u);
    // A fused serving parameter (qkv_proj, gate_up_proj) whose tensors fall in two batches
    // is read in each, only the digest pieces that batch needs.
    EXPECT_GE(report.parameters_read, layout.parameters().size());
    EXPECT_GT(report.staging_bytes, 0u);
    EXPECT_LE(report.staging_bytes, std::max<uint64_t>(options.memory_limit, 3 * largest)) << "round " << round;
    EXPECT_LT(report.staging_bytes, layout_bytes(layout) / 2) << "round " << round;
    const LayoutComparison comparison = compare_layouts(layout, instance.layouts[0]);
    EXPECT_EQ(comparison.mismatched, 0u) << "round " << round << ": " << ::testing::PrintToString(comparison.mismatches);
  }
}

// Issue 45: a reload larger than its staging is checked batch by batch, each batch whole
// before the session sees it. A flipped byte in layer 1 fails it naming the parameter. By
// default (whole layers) the layers before it (global, layer 0) hold the served values and
// every parameter of layer 1 its old ones; with commit as arrived the batches before it are
// written too, part of layer 1 included. Either way no byte of any parameter is other than
// its old or its served value: nothing that failed, or skipped, its check ever lands.
TEST_F(PeerTest, AReloadLargerThanItsStagingThatFailsWritesOnlyCheckedBytesAndByDefaultWholeLayers) {
  Model puller_model(7, 1024);
  Model served_model(8, 1024);
  Instance instance(served_model, 1);
  const std::string victim = "model.layers.1.mlp.down_proj.weight";
  instance.layouts[0].parameter(victim).data[100] ^= std::byte{0x01};
  const ModelLayout old_values = loaded_layout(puller_model, 1, 0);
  const ModelLayout new_values = loaded_layout(served_model, 1, 0);
  PeerPullOptions options = pull_options();
  options.memory_limit = 1 << 20;
  for (std::optional<LayerCommit> commit : {std::optional<LayerCommit>(), std::optional(LayerCommit::kAsArrived)}) {
    const std::string round = commit ? "commit as arrived" : "default commit";
    ModelLayout layout = loaded_layout(puller_model, 1, 0);
    PeerSource source(instance.uri(), options);
    LoadSession session(layout);
    session.begin(LoadMode::kReload, TensorFormat::kCheckpoint, commit);
    const std::string text = error_text([&] { source.pull(session); });
    EXPECT_THAT(text, AllOf(HasSubstr("parameter " + victim + " read from peer " + instance.servers[0]->address()),
                            HasSubstr("does not match its digest")))
        << round;
    size_t written_in_layer_1 = 0;
    for (const Parameter& parameter : layout.parameters()) {
      const std::byte* old_bytes = old_values.parameter(parameter.name).data;
      const std::byte* new_bytes = new_values.parameter(parameter.name).data;
      const bool old_whole = std::memcmp(parameter.data, old_bytes, parameter.bytes()) == 0;
      const bool new_whole = std::memcmp(parameter.data, new_bytes, parameter.bytes()) == 0;
      uint64_t other = 0;
      for (uint64_t i = 0; i < parameter.bytes(); ++i) {
        other += parameter.data[i] != old_bytes[i] && parameter.data[i] != new_bytes[i];
      }
      EXPECT_EQ(other, 0u) << round << ": " << parameter.name;
      if (parameter.layer != 1) {
        EXPECT_TRUE(new_whole) << round << ": " << parameter.name << " (its layer came before the failure)";
      } else if (!commit) {
        EXPECT_TRUE(old_whole) << round << ": " << parameter.name << " (its layer never completed)";
      }
      if (parameter.name == victim) EXPECT_TRUE(old_whole) << round;
      written_in_layer_1 += parameter.layer == 1 && !old_whole;
    }
    if (commit) EXPECT_GT(written_in_layer_1, 0u) << "layer 1 was split across batches, written as they arrived";
  }
}

TEST_F(PeerTest, AWrongTokenIsRefusedAndNeverEchoed) {
  Model model;
  Instance instance(model, 1);
  std::string text = error_text([&] { PeerSource source(instance.uri(), pull_options("guess-1234")); });
  // The server proves first: the puller finds it cannot, and sends nothing derived from its token.
  EXPECT_THAT(text, HasSubstr("permission: peer " + instance.servers[0]->address() +
                              " could not prove the token: it holds another token"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("guess-1234")));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("peer-secret")));
}

TEST_F(PeerTest, TheTokenNeverCrossesTheWire) {
  Model model;
  Instance instance(model, 1);
  testing::RecordingProxy proxy(instance.servers[0]->address());
  PeerSource source(std::string(kPeerScheme) + proxy.address(), pull_options());
  ModelLayout layout = empty_layout(model, 1, 0);
  pull_into(layout, source);
  EXPECT_EQ(compare_layouts(layout, instance.layouts[0]).mismatched, 0u);
  EXPECT_THAT(proxy.from_server(), HasSubstr("\"parameters\""));  // the manifest came through the proxy
  EXPECT_THAT(proxy.from_client(), ::testing::Not(HasSubstr("peer-secret")));
  EXPECT_THAT(proxy.from_server(), ::testing::Not(HasSubstr("peer-secret")));
}

TEST_F(PeerTest, AServerWithoutATokenStartsOnlyWhenAskedAndWarns) {
  Model model;
  ModelLayout layout = loaded_layout(model, 1, 0);
  PeerServeOptions options = serve_options();
  options.token.clear();
  EXPECT_THAT(error_text([&] { PeerServer server(layout, serve_info(model, 1, 0), options); }),
              AllOf(HasSubstr("invalid_argument: peer server on 127.0.0.1:"), HasSubstr("refuses to start without a token")));
  options.open_without_token = true;
  ::testing::internal::CaptureStderr();
  PeerServer server(layout, serve_info(model, 1, 0), options);
  EXPECT_THAT(::testing::internal::GetCapturedStderr(),
              HasSubstr("warning: peer server on " + server.address() + " listens without a token"));
  const std::string uri = std::string(kPeerScheme) + server.address();
  // A puller that holds a token does not trust a server that proves none.
  EXPECT_THAT(error_text([&] { PeerSource source(uri, pull_options()); }),
              HasSubstr("could not prove the token: it says it listens without one"));
  PeerSource source(uri, pull_options(""));
  ModelLayout pulled = empty_layout(model, 1, 0);
  pull_into(pulled, source);
  EXPECT_EQ(compare_layouts(pulled, layout).mismatched, 0u);
}

TEST_F(PeerTest, APullerWithoutATokenIsToldTheServerRequiresOne) {
  Model model;
  Instance instance(model, 1);
  EXPECT_THAT(error_text([&] { PeerSource source(instance.uri(), pull_options("")); }),
              HasSubstr("permission: peer " + instance.servers[0]->address() +
                        " requires a token, and this side has none"));
}

TEST_F(PeerTest, ManifestsOfAnotherCheckpointAreRefusedByName) {
  Model model(7);
  Model other(8);
  ModelLayout first = loaded_layout(model, 2, 0);
  ModelLayout second = loaded_layout(other, 2, 1);
  PeerServer a(first, serve_info(model, 2, 0), serve_options());
  PeerServeInfo info = serve_info(other, 2, 1);
  info.config_json += " ";  // another config.json: another checkpoint identity
  PeerServer b(second, info, serve_options());
  std::string uri = std::string(kPeerScheme) + a.address() + "," + b.address();
  std::string text = error_text([&] { PeerSource source(uri, pull_options()); });
  EXPECT_THAT(text, HasSubstr("disagree on the checkpoint"));
  EXPECT_THAT(text, HasSubstr(a.address()));
  EXPECT_THAT(text, HasSubstr(b.address()));
}

// Issue 45: two servers of one config but other bytes (seeds 1 and 2) at tp ranks 0 and 1
// publish the same checkpoint identity; their content digests differ, and the pull is
// refused before an endpoint exists, naming both peers and what each serves.
TEST_F(PeerTest, PeersServingOtherContentAreRefusedBeforeAByteNamingEach) {
  Model first_model(1);
  Model second_model(2);
  ModelLayout first = loaded_layout(first_model, 2, 0);
  ModelLayout second = loaded_layout(second_model, 2, 1);
  PeerServer a(first, serve_info(first_model, 2, 0), serve_options());
  PeerServer b(second, serve_info(second_model, 2, 1), serve_options());
  const std::string first_digest = checkpoint_content_digest(*first_model.checkpoint, StreamOptions{});
  const std::string second_digest = checkpoint_content_digest(*second_model.checkpoint, StreamOptions{});
  ASSERT_NE(first_digest, second_digest);
  EXPECT_EQ(a.content_digest(), first_digest);
  EXPECT_EQ(b.content_digest(), second_digest);
  const std::string uri = std::string(kPeerScheme) + a.address() + "," + b.address();
  std::string text = error_text([&] { PeerSource source(uri, pull_options()); });
  EXPECT_THAT(text, HasSubstr("protocol: peers of " + uri + " disagree on the checkpoint's content: " + a.address() +
                              " serves " + first_digest + ", " + b.address() + " serves " + second_digest +
                              "; refusing to mix them"));
}

TEST_F(PeerTest, PeersServingOneContentAtTwoRanksAreAcceptedAndPublishItsDigest) {
  Model model;
  Instance instance(model, 2);
  const std::string digest = checkpoint_content_digest(*model.checkpoint, StreamOptions{});
  ASSERT_EQ(digest.size(), 16u);
  PeerSource source(instance.uri(), pull_options());
  EXPECT_EQ(source.content_digest(), digest);
  for (const PeerManifest& manifest : source.manifests()) EXPECT_EQ(manifest.content_digest, digest);
  ModelLayout layout = empty_layout(model, 1, 0);
  pull_into(layout, source);
  EXPECT_EQ(compare_layouts(layout, loaded_layout(model, 1, 0)).mismatched, 0u);
}

TEST_F(PeerTest, AnExpectedDigestIsAcceptedAndAnyOtherRefusedNamingThePeerAndBothDigests) {
  Model model;
  Instance instance(model, 2);
  const std::string digest = checkpoint_content_digest(*model.checkpoint, StreamOptions{});
  PeerPullOptions right = pull_options();
  right.expect_digest = digest;
  {
    PeerSource source(instance.uri(), right);
    ModelLayout layout = empty_layout(model, 2, 1);
    pull_into(layout, source);
    EXPECT_EQ(compare_layouts(layout, instance.layouts[1]).mismatched, 0u);
  }
  PeerPullOptions upper = pull_options();  // hex digits of either case
  for (char& c : upper.expect_digest = digest) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  EXPECT_NO_THROW(PeerSource(instance.uri(), upper));

  PeerPullOptions wrong = pull_options();
  wrong.expect_digest = "0123456789abcdef";
  std::string text = error_text([&] { PeerSource source(instance.uri(), wrong); });
  EXPECT_THAT(text, HasSubstr("protocol: peers of " + instance.uri() +
                              " do not serve the expected content digest 0123456789abcdef: " +
                              instance.servers[0]->address() + " serves " + digest + ", " +
                              instance.servers[1]->address() + " serves " + digest + "; refusing to pull from them"));

  PeerPullOptions malformed = pull_options();
  malformed.expect_digest = "12345";
  text = error_text([&] { PeerSource source(instance.uri(), malformed); });
  EXPECT_THAT(text, HasSubstr("invalid_argument: expected content digest '12345' for " + instance.uri() +
                              " is not 16 hex digits"));
}

TEST_F(PeerTest, AnUpdatedPeerPublishesUnknownContentServedAloneButNeverMixed) {
  Model model;
  Instance instance(model, 2);
  const std::string digest = checkpoint_content_digest(*model.checkpoint, StreamOptions{});
  instance.servers[1]->begin_update();
  instance.servers[1]->end_update();
  EXPECT_EQ(instance.servers[1]->content_digest(), "");
  EXPECT_EQ(instance.servers[0]->content_digest(), digest);

  // Alone, an updated peer is one content: pulled, with nothing to compare.
  const std::string alone = std::string(kPeerScheme) + instance.servers[1]->address();
  {
    PeerSource source(alone, pull_options());
    EXPECT_EQ(source.content_digest(), "");
    ModelLayout layout = empty_layout(model, 2, 1);
    pull_into(layout, source);
    EXPECT_EQ(compare_layouts(layout, instance.layouts[1]).mismatched, 0u);
  }
  // Beside another peer it cannot be compared: refused, saying what to do.
  instance.servers[0]->begin_update();
  instance.servers[0]->end_update();  // the same version as the other, so only the content differs
  std::string text = error_text([&] { PeerSource source(instance.uri(), pull_options()); });
  EXPECT_THAT(text, HasSubstr("protocol: peers of " + instance.uri() + ": the content of updated peers cannot be compared (" +
                              instance.servers[0]->address() + " serves unknown content (updated since it was loaded), " +
                              instance.servers[1]->address() + " serves unknown content (updated since it was loaded)); "
                              "refusing to mix them. Pull from peers not updated since they loaded their checkpoint"));
  // Pinned, unknown content is not the content asked for, even alone.
  PeerPullOptions pinned = pull_options();
  pinned.expect_digest = digest;
  text = error_text([&] { PeerSource source(alone, pinned); });
  EXPECT_THAT(text, HasSubstr("do not serve the expected content digest " + digest + ": " +
                              instance.servers[1]->address() + " serves unknown content (updated since it was loaded)"));
}

TEST_F(PeerTest, APullerThatServesRepublishesItsSourcesContentDigest) {
  Model model;
  Instance instance(model, 2);
  const std::string digest = checkpoint_content_digest(*model.checkpoint, StreamOptions{});
  PeerSource source(instance.uri(), pull_options());
  ModelLayout pulled = empty_layout(model, 1, 0);
  pull_into(pulled, source);
  PeerServer relay(pulled, peer_serve_info(source, {1, 0, 1, 0}, Processing::kNone), serve_options());
  EXPECT_EQ(relay.content_digest(), digest);
  PeerSource from_relay(std::string(kPeerScheme) + relay.address(), pull_options());
  EXPECT_EQ(from_relay.content_digest(), digest);
}

TEST_F(PeerTest, AMalformedContentDigestIsRefusedByTheServerAndByThePuller) {
  Model model;
  ModelLayout layout = loaded_layout(model, 1, 0);
  PeerServeInfo info = serve_info(model, 1, 0);
  info.content_digest = "not-a-digest";
  EXPECT_THAT(error_text([&] { PeerServer server(layout, info, serve_options()); }),
              HasSubstr("invalid_argument: peer server: content digest 'not-a-digest' is not 16 lowercase hex digits"));
  PeerManifest manifest;
  manifest.digest_piece_bytes = 4096;
  manifest.send_secret.resize(16);
  nlohmann::json json = transfer::manifest_json(manifest);
  EXPECT_NO_THROW(transfer::parse_manifest(json, "peer 127.0.0.1:1"));
  json["content_digest"] = "ABCDEF0123456789";
  EXPECT_THAT(error_text([&] { transfer::parse_manifest(json, "peer 127.0.0.1:1"); }),
              HasSubstr("protocol: peer 127.0.0.1:1: manifest has content digest 'ABCDEF0123456789', neither empty "
                        "nor 16 lowercase hex digits"));
  json.erase("content_digest");  // a server of protocol 5 would have sent none (its version is refused first)
  EXPECT_THAT(error_text([&] { transfer::parse_manifest(json, "peer 127.0.0.1:1"); }), HasSubstr("content_digest"));
}

TEST_F(PeerTest, AVersionChangeDuringThePullIsRefused) {
  Model model;
  Instance instance(model, 1);
  PeerSource source(instance.uri(), pull_options());
  instance.servers[0]->begin_update();  // after the manifest, before the reads end
  ModelLayout layout = empty_layout(model, 1, 0);
  std::string text = error_text([&] { pull_into(layout, source); });
  EXPECT_THAT(text, HasSubstr("changed its parameters during the pull"));
  instance.servers[0]->end_update();
  EXPECT_EQ(instance.servers[0]->version(), 3u);
}

TEST_F(PeerTest, AServerGoneBeforeTheReadsFailsWithinTheTimeout) {
  Model model;
  Instance instance(model, 1);
  PeerPullOptions options = pull_options();
  options.timeout = std::chrono::seconds(5);
  PeerSource source(instance.uri(), options);
  const std::string address = instance.servers[0]->address();
  instance.servers.clear();  // the peer goes away after publishing its manifest
  ModelLayout layout = empty_layout(model, 1, 0);
  auto started = std::chrono::steady_clock::now();
  std::string text = error_text([&] { pull_into(layout, source); });
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(60));
  EXPECT_THAT(text, ::testing::AnyOf(HasSubstr("network: "), HasSubstr("timeout: ")));
  EXPECT_THAT(text, HasSubstr(address));
}

// ---- bad clients harm no one ------------------------------------------------------------------

/// A raw connection to `address` that sends `bytes` (what it can of them) and stays open.
transfer::Connection connect_raw(const std::string& address, std::span<const std::byte> bytes = {}) {
  transfer::Connection peer = transfer::connect_to(address, std::chrono::seconds(10), "peer server");
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t sent = ::send(peer.fd(), bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent <= 0) break;  // refused and closed by the server, or its buffers are full: enough
    done += static_cast<size_t>(sent);
  }
  return peer;
}

/// A peer-protocol frame header of `type` claiming `length` bytes of body.
std::vector<std::byte> peer_header(uint16_t type, uint64_t length) {
  std::vector<std::byte> header(16);
  const uint32_t magic = transfer::kPeerMagic;
  const uint16_t version = transfer::kPeerProtocolVersion;
  std::memcpy(header.data(), &magic, 4);
  std::memcpy(header.data() + 4, &version, 2);
  std::memcpy(header.data() + 6, &type, 2);
  std::memcpy(header.data() + 8, &length, 8);
  return header;
}

size_t occurrences(const std::string& text, const std::string& part) {
  size_t count = 0;
  for (size_t at = 0; (at = text.find(part, at)) != std::string::npos; at += part.size()) ++count;
  return count;
}

TEST_F(PeerTest, AStrangerThatSendsAHeaderAndStallsDelaysNoPullAndIsDroppedAtItsDeadline) {
  Model model;
  Instance instance(model, 1);  // the server's message timeout is 60 s: the handshake's own 5 s applies
  ::testing::internal::CaptureStderr();
  const auto hello = static_cast<uint16_t>(transfer::HandshakeRecord::kHello);
  transfer::Connection staller = connect_raw(instance.servers[0]->address(), peer_header(hello, 32));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the server has read its header by now
  const auto begun = std::chrono::steady_clock::now();
  PeerSource source(instance.uri(), pull_options());
  ModelLayout layout = empty_layout(model, 1, 0);
  pull_into(layout, source);
  EXPECT_EQ(compare_layouts(layout, instance.layouts[0]).mismatched, 0u);
  // The pull did not wait for the staller: it is still connected, its 5 s not yet up.
  EXPECT_FALSE(staller.closed()) << "the pull took "
                                 << std::chrono::duration<double>(std::chrono::steady_clock::now() - begun).count() << " s";
  // Then it is dropped at its deadline, and said so once.
  EXPECT_THAT(error_text([&] {
                std::byte byte;
                staller.receive_bytes(std::span(&byte, 1), std::chrono::seconds(30), "the end");
              }),
              HasSubstr("disconnected"));
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(occurrences(log, "weightstream: refused a connection from 127.0.0.1:"), 1u) << log;
  EXPECT_THAT(log, HasSubstr(" to peer server on " + instance.servers[0]->address() +
                             ": no handshake within 5 s of connecting"));
}

TEST_F(PeerTest, SeventyIdleAndHalfOpenConnectionsAndGarbageLeaveAPullServed) {
  Model model;
  Instance instance(model, 1);
  const std::string address = instance.servers[0]->address();
  ::testing::internal::CaptureStderr();
  const auto hello = static_cast<uint16_t>(transfer::HandshakeRecord::kHello);
  std::vector<transfer::Connection> strangers;
  for (int i = 0; i < 35; ++i) strangers.push_back(connect_raw(address));                           // idle
  for (int i = 0; i < 35; ++i) strangers.push_back(connect_raw(address, peer_header(hello, 32)));  // half-open
  // A header claiming 512 MiB, and 100 KB of noise: each refused at its header.
  transfer::Connection claims = connect_raw(address, peer_header(hello, 512ull << 20));
  std::vector<std::byte> noise(100 << 10);
  uint64_t state = 0x2545f4914f6cdd1dull;
  for (std::byte& byte : noise) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    byte = static_cast<std::byte>(state >> 56);
  }
  transfer::Connection garbage = connect_raw(address, noise);

  PeerSource source(instance.uri(), pull_options());
  ModelLayout layout = empty_layout(model, 1, 0);
  pull_into(layout, source);
  EXPECT_EQ(compare_layouts(layout, instance.layouts[0]).mismatched, 0u);
  for (transfer::Connection* refused : {&claims, &garbage}) {
    EXPECT_THAT(error_text([&] {
                  std::byte byte;
                  refused->receive_bytes(std::span(&byte, 1), std::chrono::seconds(30), "the end");
                }),
                ::testing::AnyOf(HasSubstr("disconnected"), HasSubstr("reset")));
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(occurrences(log, "sent a 536870912-byte AUTH_HELLO (expected 32)"), 1u) << log;
  EXPECT_EQ(occurrences(log, "does not speak the weightstream peer protocol (bad magic)"), 1u) << log;
  // 64 at most wait mid-handshake: the oldest made room for the newest, each said so once.
  EXPECT_GE(occurrences(log, "dropped mid-handshake to make room (64 connections at once were mid-handshake)"), 6u)
      << log;
}

TEST_F(PeerTest, GpuMemoryNeedsACudaAwareUcx) {
  transfer::ucx::Worker worker;
  if (worker.moves_cuda_memory()) GTEST_SKIP() << "this UCX is CUDA-aware (the GPU test below covers it)";
  std::byte byte{};
  EXPECT_THAT(error_text([&] { worker.register_memory(&byte, 1, transfer::ucx::Memory::kCuda); }),
              HasSubstr("is not CUDA-aware"));
}

TEST_F(PeerTest, PullsIntoCudaParametersStraightFromAServerOnTheGpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a GPU";
  if (!transfer::ucx::Worker().moves_cuda_memory()) GTEST_SKIP() << "needs a CUDA-aware UCX";
  Model model;
  const Device gpu = parse_device("cuda:0");
  ModelLayout served = loaded_layout(model, 2, 0, gpu);
  PeerServer server(served, serve_info(model, 2, 0), serve_options());
  PeerSource source(std::string(kPeerScheme) + server.address(), pull_options());
  ModelLayout layout = empty_layout(model, 2, 0, gpu);
  PeerPullReport report = pull_into(layout, source);
  // What a host puller reads in place (parameters held identically), a GPU puller reads
  // straight into its device memory; the rest comes through host staging on both.
  ModelLayout host_layout = empty_layout(model, 2, 0);
  PeerSource host_source(std::string(kPeerScheme) + server.address(), pull_options());
  PeerPullReport host_report = pull_into(host_layout, host_source);
  EXPECT_GT(report.bytes_in_place, 0u);
  EXPECT_EQ(report.bytes_in_place, host_report.bytes_in_place);
  EXPECT_EQ(compare_layouts(host_layout, layout).mismatched, 0u);
  LayoutComparison comparison = compare_layouts(layout, loaded_layout(model, 2, 0));
  EXPECT_EQ(comparison.mismatched, 0u) << ::testing::PrintToString(comparison.mismatches);
  EXPECT_EQ(comparison.compared, layout.parameters().size());
}

TEST_F(PeerTest, AServerGoneMidPullFailsNamingItAndNothingIsReported) {
  Model model(7, 16384);
  Instance instance(model, 1);
  PeerPullOptions options = pull_options();
  options.timeout = std::chrono::seconds(5);
  // Some parameters land, then the server goes: destroyed on the pulling thread, between two
  // parameters (with reads in flight it would wait on sends only the paused puller can take).
  options.pause_after_bytes = 1;
  options.pause_mid_parameter = false;
  bool paused = false;
  options.on_pause = [&] {
    paused = true;
    instance.servers.clear();
  };
  PeerSource source(instance.uri(), options);
  const std::string address = instance.servers[0]->address();
  ModelLayout layout = empty_layout(model, 1, 0);
  LoadSession session(layout);
  session.begin(LoadMode::kCold);
  std::string text = error_text([&] { source.pull(session); });
  EXPECT_TRUE(paused);
  EXPECT_THAT(text, ::testing::AnyOf(HasSubstr("network: "), HasSubstr("timeout: ")));
  EXPECT_THAT(text, HasSubstr(address));
  EXPECT_EQ(layout.loads_finished(), 0u);
}

TEST(ParameterDigest, HashedInStepsWithTheWorkerTurnedBetweenEqualsOneCall) {
  // A pull hashes a landed parameter a few MiB at a time, turning its UCX worker in between.
  std::vector<std::byte> bytes((9ull << 20) + 123);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>((i * 2654435761u) >> 13);
  transfer::ParameterDigester digester;
  const uint64_t whole = digester.digest(bytes.data(), Device{}, bytes.size());
  int turns = 0;
  EXPECT_EQ(digester.digest(bytes.data(), Device{}, bytes.size(), [&] { ++turns; }), whole);
  EXPECT_EQ(turns, 3);  // 4 + 4 + 1 MiB and change
  bytes[bytes.size() - 1] ^= std::byte{1};
  EXPECT_NE(digester.digest(bytes.data(), Device{}, bytes.size(), [] {}), whole);
  EXPECT_EQ(digester.digest(bytes.data(), Device{}, 0, [&] { ++turns; }), digester.digest(bytes.data(), Device{}, 0));
  EXPECT_EQ(turns, 3);
}

TEST(PieceDigests, ThePiecesHoldingTheRangesLandInAnyOrderEachHashed) {
  // A pull reads the digest pieces that hold what it needs and hashes each as it lands.
  std::vector<std::byte> bytes((5ull << 10) + 77);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>((i * 2654435761u) >> 13);
  const std::vector<std::pair<uint64_t, uint64_t>> ranges{{4000, 4100}, {100, 200}, {5200, 6000}};
  transfer::PieceDigests pieces(1024, bytes.size(), ranges);
  ASSERT_EQ(pieces.size(), 4u);  // pieces 0, 3, 4 and 5 (the last 77 bytes); 1 and 2 are not needed
  EXPECT_EQ(pieces.index(0), 0u);
  EXPECT_EQ(pieces.index(3), 5u);
  EXPECT_EQ(pieces.range(3), std::make_pair(uint64_t{5120}, uint64_t{77}));
  for (size_t k : {3, 1, 0, 2}) pieces.landed(k, bytes.data());
  EXPECT_EQ(pieces.landed_count(), 4u);
  std::vector<uint64_t> expected;
  transfer::ParameterDigester().digest(bytes.data(), Device{}, bytes.size(), 1024, expected);
  ASSERT_EQ(expected.size(), 6u);
  for (size_t k = 0; k < pieces.size(); ++k) EXPECT_EQ(pieces.digest(k), expected[pieces.index(k)]) << k;

  const std::pair<uint64_t, uint64_t> whole{0, bytes.size()};
  transfer::PieceDigests all(1024, bytes.size(), std::span(&whole, 1));
  EXPECT_EQ(all.size(), 6u);
  transfer::PieceDigests empty(1024, 0, std::span(&whole, 0));
  EXPECT_EQ(empty.size(), 0u);
}

TEST(UcxSegments, TheEnvironmentsSizeIsReadAsUcxReadsItAndEndsThatDifferAreRefused) {
  if (!transfer::ucx::compiled()) GTEST_SKIP() << "this build has no UCX (WS_WITH_UCX)";
  // Restores the variable as it was (ctest runs without it).
  struct Restore {
    std::optional<std::string> was;
    Restore() {
      if (const char* value = std::getenv("UCX_TCP_RX_SEG_SIZE")) was = value;
    }
    ~Restore() {
      if (was) {
        ::setenv("UCX_TCP_RX_SEG_SIZE", was->c_str(), 1);
      } else {
        ::unsetenv("UCX_TCP_RX_SEG_SIZE");
      }
    }
  } restore;
  ::unsetenv("UCX_TCP_RX_SEG_SIZE");
  EXPECT_EQ(transfer::ucx::receive_segment_bytes(), 1u << 20);  // weightstream's default
  for (const auto& [text, bytes] : std::vector<std::pair<std::string, uint64_t>>{
           {"65536", 65536}, {"64k", 65536}, {"64K", 65536}, {"2M", 2u << 20}, {"1mb", 1u << 20}, {"1g", 1ull << 30}}) {
    ::setenv("UCX_TCP_RX_SEG_SIZE", text.c_str(), 1);
    EXPECT_EQ(transfer::ucx::receive_segment_bytes(), bytes) << text;
  }
  ::setenv("UCX_TCP_RX_SEG_SIZE", "64q", 1);
  EXPECT_THAT(error_text([] { transfer::ucx::receive_segment_bytes(); }),
              HasSubstr("config: UCX_TCP_RX_SEG_SIZE=64q is not a size UCX reads"));
  ::setenv("UCX_TCP_RX_SEG_SIZE", "64k", 1);
  EXPECT_NO_THROW(transfer::ucx::check_receive_segments(65536, "peer 192.0.2.1:7000"));
  EXPECT_THAT(error_text([] { transfer::ucx::check_receive_segments(1u << 20, "peer 192.0.2.1:7000"); }),
              HasSubstr("config: peer 192.0.2.1:7000 receives UCX tcp segments of 1048576 bytes and this process "
                        "65536: UCX aborts a process sent fragments larger than its segments, so both ends need the "
                        "same UCX_TCP_RX_SEG_SIZE"));
}

// PeerServer::stats, what `serve --metrics-listen` shows: what it publishes, the pullers it
// accepted and the manifests it sent (both counted before the puller can see its manifest),
// the pulls that reached their version check (counted before it is answered),
// the bytes it sent on rendezvous requests (counted as each send starts, so all of them by
// the pull's end), none for one-sided reads, and an update's version and unknown content.
TEST_F(PeerTest, StatsCountPullersManifestsAndTheBytesSentOnRequest) {
  Model model;
  Instance instance(model, 1);
  const PeerServer& server = *instance.servers[0];
  PeerServeStats before = server.stats();
  uint64_t parameter_bytes = 0;
  for (const Parameter& parameter : instance.layouts[0].parameters()) parameter_bytes += parameter.bytes();
  EXPECT_EQ(before.parameters, instance.layouts[0].parameters().size());
  EXPECT_EQ(before.parameter_bytes, parameter_bytes);
  EXPECT_EQ(before.pullers_accepted, 0u);
  EXPECT_EQ(before.manifests_sent, 0u);
  EXPECT_EQ(before.pulls_completed, 0u);
  EXPECT_EQ(before.bytes_sent, 0u);
  EXPECT_EQ(before.version, 1u);
  EXPECT_EQ(before.content_digest, serve_info(model, 1, 0).content_digest);
  EXPECT_FALSE(before.updating);

  PeerPullOptions options = pull_options();
  options.ucx_path = UcxPath::kRendezvous;
  {
    PeerSource source(instance.uri(), options);
    ModelLayout layout = empty_layout(model, 1, 0);
    pull_into(layout, source);
    PeerServeStats pulled = server.stats();
    EXPECT_EQ(pulled.pullers_accepted, 1u);
    EXPECT_EQ(pulled.pullers_connected, 1u);  // until the source goes
    EXPECT_EQ(pulled.manifests_sent, 1u);
    EXPECT_EQ(pulled.pulls_completed, 1u);  // its version check, counted before it was answered
    EXPECT_GE(pulled.bytes_sent, parameter_bytes);  // the same layout reads every parameter whole
  }
  options.ucx_path = UcxPath::kRma;
  const uint64_t sent_on_request = server.stats().bytes_sent;
  {
    PeerSource source(instance.uri(), options);
    ModelLayout layout = empty_layout(model, 1, 0);
    pull_into(layout, source);
  }
  PeerServeStats after = server.stats();
  EXPECT_EQ(after.manifests_sent, 2u);
  EXPECT_EQ(after.pulls_completed, 2u);
  EXPECT_EQ(after.bytes_sent, sent_on_request) << "one-sided reads never pass through the server";

  instance.servers[0]->begin_update();
  EXPECT_TRUE(server.stats().updating);
  EXPECT_EQ(server.stats().content_digest, "");
  instance.servers[0]->end_update();
  EXPECT_FALSE(server.stats().updating);
  EXPECT_EQ(server.stats().version, 3u);
}

TEST_F(PeerTest, PeerUrisAreParsed) {
  EXPECT_TRUE(is_peer_uri("peer://a:1"));
  EXPECT_FALSE(is_peer_uri("/models/x"));
  EXPECT_EQ(peer_addresses("peer://10.0.0.1:5000,10.0.0.2:5001").size(), 2u);
  EXPECT_THAT(error_text([] { peer_addresses("peer://"); }), HasSubstr("names no HOST:PORT"));
  EXPECT_THAT(error_text([] { peer_addresses("peer://a:1,"); }), HasSubstr("ends with a comma"));
}

}  // namespace
}  // namespace weightstream
