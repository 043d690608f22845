// Pushed updates end to end: a sender (a thread, or a forked process where it must die)
// sends a checkpoint over shm or TCP into a receiver holding a LoadSession in update mode;
// the result is compared bit for bit with a cold load. Also manifest validation, a sender
// that dies or stalls mid-update, tokens and the loopback default.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <future>
#include <thread>

#include "model/model_fixtures.hpp"
#include "transfer/transfer_fixtures.hpp"
#include "weightstream/error.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
using testing::cached_checkpoint;
using testing::cold_loaded_layout;
using testing::error_text;
using testing::send_async;
using testing::host_layout;
using testing::MemoryCheckpoint;
using testing::receiver_options;
using testing::run_load;
using testing::sender_options;
using namespace std::chrono_literals;

// Every checkpoint here is llama's; the seed tells the weights apart.
const MemoryCheckpoint& checkpoint_of(uint64_t seed) { return cached_checkpoint("llama", seed); }

/// A layout cold-loaded from seed 1 with a counting model hook.
struct LoadedModel {
  ModelLayout layout;
  int hook_runs = 0;
  std::map<std::string, const std::byte*> addresses;

  explicit LoadedModel(uint64_t seed = 1) : layout(host_layout(checkpoint_of(seed))) {
    layout.add_hook(make_model_hook("count", [this](ModelLayout&) { ++hook_runs; }));
    run_load(layout, LoadMode::kCold, {checkpoint_of(seed).views()});
    addresses = storage_addresses(layout);
  }
};

ModelLayout fresh_layout(uint64_t seed) { return cold_loaded_layout(checkpoint_of(seed)); }


std::vector<TensorView> layer_views(const MemoryCheckpoint& checkpoint, const std::string& prefix) {
  return checkpoint.views_matching(prefix);
}

class Transports : public ::testing::TestWithParam<TransportKind> {};

TEST_P(Transports, CheckpointUpdateMatchesAColdLoadInPlaceWithOneHookRun) {
  LoadedModel model(1);
  UpdateReceiver receiver(model.layout, receiver_options(GetParam()));
  // 64 KiB buckets: tensors of 128 KiB and more travel in pieces across buckets.
  auto sent = send_async(receiver.address(), sender_options(GetParam()), checkpoint_of(2).views());
  UpdateReport report = receiver.receive(10s);
  UpdateReport echoed = sent.get();

  ModelLayout expected = fresh_layout(2);
  LayoutComparison comparison = compare_layouts(model.layout, expected);
  EXPECT_GT(comparison.compared, 10u);
  EXPECT_EQ(comparison.mismatched, 0u) << ::testing::PrintToString(comparison.mismatches);
  EXPECT_EQ(storage_addresses(model.layout), model.addresses);
  EXPECT_EQ(model.hook_runs, 2);  // the cold load's and the update's
  EXPECT_EQ(report.counters.model_hook_runs, 1u);
  EXPECT_GT(report.buckets, 10u);
  EXPECT_EQ(report.tensors, checkpoint_of(2).tensors.size());
  EXPECT_EQ(echoed.buckets, report.buckets);
  EXPECT_EQ(echoed.bytes, report.bytes);
  EXPECT_EQ(echoed.completed_layers, report.completed_layers);
  EXPECT_EQ(report.completed_layers, (std::vector<int64_t>{-1, 0, 1}));
}

TEST_P(Transports, EngineFormatCopiesParametersInPlace) {
  LoadedModel model(1);
  ModelLayout source = fresh_layout(3);
  std::vector<std::vector<std::byte>> bytes;
  std::vector<TensorView> views;
  for (const Parameter& parameter : source.parameters()) bytes.push_back(parameter_bytes(parameter));
  for (size_t i = 0; i < source.parameters().size(); ++i) {
    const Parameter& parameter = source.parameters()[i];
    views.push_back({parameter.name, parameter.dtype, parameter.shape, bytes[i].data(), Device{}, 0, bytes[i].size()});
  }
  UpdateReceiver receiver(model.layout, receiver_options(GetParam()));
  auto sent = send_async(receiver.address(), sender_options(GetParam(), 1 << 20), views, TensorFormat::kEngine);
  UpdateReport report = receiver.receive(10s);
  sent.get();
  EXPECT_EQ(report.format, TensorFormat::kEngine);
  // Where the time went: the phases are measured and make up the update's seconds.
  const UpdatePhases& phases = report.phases;
  EXPECT_GT(phases.checking, 0.0);
  EXPECT_GT(phases.waiting, 0.0);
  // The first bucket arrives within the update (how the phases before it add up depends on
  // how the machine schedules the receiver's threads).
  EXPECT_GT(phases.first_bucket, 0.0);
  EXPECT_LE(phases.first_bucket, report.seconds);
  const double accounted = phases.preparing + phases.waiting + phases.parsing + phases.opening + phases.checking + phases.copying +
                           phases.finishing + phases.closing;
  // The phases are parts of the update's time (how much of it they cover depends on how the
  // machine schedules the receiver's threads, so only the upper bound is a property).
  EXPECT_LE(accounted, report.seconds * 1.01);
  EXPECT_GT(accounted, 0.0);
  EXPECT_EQ(compare_layouts(model.layout, source).mismatched, 0u);
  EXPECT_EQ(storage_addresses(model.layout), model.addresses);
  EXPECT_EQ(model.hook_runs, 2);
}

TEST_P(Transports, OneConnectionCarriesUpdateAfterUpdate) {
  LoadedModel model(1);
  UpdateReceiver receiver(model.layout, receiver_options(GetParam()));
  // A trainer connects once and pushes seed 2, then seed 3, then seed 5 in engine format
  // (the receiver prepared for another checkpoint-format update), then leaves; a second
  // trainer connects and pushes seed 4.
  ModelLayout engine_source = fresh_layout(5);
  auto first_trainer = std::async(std::launch::async, [&, address = receiver.address()] {
    UpdateSender sender(address, sender_options(GetParam()));
    std::vector<UpdateReport> reports;
    for (uint64_t seed : {2, 3}) {
      sender.start(TensorFormat::kCheckpoint, declared_tensors(checkpoint_of(seed).views()));
      for (const TensorView& view : checkpoint_of(seed).views()) sender.send(view);
      reports.push_back(sender.finish());
    }
    std::vector<DeclaredTensor> parameters;
    for (const Parameter& parameter : engine_source.parameters()) {
      parameters.push_back({parameter.name, parameter.dtype, parameter.shape});
    }
    sender.start(TensorFormat::kEngine, parameters);
    for (const Parameter& parameter : engine_source.parameters()) {
      std::vector<std::byte> bytes = parameter_bytes(parameter);
      sender.send({parameter.name, parameter.dtype, parameter.shape, bytes.data(), Device{}, 0, bytes.size()});
    }
    reports.push_back(sender.finish());
    return reports;
  });
  UpdateReport second_seed = receiver.receive(10s);
  EXPECT_GT(second_seed.connect_seconds, 0.0);
  EXPECT_EQ(compare_layouts(model.layout, fresh_layout(2)).mismatched, 0u);
  UpdateReport third_seed = receiver.receive(10s);
  EXPECT_EQ(third_seed.connect_seconds, 0.0);  // the same connection: no set-up
  EXPECT_EQ(compare_layouts(model.layout, fresh_layout(3)).mismatched, 0u);
  UpdateReport fifth_seed = receiver.receive(10s);
  EXPECT_EQ(fifth_seed.format, TensorFormat::kEngine);
  EXPECT_EQ(compare_layouts(model.layout, engine_source).mismatched, 0u);
  std::vector<UpdateReport> echoed = first_trainer.get();
  ASSERT_EQ(echoed.size(), 3u);
  EXPECT_EQ(echoed[1].buckets, third_seed.buckets);
  EXPECT_EQ(third_seed.shared_bytes, 0u);  // host transports move every byte through buckets
  EXPECT_EQ(third_seed.regions, 0u);

  auto second_trainer = send_async(receiver.address(), sender_options(GetParam()), checkpoint_of(4).views());
  UpdateReport fourth_seed = receiver.receive(10s);
  second_trainer.get();
  EXPECT_GT(fourth_seed.connect_seconds, 0.0);
  EXPECT_EQ(compare_layouts(model.layout, fresh_layout(4)).mismatched, 0u);
  EXPECT_EQ(storage_addresses(model.layout), model.addresses);
  EXPECT_EQ(model.hook_runs, 5);  // the cold load's and one per update
}

INSTANTIATE_TEST_SUITE_P(ShmAndTcp, Transports, ::testing::Values(TransportKind::kShm, TransportKind::kTcp),
                         [](const auto& info) { return std::string(transport_name(info.param)); });
// UCX (issue 31) where the build has it: the same updates, read one-sided from the sender's buckets.
INSTANTIATE_TEST_SUITE_P(Ucx, Transports,
                         ::testing::ValuesIn(transport_compiled(TransportKind::kUcx)
                                                 ? std::vector<TransportKind>{TransportKind::kUcx}
                                                 : std::vector<TransportKind>{}),
                         [](const auto& info) { return std::string(transport_name(info.param)); });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Transports);

// ---- one sender, several receivers ---------------------------------------------------------

void one_sender_feeds_every_receiver(TransportKind kind, UcxPath path = UcxPath::kAuto) {
  // The tensor-parallel ranks (or replicas) of an engine: each its own receiver and layout.
  // Over TCP each gets its own stream, over UCX each its own writes; NCCL (two GPUs, issue 9)
  // broadcasts once to all.
  LoadedModel first(1), second(1);
  UpdateReceiver first_receiver(first.layout, receiver_options(kind));
  UpdateReceiver second_receiver(second.layout, receiver_options(kind));
  const std::vector<std::string> addresses = {first_receiver.address(), second_receiver.address()};
  auto trainer = std::async(std::launch::async, [&] {
    SenderOptions options = sender_options(kind, 16 << 10);  // many buckets
    options.ucx_path = path;
    UpdateSender sender(addresses, options);
    if (path != UcxPath::kAuto) {
      for (const std::string& taken : sender.paths()) EXPECT_THAT(taken, ::testing::StartsWith(std::string(ucx_path_name(path)) + " ("));
      EXPECT_EQ(sender.paths().size(), 2u);
    }
    std::vector<UpdateReport> reports;
    for (uint64_t seed : {2, 3}) {
      sender.start(TensorFormat::kCheckpoint, declared_tensors(checkpoint_of(seed).views()));
      for (const TensorView& view : checkpoint_of(seed).views()) sender.send(view);
      reports.push_back(sender.finish());
    }
    return reports;
  });
  auto receive_both = [](UpdateReceiver& receiver, LoadedModel& model) {
    std::vector<uint64_t> mismatched;
    for (uint64_t seed : {2, 3}) {
      receiver.receive(10s);
      mismatched.push_back(compare_layouts(model.layout, fresh_layout(seed)).mismatched);
    }
    return mismatched;
  };
  auto second_side = std::async(std::launch::async, [&] { return receive_both(second_receiver, second); });
  EXPECT_EQ(receive_both(first_receiver, first), (std::vector<uint64_t>{0, 0}));
  EXPECT_EQ(second_side.get(), (std::vector<uint64_t>{0, 0}));
  std::vector<UpdateReport> reports = trainer.get();
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_GT(reports[0].buckets, 4u);
  EXPECT_EQ(first.hook_runs, 3);  // the cold load's and one per update, at each receiver
  EXPECT_EQ(second.hook_runs, 3);
  EXPECT_EQ(storage_addresses(first.layout), first.addresses);
  EXPECT_EQ(storage_addresses(second.layout), second.addresses);
}

TEST(SeveralReceivers, OneSenderFeedsEveryReceiverUpdateAfterUpdate) { one_sender_feeds_every_receiver(TransportKind::kTcp); }

TEST(SeveralReceivers, OneUcxSenderFeedsEveryReceiverUpdateAfterUpdate) {
  if (!transport_compiled(TransportKind::kUcx)) GTEST_SKIP() << "this build has no UCX (WS_WITH_UCX)";
  one_sender_feeds_every_receiver(TransportKind::kUcx);
}

TEST(SeveralReceivers, OneUcxSenderFeedsEveryReceiverByOneSidedPuts) {
  if (!transport_compiled(TransportKind::kUcx)) GTEST_SKIP() << "this build has no UCX (WS_WITH_UCX)";
  one_sender_feeds_every_receiver(TransportKind::kUcx, UcxPath::kRma);
}

TEST(SeveralReceivers, OneUcxSenderFeedsEveryReceiverByRendezvousMessages) {
  if (!transport_compiled(TransportKind::kUcx)) GTEST_SKIP() << "this build has no UCX (WS_WITH_UCX)";
  one_sender_feeds_every_receiver(TransportKind::kUcx, UcxPath::kRendezvous);
}

TEST(UcxRendezvous, PiecesThatStayValidTravelFromWhereTheyLieAndAreLetGoOnceLanded) {
  if (!transport_compiled(TransportKind::kUcx)) GTEST_SKIP() << "this build has no UCX (WS_WITH_UCX)";
  // `weightstream send` hands pieces of the checkpoint's mapping this way: valid and unchanged
  // until finish() (kLoad), kept by their keepalive. The large ones are sent from where they
  // lie (no copy into the bucket); the transport keeps them until their bucket has landed.
  LoadedModel model(1);
  UpdateReceiver receiver(model.layout, receiver_options(TransportKind::kUcx));
  auto keepalive = std::make_shared<int>(0);
  std::vector<TensorView> views = checkpoint_of(2).views();
  uint64_t large = 0;
  for (TensorView& view : views) {
    view.lifetime = SourceLifetime::kLoad;
    view.keepalive = keepalive;
    large += view.bytes >= (256 << 10) ? 1 : 0;
  }
  ASSERT_GT(large, 0u) << "the test model needs pieces large enough to travel in place";
  auto trainer = std::async(std::launch::async, [&] {
    SenderOptions options = sender_options(TransportKind::kUcx, 1 << 20);
    options.ucx_path = UcxPath::kRendezvous;
    UpdateSender sender(receiver.address(), options);
    sender.start(TensorFormat::kCheckpoint, declared_tensors(views));
    for (const TensorView& view : views) sender.send(view);
    const long held = keepalive.use_count();  // this test's, the views', and the transport's
    UpdateReport report = sender.finish();
    return std::make_pair(held, report);
  });
  receiver.receive(10s);
  auto [held, report] = trainer.get();
  EXPECT_GT(held, static_cast<long>(views.size()) + 1);  // some pieces were still travelling from their place
  views.clear();
  EXPECT_EQ(keepalive.use_count(), 1);  // all let go once their buckets landed
  EXPECT_EQ(report.tensors, checkpoint_of(2).tensors.size());
  EXPECT_GT(report.placed_bytes, 0u);  // and landed straight in their parameters
  EXPECT_EQ(compare_layouts(model.layout, fresh_layout(2)).mismatched, 0u);
  EXPECT_EQ(storage_addresses(model.layout), model.addresses);
}

constexpr uint64_t kOwnMessage = 256 << 10;  // the ucx sender's smallest piece sent as messages of its own

/// Sends seed 2 over ucx by `path`: its small tensors, then each large one in a bucket of
/// its own (16 MiB buckets: none is split); the receiver's report.
UpdateReport ucx_update_large_ones_whole(LoadedModel& model, UcxPath path) {
  UpdateReceiver receiver(model.layout, receiver_options(TransportKind::kUcx));
  SenderOptions options = sender_options(TransportKind::kUcx, 16 << 20);
  options.ucx_path = path;
  auto sent = std::async(std::launch::async, [&, address = receiver.address()] {
    UpdateSender sender(address, options);
    std::vector<TensorView> views = checkpoint_of(2).views();
    sender.start(TensorFormat::kCheckpoint, declared_tensors(views));
    for (const TensorView& view : views) {
      if (view.bytes < kOwnMessage) sender.send(view);
    }
    sender.flush();
    for (const TensorView& view : views) {
      if (view.bytes < kOwnMessage) continue;
      sender.send(view);
      sender.flush();
    }
    return sender.finish();
  });
  UpdateReport report = receiver.receive(10s);
  sent.get();
  return report;
}

TEST(UcxRendezvous, LargeTensorsLandStraightInTheirParameters) {
  if (!transport_compiled(TransportKind::kUcx)) GTEST_SKIP() << "this build has no UCX (WS_WITH_UCX)";
  // Tensors the session takes as they are (one place of one host parameter, its dtype)
  // travel as messages of their own, each received where it belongs: no copy out of the
  // receiver's buffer. The small ones share messages and are copied from the buffer.
  uint64_t large = 0;
  for (const TensorView& view : checkpoint_of(2).views()) large += view.bytes >= kOwnMessage ? view.bytes : 0;
  ASSERT_GT(large, 0u) << "the test model needs tensors large enough for messages of their own";
  LoadedModel model(1);
  UpdateReport report = ucx_update_large_ones_whole(model, UcxPath::kRendezvous);
  EXPECT_GE(report.placed_bytes, large);
  EXPECT_LT(report.placed_bytes, report.bytes);  // the small ones came through the buffer
  EXPECT_EQ(compare_layouts(model.layout, fresh_layout(2)).mismatched, 0u);
  EXPECT_EQ(storage_addresses(model.layout), model.addresses);
  EXPECT_EQ(model.hook_runs, 2);
}

TEST(UcxRendezvous, OneSidedPutsLandInTheBufferAndAreCopiedFromIt) {
  if (!transport_compiled(TransportKind::kUcx)) GTEST_SKIP() << "this build has no UCX (WS_WITH_UCX)";
  LoadedModel model(1);
  UpdateReport report = ucx_update_large_ones_whole(model, UcxPath::kRma);
  EXPECT_EQ(report.placed_bytes, 0u);
  EXPECT_EQ(compare_layouts(model.layout, fresh_layout(2)).mismatched, 0u);
  EXPECT_EQ(model.hook_runs, 2);
}

TEST(SeveralReceivers, OnlyTcpNcclAndUcxFeedSeveral) {
  LoadedModel model(1);
  UpdateReceiver receiver(model.layout, receiver_options(TransportKind::kShm));
  const std::vector<std::string> twice = {receiver.address(), receiver.address()};
  EXPECT_THAT(error_text([&] { UpdateSender sender(twice, sender_options(TransportKind::kShm)); }),
              HasSubstr("update sender: 2 receivers over shm, which carries one; feed several over tcp, nccl or ucx, or make "
                        "one sender per receiver"));
  EXPECT_THAT(error_text([&] { UpdateSender sender(std::vector<std::string>{}, sender_options(TransportKind::kTcp)); }),
              HasSubstr("update sender: no receiver address given"));
}

TEST(SeveralReceivers, ARefusingReceiverIsNamed) {
  LoadedModel first(1), second(1);
  UpdateReceiver first_receiver(first.layout, receiver_options(TransportKind::kTcp));
  ReceiverOptions other_token = receiver_options(TransportKind::kTcp);
  other_token.token = "another-secret";
  UpdateReceiver second_receiver(second.layout, other_token);
  const std::vector<std::string> addresses = {first_receiver.address(), second_receiver.address()};
  auto first_side = std::async(std::launch::async, [&] { return error_text([&] { first_receiver.receive(10s); }); });
  auto second_side = std::async(std::launch::async, [&] { return error_text([&] { second_receiver.receive(10s); }); });
  EXPECT_THAT(error_text([&] { UpdateSender sender(addresses, sender_options(TransportKind::kTcp)); }),
              HasSubstr("update receiver at " + second_receiver.address() +
                        " could not prove the token: it holds another token, or is not the server meant "
                        "(nothing derived from this side's token was sent)"));
  // The receiver saw a sender leave at once, after its challenge.
  EXPECT_THAT(second_side.get(), HasSubstr("disconnected"));
  // The first receiver saw its sender go away before any update.
  EXPECT_THAT(first_side.get(), HasSubstr("failed before it started"));
  EXPECT_EQ(compare_layouts(first.layout, fresh_layout(1)).mismatched, 0u);
}

// ---- manifest validation ------------------------------------------------------------------

/// Layer 1 of `model` holds seed 1's values, layer 0 seed 2's.
void expect_old_layer1_new_layer0(const LoadedModel& model) {
  ModelLayout old_values = fresh_layout(1);
  ModelLayout new_values = fresh_layout(2);
  for (const Parameter& parameter : model.layout.parameters()) {
    if (parameter.layer == 1) {
      EXPECT_EQ(parameter_bytes(parameter), testing::bytes_of(old_values, parameter.name)) << parameter.name;
    } else if (parameter.layer == 0) {
      EXPECT_EQ(parameter_bytes(parameter), testing::bytes_of(new_values, parameter.name)) << parameter.name;
    }
  }
}

/// Runs an update that declares `before` and `bad`, sends `before`, a flush, then `bad`;
/// returns the receiver's error.
std::string failed_update(LoadedModel& model, const std::vector<TensorView>& before, const std::vector<TensorView>& bad,
                          TensorFormat format = TensorFormat::kCheckpoint, std::string* sender_error = nullptr,
                          TransportKind transport = TransportKind::kTcp, uint64_t bucket_bytes = 64 << 10) {
  UpdateReceiver receiver(model.layout, receiver_options(transport));
  auto sent = std::async(std::launch::async, [&, address = receiver.address()] {
    return error_text([&] {
      UpdateSender sender(address, sender_options(transport, bucket_bytes));
      std::vector<TensorView> all = before;
      all.insert(all.end(), bad.begin(), bad.end());
      sender.start(format, declared_tensors(all));
      for (const TensorView& view : before) sender.send(view);
      sender.flush();
      for (const TensorView& view : bad) sender.send(view);
      sender.finish();
    });
  });
  std::string text = error_text([&] { receiver.receive(10s); });
  std::string sender_text = sent.get();
  if (sender_error != nullptr) *sender_error = sender_text;
  return text;
}

/// Every parameter of `model` still holds seed 1's bytes, and no hook ran after the cold load.
void expect_untouched(const LoadedModel& model) {
  LayoutComparison comparison = compare_layouts(model.layout, fresh_layout(1));
  EXPECT_GT(comparison.compared, 10u);
  EXPECT_EQ(comparison.mismatched, 0u) << ::testing::PrintToString(comparison.mismatches);
  EXPECT_EQ(model.hook_runs, 1);
}

TEST(Manifest, AnUnknownNameLastInTheUpdateIsRefusedBeforeAnyByte) {
  // The whole of seed 2, then one tensor the model does not have: before, the update failed
  // at that tensor's bucket with the layers before it already new.
  LoadedModel model(1);
  std::vector<int64_t> shape = {4, 4};
  std::vector<std::byte> junk(32);
  TensorView unknown{"model.layers.1.self_attn.rotary_blob", Dtype::kBF16, shape, junk.data(), Device{}, 0, 32};
  std::string sender_error;
  std::string text = failed_update(model, checkpoint_of(2).views(), {unknown}, TensorFormat::kCheckpoint, &sender_error);
  const std::string tensors = std::to_string(checkpoint_of(2).tensors.size() + 1);
  EXPECT_THAT(text, StartsWith("model: update from tcp peer 127.0.0.1:"));
  EXPECT_THAT(text, HasSubstr("failed before any bucket arrived: the update's manifest of " + tensors +
                              " tensors does not fit " + model.layout.description() +
                              " (1 problem; nothing of it was applied): tensor model.layers.1.self_attn.rotary_blob "
                              "matches no parameter of"));
  EXPECT_THAT(text, HasSubstr("layers completed and applied before the failure: none;"));
  EXPECT_THAT(sender_error, StartsWith("model: update receiver at 127.0.0.1:"));
  EXPECT_THAT(sender_error, HasSubstr(" refused the update: the update's manifest of " + tensors +
                                      " tensors does not fit"));
  EXPECT_THAT(sender_error, HasSubstr("tensor model.layers.1.self_attn.rotary_blob matches no parameter of"));
  expect_untouched(model);
}

TEST(Manifest, EveryProblemIsNamedTheFirstTwentyWithACount) {
  LoadedModel model(1);
  std::vector<std::string> names;
  for (int i = 0; i < 25; ++i) names.push_back("model.layers.0.extra_" + std::to_string(i));
  std::vector<int64_t> shape = {4};
  std::vector<std::byte> junk(8);
  std::vector<TensorView> unknown;
  for (const std::string& name : names) unknown.push_back({name, Dtype::kBF16, shape, junk.data(), Device{}, 0, 8});
  std::string sender_error;
  failed_update(model, checkpoint_of(2).views(), unknown, TensorFormat::kCheckpoint, &sender_error);
  EXPECT_THAT(sender_error, HasSubstr("(25 problems; nothing of it was applied): tensor model.layers.0.extra_0 "));
  EXPECT_THAT(sender_error, HasSubstr("tensor model.layers.0.extra_19 matches no parameter"));
  EXPECT_THAT(sender_error, Not(HasSubstr("extra_20 ")));
  EXPECT_THAT(sender_error, HasSubstr("; and 5 more"));
  expect_untouched(model);
}

TEST(Manifest, ARefusalTooLongForOneMessageStillReachesTheSender) {
  // Twenty-five unknown names of 4000 bytes: the reason is cut to fit one ERROR message.
  LoadedModel model(1);
  std::vector<std::string> names;
  for (int i = 0; i < 25; ++i) names.push_back("model.layers.0." + std::string(3980, 'a' + i % 26) + ".weight");
  std::vector<int64_t> shape = {4};
  std::vector<std::byte> junk(8);
  std::vector<TensorView> unknown;
  for (const std::string& name : names) unknown.push_back({name, Dtype::kBF16, shape, junk.data(), Device{}, 0, 8});
  std::string sender_error;
  failed_update(model, {}, unknown, TensorFormat::kCheckpoint, &sender_error);
  EXPECT_THAT(sender_error, StartsWith("model: update receiver at 127.0.0.1:"));
  EXPECT_THAT(sender_error, HasSubstr("refused the update: the update's manifest of 25 tensors does not fit"));
  EXPECT_THAT(sender_error, HasSubstr(" ... (cut to fit one message)"));
  expect_untouched(model);
}

TEST(Manifest, AfterARefusedUpdateTheSenderMustReconnect) {
  LoadedModel model(1);
  UpdateReceiver receiver(model.layout, receiver_options(TransportKind::kTcp));
  std::vector<int64_t> shape = {4, 4};
  std::vector<std::byte> junk(32);
  TensorView unknown{"model.layers.0.not_a_weight", Dtype::kBF16, shape, junk.data(), Device{}, 0, 32};
  auto trainer = std::async(std::launch::async, [&, address = receiver.address()] {
    UpdateSender sender(address, sender_options(TransportKind::kTcp));
    std::string first = error_text([&] { sender.start(TensorFormat::kCheckpoint, declared_tensors({&unknown, 1})); });
    std::string second = error_text([&] { sender.start(TensorFormat::kCheckpoint, {}); });
    return first + "\n" + second;
  });
  EXPECT_THAT(error_text([&] { receiver.receive(10s); }), HasSubstr("matches no parameter"));
  std::string texts = trainer.get();
  EXPECT_THAT(texts, HasSubstr("refused the update: the update's manifest of 1 tensor does not fit"));
  EXPECT_THAT(texts, HasSubstr("tensor model.layers.0.not_a_weight matches no parameter"));
  EXPECT_THAT(texts, HasSubstr("invalid_argument: update sender: an earlier update to update receiver at 127.0.0.1:"));
  EXPECT_THAT(texts, HasSubstr("failed; connect a new sender"));
  // The receiver dropped that connection and takes the next sender.
  auto next = send_async(receiver.address(), sender_options(TransportKind::kTcp), checkpoint_of(2).views());
  receiver.receive(10s);
  next.get();
  EXPECT_EQ(compare_layouts(model.layout, fresh_layout(2)).mismatched, 0u);
}

TEST(Manifest, WrongShapeAndDtypeAreNamedAndNothingIsWritten) {
  LoadedModel model(1);
  const MemoryCheckpoint& update = checkpoint_of(2);
  const auto& norm = update.tensor("model.layers.1.input_layernorm.weight");
  std::vector<TensorView> others = update.views_except("model.layers.1.input_layernorm.weight");
  std::vector<int64_t> wrong_shape = {norm.shape[0] / 2};
  TensorView half{norm.name, norm.dtype, wrong_shape, norm.bytes.data(), Device{}, 0, norm.bytes.size() / 2};
  std::string sender_error;
  EXPECT_THAT(failed_update(model, others, {half}, TensorFormat::kCheckpoint, &sender_error),
              HasSubstr("tensor model.layers.1.input_layernorm.weight has shape [128] but "
                        "parameter model.layers.1.input_layernorm.weight"));
  EXPECT_THAT(sender_error, HasSubstr("refused the update: the update's manifest of "));
  EXPECT_THAT(sender_error, HasSubstr("tensor model.layers.1.input_layernorm.weight has shape [128] but "));

  TensorView as_int{norm.name, Dtype::kI16, norm.shape, norm.bytes.data(), Device{}, 0, norm.bytes.size()};
  EXPECT_THAT(failed_update(model, others, {as_int}), HasSubstr("has dtype I16 but parameter"));

  const Parameter& parameter = model.layout.parameter("model.norm.weight");
  std::vector<std::byte> bytes(parameter.elements() * 4);
  TensorView engine_f32{parameter.name, Dtype::kF32, parameter.shape, bytes.data(), Device{}, 0, bytes.size()};
  EXPECT_THAT(failed_update(model, {}, {engine_f32}, TensorFormat::kEngine),
              HasSubstr("engine-format tensor model.norm.weight has dtype F32 but parameter "
                        "model.norm.weight (global) holds BF16"));
  expect_untouched(model);
}

TEST(Manifest, ATensorDeclaredButNotSentWholeFailsFinishByNameAndNothingIsWritten) {
  LoadedModel model(1);
  const auto& tensor = checkpoint_of(2).tensor("model.layers.0.mlp.down_proj.weight");
  const std::string size = std::to_string(tensor.bytes.size());
  UpdateReceiver receiver(model.layout, receiver_options(TransportKind::kTcp));
  auto sent = std::async(std::launch::async, [&, address = receiver.address()] {
    return error_text([&] {
      UpdateSender sender(address, sender_options(TransportKind::kTcp));
      std::vector<TensorView> views = layer_views(checkpoint_of(2), "model.layers.0.");
      sender.start(TensorFormat::kCheckpoint, declared_tensors(views));
      for (const TensorView& view : views) {
        if (view.name != tensor.name) sender.send(view);
      }
      sender.send(tensor.piece(0, 1024));  // the first 1024 bytes only
      sender.finish();
    });
  });
  std::string text = error_text([&] { receiver.receive(10s); });
  const std::string sender_error = sent.get();
  EXPECT_THAT(sender_error, HasSubstr("invalid_argument: update sender: cannot finish the update to update receiver at "
                                    "127.0.0.1:"));
  EXPECT_THAT(sender_error, HasSubstr(": 1 declared tensor was not sent whole: model.layers.0.mlp.down_proj.weight "
                                    "(1024 of " + size + " bytes) (the receivers were told; connect a new sender)"));
  EXPECT_THAT(text, StartsWith("model: update from tcp peer"));
  EXPECT_THAT(text, HasSubstr("the sender abandoned the update: 1 declared tensor was not sent whole: "
                              "model.layers.0.mlp.down_proj.weight (1024 of " + size + " bytes)"));
  expect_untouched(model);
}

TEST(Manifest, WhatTheManifestDoesNotDeclareIsRefusedAtTheSenderBeforeAnythingOfItIsSent) {
  LoadedModel model(1);
  UpdateReceiver receiver(model.layout, receiver_options(TransportKind::kTcp));
  std::vector<TensorView> layer0 = layer_views(checkpoint_of(2), "model.layers.0.");
  const TensorView norm = checkpoint_of(2).tensor("model.norm.weight").view();
  auto trainer = std::async(std::launch::async, [&, address = receiver.address()] {
    UpdateSender sender(address, sender_options(TransportKind::kTcp));
    sender.start(TensorFormat::kCheckpoint, declared_tensors(layer0));
    std::vector<std::string> texts;
    texts.push_back(error_text([&] { sender.send(norm); }));  // not declared
    TensorView as_f32 = layer0.front();
    as_f32.dtype = Dtype::kF32;
    texts.push_back(error_text([&] { sender.send(as_f32); }));
    std::vector<int64_t> folded = {2, static_cast<int64_t>(layer0.front().bytes / 4)};  // the same bytes, folded
    TensorView reshaped = layer0.front();
    reshaped.shape = folded;
    texts.push_back(error_text([&] { sender.send(reshaped); }));
    TensorView later_piece = layer0.front();  // a piece out of order
    later_piece.data += 256;
    later_piece.offset = 256;
    later_piece.bytes = 256;
    texts.push_back(error_text([&] { sender.send(later_piece); }));
    // None of it was sent: the update goes on and lands whole.
    for (const TensorView& view : layer0) sender.send(view);
    texts.push_back(error_text([&] { sender.send(layer0.front()); }));  // twice
    sender.finish();
    return texts;
  });
  std::string received = error_text([&] { receiver.receive(10s); });
  std::vector<std::string> texts = trainer.get();
  EXPECT_EQ(received, "no error");
  const std::string first(layer0.front().name);
  const std::string declared = std::string(dtype_name(layer0.front().dtype)) + " " + shape_text(layer0.front().shape);
  ASSERT_EQ(texts.size(), 5u);
  EXPECT_EQ(texts[0], "invalid_argument: update sender: tensor model.norm.weight is not in the update's manifest "
                      "(start() declares every tensor an update sends)");
  EXPECT_EQ(texts[1], "invalid_argument: update sender: tensor " + first + " is F32 " +
                          shape_text(layer0.front().shape) + " but the manifest declares it " + declared);
  EXPECT_THAT(texts[2], HasSubstr("tensor " + first + " is " + std::string(dtype_name(layer0.front().dtype)) + " [2, " +
                                  std::to_string(layer0.front().bytes / 4) + "] but the manifest declares it " + declared));
  EXPECT_EQ(texts[3], "invalid_argument: update sender: tensor " + first +
                          ": a piece at byte 256 after 0 bytes of it were sent (pieces come in order)");
  EXPECT_EQ(texts[4], "invalid_argument: update sender: tensor " + first + " was sent whole already in this update");
  ModelLayout new_values = fresh_layout(2);
  for (const Parameter& parameter : model.layout.parameters()) {
    if (parameter.layer == 0) EXPECT_EQ(parameter_bytes(parameter), testing::bytes_of(new_values, parameter.name));
  }
}

TEST(Manifest, AManifestTheSenderCannotSendIsRefusedBeforeTheWire) {
  LoadedModel model(1);
  UpdateReceiver receiver(model.layout, receiver_options(TransportKind::kTcp));
  auto receiving = std::async(std::launch::async, [&] { return receiver.receive(10s); });
  UpdateSender sender(receiver.address(), sender_options(TransportKind::kTcp));
  std::vector<DeclaredTensor> twice = {{"model.norm.weight", Dtype::kBF16, {256}}, {"model.norm.weight", Dtype::kBF16, {256}}};
  EXPECT_EQ(error_text([&] { sender.start(TensorFormat::kCheckpoint, twice); }),
            "invalid_argument: update sender: tensor model.norm.weight is declared twice in the manifest");
  std::vector<DeclaredTensor> unnamed = {{"", Dtype::kBF16, {4}}};
  EXPECT_THAT(error_text([&] { sender.start(TensorFormat::kCheckpoint, unnamed); }),
              HasSubstr("update sender: a declared tensor name of 0 bytes (1 to 4096 allowed)"));
  std::vector<DeclaredTensor> negative = {{"model.norm.weight", Dtype::kBF16, {-4}}};
  EXPECT_THAT(error_text([&] { sender.start(TensorFormat::kCheckpoint, negative); }),
              HasSubstr("update sender: declared tensor model.norm.weight: BF16 [-4] has no valid byte size"));
  // The connection is still good: nothing was sent.
  std::vector<TensorView> views = checkpoint_of(2).views();
  sender.start(TensorFormat::kCheckpoint, declared_tensors(views));
  for (const TensorView& view : views) sender.send(view);
  sender.finish();
  receiving.get();
  EXPECT_EQ(compare_layouts(model.layout, fresh_layout(2)).mismatched, 0u);
}

TEST(Manifest, ARefusalOfTheEngineReachesTheSenderWithItsReason) {
  // What only the engine can check (it replaced a bound parameter): the receiver refuses the
  // next update with the engine's reason, and the sender's start() throws it at once.
  LoadedModel model(1);
  UpdateReceiver receiver(model.layout, receiver_options(TransportKind::kTcp));
  auto sent = send_async(receiver.address(), sender_options(TransportKind::kTcp), checkpoint_of(2).views());
  const std::string reason = "cannot update llama in place: parameters the model replaced since they were bound: x";
  std::string text = error_text([&] { receiver.refuse(reason, 10s); });
  EXPECT_THAT(text, StartsWith("model: update from tcp peer 127.0.0.1:"));
  EXPECT_THAT(text, HasSubstr("failed before any bucket arrived: " + reason + ";"));
  std::string sender_error = error_text([&] { sent.get(); });
  EXPECT_EQ(sender_error, "model: update receiver at " + receiver.address() + " refused the update: " + reason);
  expect_untouched(model);
}

// ---- FP8 block-scaled weights: codes and scales travel together --------------------------

const MemoryCheckpoint& fp8_checkpoint_of(uint64_t seed) {
  static std::map<uint64_t, MemoryCheckpoint> cache;
  auto found = cache.find(seed);
  if (found == cache.end()) {
    SynthOptions options = testing::synth_options("qwen3_moe", seed);
    options.quantize = SynthOptions::Quantization::kFp8Block;
    found = cache.emplace(seed, testing::synth_in_memory(options)).first;
  }
  return found->second;
}

/// The BF16 weights of the same model (its FP8 checkpoint quantizes them).
MemoryCheckpoint bf16_checkpoint_of(uint64_t seed) {
  SynthOptions options = testing::synth_options("qwen3_moe", seed);
  options.block_aligned = true;  // the FP8 model's sizes
  return testing::synth_in_memory(options);
}

/// Seed `seed`'s views of the FP8 qwen3_moe checkpoint, without the tensor named `left_out`.
std::vector<TensorView> fp8_views_without(uint64_t seed, const std::string& left_out) {
  std::vector<TensorView> views;
  for (const TensorView& view : fp8_checkpoint_of(seed).views()) {
    if (view.name != left_out) views.push_back(view);
  }
  return views;
}

/// Pushes `views` over tcp into a model cold-loaded from FP8 seed 1; the receiver's error (or
/// "no error"), the sender's, and whether every parameter still holds seed 1's bytes.
struct Fp8Update {
  std::string receiver_error;
  std::string sender_error;
  bool untouched = false;
  bool equals_seed2 = false;
};

Fp8Update fp8_update(const std::vector<TensorView>& views, TensorFormat format = TensorFormat::kCheckpoint) {
  ModelLayout layout = cold_loaded_layout(fp8_checkpoint_of(1));
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  auto sent = send_async(receiver.address(), sender_options(TransportKind::kTcp), views, format);
  Fp8Update result;
  result.receiver_error = error_text([&] { receiver.receive(10s); });
  result.sender_error = error_text([&] { sent.get(); });
  result.untouched = compare_layouts(layout, cold_loaded_layout(fp8_checkpoint_of(1))).mismatched == 0;
  result.equals_seed2 = compare_layouts(layout, cold_loaded_layout(fp8_checkpoint_of(2))).mismatched == 0;
  return result;
}

TEST(Fp8Manifest, CodesWithTheirScalesLandAndBf16WeightsComeAlone) {
  Fp8Update whole = fp8_update(fp8_checkpoint_of(2).views());
  EXPECT_EQ(whole.receiver_error, "no error");
  EXPECT_TRUE(whole.equals_seed2);
  // BF16 weights, quantized by the receiver, need no scales.
  MemoryCheckpoint bf16 = bf16_checkpoint_of(2);
  Fp8Update quantized = fp8_update(bf16.views());
  EXPECT_EQ(quantized.receiver_error, "no error");
  EXPECT_EQ(quantized.sender_error, "no error");
  EXPECT_FALSE(quantized.untouched);
}

TEST(Fp8Manifest, CodesWithoutTheirScalesAreRefusedByName) {
  const std::string weight = "model.layers.1.mlp.experts.3.down_proj.weight";
  Fp8Update update = fp8_update(fp8_views_without(2, weight + "_scale_inv"));
  EXPECT_THAT(update.sender_error, HasSubstr("refused the update: the update's manifest of "));
  EXPECT_THAT(update.sender_error, HasSubstr("(1 problem; nothing of it was applied): FP8 weight " + weight +
                                             " is declared as F8_E4M3 codes without its block scales " + weight +
                                             "_scale_inv: send an FP8 weight with its weight_scale_inv, or a BF16, "
                                             "F16 or F32 weight alone (quantized here)"));
  EXPECT_THAT(update.receiver_error, HasSubstr("failed before any bucket arrived"));
  EXPECT_TRUE(update.untouched);
}

TEST(Fp8Manifest, ScalesWithoutTheirCodesAreRefusedByName) {
  const std::string weight = "model.layers.0.self_attn.o_proj.weight";
  Fp8Update update = fp8_update(fp8_views_without(2, weight));
  EXPECT_THAT(update.sender_error, HasSubstr("(1 problem; nothing of it was applied): block scales " + weight +
                                             "_scale_inv are declared without their FP8 weight " + weight +
                                             ": send an FP8 weight with its weight_scale_inv"));
  EXPECT_TRUE(update.untouched);
}

TEST(Fp8Manifest, ABf16WeightBesideItsScalesIsRefused) {
  const std::string weight = "model.layers.0.self_attn.o_proj.weight";
  MemoryCheckpoint bf16 = bf16_checkpoint_of(2);
  std::vector<TensorView> views = fp8_views_without(2, weight);
  views.push_back(bf16.tensor(weight).view());
  Fp8Update update = fp8_update(views);
  EXPECT_THAT(update.sender_error, HasSubstr("weight " + weight + " is declared as BF16 to be quantized here, beside "
                                             "its block scales " + weight + "_scale_inv"));
  EXPECT_TRUE(update.untouched);
}

TEST(Fp8Manifest, EngineFormatCodesWithoutTheirScalesAreRefused) {
  ModelLayout source = cold_loaded_layout(fp8_checkpoint_of(2));
  const std::string weight = "model.layers.1.self_attn.qkv_proj.weight";
  std::vector<std::vector<std::byte>> bytes;
  std::vector<TensorView> views;
  for (const Parameter& parameter : source.parameters()) bytes.push_back(parameter_bytes(parameter));
  for (size_t i = 0; i < source.parameters().size(); ++i) {
    const Parameter& parameter = source.parameters()[i];
    if (parameter.name == weight + "_scale_inv" || parameter.parts.empty()) continue;
    views.push_back({parameter.name, parameter.dtype, parameter.shape, bytes[i].data(), Device{}, 0, bytes[i].size()});
  }
  Fp8Update update = fp8_update(views, TensorFormat::kEngine);
  EXPECT_THAT(update.sender_error, HasSubstr("FP8 weight " + weight + " is declared as F8_E4M3 codes without its "
                                             "block scales " + weight + "_scale_inv"));
  EXPECT_TRUE(update.untouched);
}

// ---- senders that die or stall --------------------------------------------------------------

/// Forks a sender that sends `views` then dies (`stall`: stops answering instead). The pipe
/// tells the parent how many buckets had gone out.
struct DyingSender {
  pid_t pid = -1;
  int pipe_read = -1;
  DyingSender(const std::string& address, const std::vector<TensorView>& views, bool stall,
              TransportKind transport = TransportKind::kTcp) {
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      uint64_t sent = UINT64_MAX;
      try {
        UpdateSender sender(address, sender_options(transport, 16 << 10));
        sender.start(TensorFormat::kCheckpoint, declared_tensors(views));
        for (const TensorView& view : views) sender.send(view);
        sent = sender.buckets_sent();
        (void)!::write(fds[1], &sent, sizeof(sent));
        if (stall) ::pause();  // connected and silent
      } catch (...) {
        (void)!::write(fds[1], &sent, sizeof(sent));
      }
      ::raise(SIGKILL);  // vanish without a word, as a crashed trainer would
    }
    ::close(fds[1]);
    pipe_read = fds[0];
  }
  uint64_t buckets_sent() {
    uint64_t sent = 0;
    EXPECT_EQ(::read(pipe_read, &sent, sizeof(sent)), static_cast<ssize_t>(sizeof(sent)));
    return sent;
  }
  ~DyingSender() {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    ::close(pipe_read);
  }
};

TEST(Manifest, OverUcxABadManifestFailsBeforeAnyByteLands) {
  if (!transport_compiled(TransportKind::kUcx)) GTEST_SKIP() << "this build has no UCX (WS_WITH_UCX)";
  // Over ucx a bucket's large tensors land straight in their parameters as they arrive; an
  // update that names an unknown tensor after good large ones is refused whole at START.
  LoadedModel model(1);
  const MemoryCheckpoint& update = checkpoint_of(2);
  std::vector<TensorView> layer1 = layer_views(update, "model.layers.1.");
  auto large = std::ranges::find_if(layer1, [](const TensorView& view) { return view.bytes >= kOwnMessage; });
  ASSERT_NE(large, layer1.end());
  std::vector<int64_t> shape = {4, 4};
  std::vector<std::byte> junk(32);
  TensorView unknown{"model.layers.1.self_attn.rotary_blob", Dtype::kBF16, shape, junk.data(), Device{}, 0, 32};
  std::string text = failed_update(model, layer_views(update, "model.layers.0."), {*large, unknown},
                                   TensorFormat::kCheckpoint, nullptr, TransportKind::kUcx, 16 << 20);
  EXPECT_THAT(text, HasSubstr("tensor model.layers.1.self_attn.rotary_blob matches no parameter of"));
  EXPECT_THAT(text, HasSubstr(") failed before any bucket arrived: "));
  EXPECT_THAT(text, HasSubstr("layers completed and applied before the failure: none; layers written in part (over "
                              "ucx, tensors land in their parameters as they arrive): none;"));
  expect_untouched(model);
}

/// Layer 0 whole and the first half of layer 1's tensors of the seed-2 checkpoint.
std::vector<TensorView> partial_update() {
  std::vector<TensorView> views = layer_views(checkpoint_of(2), "model.layers.0.");
  std::vector<TensorView> layer1 = layer_views(checkpoint_of(2), "model.layers.1.");
  views.insert(views.end(), layer1.begin(), layer1.begin() + static_cast<ptrdiff_t>(layer1.size() / 2));
  return views;
}

void expect_old_layer1_new_layer0_then_reload_restores(LoadedModel& model) {
  expect_old_layer1_new_layer0(model);
  ModelLayout new_values = fresh_layout(2);
  run_load(model.layout, LoadMode::kReload, {checkpoint_of(2).views()});
  EXPECT_EQ(compare_layouts(model.layout, new_values).mismatched, 0u);
  EXPECT_EQ(storage_addresses(model.layout), model.addresses);
}

TEST(DeadSender, KilledMidUpdateNamesTheLastBucketAndKeepsIncompleteLayers) {
  LoadedModel model(1);
  UpdateReceiver receiver(model.layout, receiver_options(TransportKind::kTcp));
  DyingSender sender(receiver.address(), partial_update(), /*stall=*/false);
  std::string text = error_text([&] { receiver.receive(10s); });
  uint64_t buckets = sender.buckets_sent();
  ASSERT_GT(buckets, 2u);
  ASSERT_NE(buckets, UINT64_MAX);
  EXPECT_THAT(text, StartsWith("network: update from tcp peer 127.0.0.1:"));
  EXPECT_THAT(text, HasSubstr("failed after bucket " + std::to_string(buckets - 1) + " (the last received)"));
  EXPECT_THAT(text, HasSubstr("(the peer has gone)"));
  EXPECT_THAT(text, HasSubstr("layers completed and applied before the failure: layer 0;"));
  EXPECT_THAT(text, HasSubstr("every other layer keeps its old values"));
  expect_old_layer1_new_layer0_then_reload_restores(model);
  EXPECT_EQ(model.hook_runs, 2);  // cold load and the reload; the failed update ran none
}

TEST(DeadSender, OverUcxKilledMidUpdateNamesTheLayersWrittenInPart) {
  if (!transport_compiled(TransportKind::kUcx)) GTEST_SKIP() << "this build has no UCX (WS_WITH_UCX)";
  // Over ucx, tensors land in their parameters as they arrive: the layer the sender was
  // sending when it died holds some new tensors, and the error says so.
  LoadedModel model(1);
  UpdateReceiver receiver(model.layout, receiver_options(TransportKind::kUcx));
  DyingSender sender(receiver.address(), partial_update(), /*stall=*/false, TransportKind::kUcx);
  std::string text = error_text([&] { receiver.receive(10s); });
  uint64_t buckets = sender.buckets_sent();
  ASSERT_GT(buckets, 2u);
  ASSERT_NE(buckets, UINT64_MAX);
  EXPECT_THAT(text, StartsWith("network: update from tcp peer 127.0.0.1:"));
  EXPECT_THAT(text, HasSubstr("layers completed and applied before the failure: layer 0;"));
  EXPECT_THAT(text, HasSubstr("layers written in part (over ucx, tensors land in their parameters as they arrive): "
                              "layer 1;"));
  ModelLayout new_values = fresh_layout(2);
  for (const Parameter& parameter : model.layout.parameters()) {
    if (parameter.layer == 0) EXPECT_EQ(parameter_bytes(parameter), testing::bytes_of(new_values, parameter.name));
  }
  // The next sender's update fails at its first bucket's checks: no layer is written, and
  // none of the failed update's is reported again.
  std::vector<int64_t> shape = {4, 4};
  std::vector<std::byte> junk(32);
  auto refused = send_async(receiver.address(), sender_options(TransportKind::kUcx),
                            {TensorView{"model.layers.1.self_attn.rotary_blob", Dtype::kBF16, shape, junk.data(),
                                        Device{}, 0, 32}});
  std::string second = error_text([&] { receiver.receive(10s); });
  EXPECT_THAT(error_text([&] { refused.get(); }), HasSubstr("rotary_blob"));
  EXPECT_THAT(second, HasSubstr("matches no parameter of"));
  EXPECT_THAT(second, HasSubstr("layers completed and applied before the failure: none; layers written in part "
                                "(over ucx, tensors land in their parameters as they arrive): none;"));
  run_load(model.layout, LoadMode::kReload, {checkpoint_of(2).views()});  // a reload restores a consistent model
  EXPECT_EQ(compare_layouts(model.layout, new_values).mismatched, 0u);
  EXPECT_EQ(storage_addresses(model.layout), model.addresses);
}

TEST(DeadSender, StalledSenderTimesOutNamingTheLastBucket) {
  LoadedModel model(1);
  ReceiverOptions options = receiver_options(TransportKind::kTcp);
  options.timeout = 400ms;
  UpdateReceiver receiver(model.layout, options);
  DyingSender sender(receiver.address(), partial_update(), /*stall=*/true);
  std::string text = error_text([&] { receiver.receive(10s); });
  uint64_t buckets = sender.buckets_sent();
  EXPECT_THAT(text, StartsWith("timeout: update from tcp peer"));
  EXPECT_THAT(text, HasSubstr("failed after bucket " + std::to_string(buckets - 1) + " (the last received)"));
  EXPECT_THAT(text, HasSubstr("timed out after 0.4 s of silence"));
  EXPECT_THAT(text, HasSubstr("waiting for bucket " + std::to_string(buckets) + " or FINISH"));
  expect_old_layer1_new_layer0_then_reload_restores(model);
}

// ---- tokens and binding ---------------------------------------------------------------------

TEST(Security, WrongTokenIsRefusedBeforeAnythingIsWritten) {
  for (TransportKind kind : {TransportKind::kTcp, TransportKind::kShm}) {
    LoadedModel model(1);
    UpdateReceiver receiver(model.layout, receiver_options(kind));
    SenderOptions options = sender_options(kind);
    options.token = "guess";
    auto received = std::async(std::launch::async, [&] { return error_text([&] { receiver.receive(3s); }); });
    // The sender finds out first: the receiver cannot prove "guess", so the sender stops
    // before its own proof, and the receiver sees it leave and goes on waiting.
    EXPECT_THAT(error_text([&] { UpdateSender sender(receiver.address(), options); }),
                HasSubstr("update receiver at " + receiver.address() + " could not prove the token"));
    EXPECT_THAT(received.get(), HasSubstr("1 peer(s) disconnected before their HELLO"));
    EXPECT_EQ(model.hook_runs, 1);
  }
}

TEST(Security, ListenersBindLoopbackOrAPrivateUnixSocketByDefault) {
  LoadedModel model(1);
  UpdateReceiver tcp(model.layout, ReceiverOptions{.token = "shared-secret"});
  EXPECT_THAT(tcp.address(), StartsWith("127.0.0.1:"));
  ReceiverOptions shm_options;
  shm_options.transport = TransportKind::kShm;
  shm_options.token = "shared-secret";
  UpdateReceiver shm(model.layout, shm_options);
  struct stat status{};
  ASSERT_EQ(::stat(shm.address().c_str(), &status), 0) << shm.address();
  EXPECT_TRUE(S_ISSOCK(status.st_mode));
  EXPECT_EQ(status.st_mode & 0777, 0600u);
}

TEST(Security, NonLoopbackOnlyWhenAsked) {
  LoadedModel model(1);
  ReceiverOptions options;
  options.listen = "0.0.0.0:0";
  options.token = "shared-secret";
  UpdateReceiver receiver(model.layout, options);
  EXPECT_THAT(receiver.address(), StartsWith("0.0.0.0:"));
}

TEST(Transports, TransportNamesParseAndUnknownIsAnError) {
  EXPECT_EQ(parse_transport("cuda-ipc"), TransportKind::kCudaIpc);
  EXPECT_EQ(parse_transport("nccl"), TransportKind::kNccl);
  EXPECT_THAT(error_text([] { parse_transport("rdma"); }),
              HasSubstr("transport 'rdma' is not one of shm, tcp, cuda-ipc, nccl"));
}

}  // namespace
}  // namespace weightstream
