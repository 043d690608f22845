// Delta updates (issue 46, docs/DELTA.md): a receiver holding version A takes the changed
// elements of A -> B and ends bit for bit equal to a cold load of B, in place; a delta for
// another version is refused before its first byte; a truncated or corrupted one fails naming
// its tensor. Also the changed-elements encoding on its own.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <random>

#include "model/model_fixtures.hpp"
#include "update/delta.hpp"
#include "transfer/delta_fixtures.hpp"
#include "transfer/transfer_fixtures.hpp"
#include "update/wire.hpp"
#include "weightstream/error.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using testing::cached_checkpoint;
using testing::cold_loaded_layout;
using testing::error_text;
using testing::host_layout;
using testing::kVersionA;
using testing::kVersionB;
using testing::MemoryCheckpoint;
using testing::MemoryTensor;
using testing::receiver_options;
using testing::run_load;
using testing::sender_options;
using namespace std::chrono_literals;

const std::string kOtherVersion = "c2c2c2c2c2c2c2c2";
// Every element of this tensor changes: it goes dense.
const std::string kRewrittenTensor = "model.norm.weight";

const MemoryCheckpoint& version_a() { return cached_checkpoint("llama", 1); }

/// `base` after one step: testing::changed_copy(), with every element of kRewrittenTensor.
MemoryCheckpoint stepped_copy(const MemoryCheckpoint& base, double fraction, uint64_t seed) {
  return testing::changed_copy(base, fraction, seed, kRewrittenTensor);
}

const MemoryCheckpoint& version_b() {
  static const MemoryCheckpoint next = stepped_copy(version_a(), 0.01, 46);
  return next;
}

uint64_t total_bytes(const MemoryCheckpoint& checkpoint) {
  uint64_t bytes = 0;
  for (const MemoryTensor& tensor : checkpoint.tensors) bytes += tensor.bytes.size();
  return bytes;
}

/// Pushes the delta base -> next in one update; returns the sender's report and how many
/// tensors went as changed elements.
struct DeltaSent {
  UpdateReport report;
  uint64_t sparse = 0;
};
std::future<DeltaSent> send_delta_async(std::string address, SenderOptions options, const MemoryCheckpoint& base,
                                        const MemoryCheckpoint& next, UpdateVersions versions) {
  return std::async(std::launch::async, [=, &base, &next] {
    UpdateSender sender(address, options);
    sender.start(TensorFormat::kCheckpoint, declared_tensors(next.views()), versions);
    DeltaSent sent;
    for (const MemoryTensor& tensor : next.tensors) {
      sent.sparse += sender.send_changes(base.tensor(tensor.name).view(), tensor.view()) ? 1 : 0;
    }
    sent.report = sender.finish();
    return sent;
  });
}

class DeltaTransports : public ::testing::TestWithParam<TransportKind> {};

TEST_P(DeltaTransports, DeltaLandsInPlaceEqualToAColdLoadOfTheNewVersion) {
  ModelLayout layout = cold_loaded_layout(version_a());
  ASSERT_GT(compare_layouts(layout, cold_loaded_layout(version_b())).mismatched, 10u);  // B differs from A
  const auto addresses = storage_addresses(layout);
  UpdateReceiver receiver(layout, receiver_options(GetParam()));
  receiver.set_version(kVersionA);
  auto sent = send_delta_async(receiver.address(), sender_options(GetParam(), 1 << 20), version_a(), version_b(),
                               {kVersionA, kVersionB});
  UpdateReport report = receiver.receive(10s);
  DeltaSent echoed = sent.get();

  LayoutComparison comparison = compare_layouts(layout, cold_loaded_layout(version_b()));
  EXPECT_GT(comparison.compared, 10u);
  EXPECT_EQ(comparison.mismatched, 0u) << ::testing::PrintToString(comparison.mismatches);
  EXPECT_EQ(storage_addresses(layout), addresses);
  EXPECT_EQ(receiver.version(), kVersionB);
  // Every tensor but the rewritten one (and those too small for their encoding) went sparse.
  EXPECT_EQ(report.sparse_tensors, echoed.sparse);
  EXPECT_EQ(report.sparse_tensors + report.dense_tensors, version_b().tensors.size());
  EXPECT_GE(report.dense_tensors, 1u);
  EXPECT_GT(report.sparse_tensors, version_b().tensors.size() / 2);
  EXPECT_EQ(report.tensors, version_b().tensors.size());
  EXPECT_EQ(echoed.report.sparse_tensors, report.sparse_tensors);
  // 1% changed: the bytes moved are a small part of the full update's.
  EXPECT_LT(report.bytes, total_bytes(version_b()) / 10);
}

INSTANTIATE_TEST_SUITE_P(ShmAndTcp, DeltaTransports, ::testing::Values(TransportKind::kShm, TransportKind::kTcp),
                         [](const auto& info) { return std::string(transport_name(info.param)); });
INSTANTIATE_TEST_SUITE_P(Ucx, DeltaTransports,
                         ::testing::ValuesIn(transport_compiled(TransportKind::kUcx)
                                                 ? std::vector<TransportKind>{TransportKind::kUcx}
                                                 : std::vector<TransportKind>{}),
                         [](const auto& info) { return std::string(transport_name(info.param)); });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(DeltaTransports);

TEST(Delta, ATensorParallelRankKeepsOnlyItsOwnElements) {
  // Rank 1 of 2: fused q/k/v and gate/up, row and column shards, the vocabulary split.
  ModelLayout layout = cold_loaded_layout(version_a(), 2, 1);
  const auto addresses = storage_addresses(layout);
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  auto sent = send_delta_async(receiver.address(), sender_options(TransportKind::kTcp, 1 << 20), version_a(),
                               version_b(), {kVersionA, kVersionB});
  receiver.receive(10s);
  sent.get();
  LayoutComparison comparison = compare_layouts(layout, cold_loaded_layout(version_b(), 2, 1));
  EXPECT_EQ(comparison.mismatched, 0u) << ::testing::PrintToString(comparison.mismatches);
  EXPECT_EQ(storage_addresses(layout), addresses);
}

TEST(Delta, Fp8BlockScaledExpertsTakeTheirChangedCodesAndScalesAtTensorParallelWithExperts) {
  // FP8 codes and F32 block scales as the checkpoint ships them, at tp 2 rank 1 with experts
  // divided between 2 ranks: each parameter part takes its own changed elements.
  SynthOptions synth = testing::synth_options("qwen3_moe", 1);
  synth.quantize = SynthOptions::Quantization::kFp8Block;
  const MemoryCheckpoint base = testing::synth_in_memory(synth);
  const MemoryCheckpoint next = stepped_copy(base, 0.01, 48);
  LayoutOptions options;
  options.parallel.ep_size = 2;
  options.parallel.ep_rank = 1;
  auto loaded = [&](const MemoryCheckpoint& checkpoint) {
    ModelLayout layout = host_layout(checkpoint, 2, 1, options);
    run_load(layout, LoadMode::kCold, {checkpoint.views()});
    return layout;
  };
  ModelLayout layout = loaded(base);
  const auto addresses = storage_addresses(layout);
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kShm));
  receiver.set_version(kVersionA);
  auto sent = send_delta_async(receiver.address(), sender_options(TransportKind::kShm, 1 << 20), base, next,
                               {kVersionA, kVersionB});
  UpdateReport report = receiver.receive(10s);
  sent.get();
  EXPECT_GT(report.sparse_tensors, next.tensors.size() / 2);
  LayoutComparison comparison = compare_layouts(layout, loaded(next));
  EXPECT_EQ(comparison.mismatched, 0u) << ::testing::PrintToString(comparison.mismatches);
  EXPECT_GT(compare_layouts(layout, loaded(base)).mismatched, 10u);
  EXPECT_EQ(storage_addresses(layout), addresses);
}

/// Sends `next` (BF16 weights) as a delta from `base` (their FP8 block-scaled checkpoint): each
/// weight `base` holds as codes and scales is quantized at the sender and sent as the changes of
/// its codes and scales; the rest as send_changes(). Returns the sender's report.
UpdateReport send_quantized_delta(const std::string& address, const MemoryCheckpoint& base,
                                  const MemoryCheckpoint& next) {
  UpdateSender sender(address, sender_options(TransportKind::kTcp, 1 << 20));
  auto scales_of = [&](const MemoryTensor& tensor) -> const MemoryTensor* {
    for (const MemoryTensor& candidate : base.tensors) {
      if (candidate.name == tensor.name + "_scale_inv") return &candidate;
    }
    return nullptr;
  };
  std::vector<DeclaredTensor> manifest;
  for (const MemoryTensor& tensor : next.tensors) {
    const MemoryTensor* scales = scales_of(tensor);
    manifest.push_back({tensor.name, scales ? Dtype::kF8E4M3 : tensor.dtype, tensor.shape});
    if (scales) manifest.push_back({scales->name, scales->dtype, scales->shape});
  }
  sender.start(TensorFormat::kCheckpoint, manifest, {kVersionA, kVersionB});
  for (const MemoryTensor& tensor : next.tensors) {
    if (const MemoryTensor* scales = scales_of(tensor)) {
      sender.send_quantized_changes(base.tensor(tensor.name).view(), scales->view(), tensor.view());
    } else {
      sender.send_changes(base.tensor(tensor.name).view(), tensor.view());
    }
  }
  return sender.finish();
}

TEST(Delta, Bf16WeightsIntoAnFp8ModelAreQuantizedAtTheSenderAndMoveOnlyChangedCodesAndScales) {
  // The FP8 checkpoint is its BF16 weights (seed 5, block-aligned sizes) quantized; B moves 1%
  // of the BF16 elements by their lowest bit, which changes few codes and fewer scales.
  SynthOptions fp8 = testing::synth_options("llama", 5);
  fp8.quantize = SynthOptions::Quantization::kFp8Block;
  SynthOptions bf16 = testing::synth_options("llama", 5);
  bf16.block_aligned = true;
  const MemoryCheckpoint base = testing::synth_in_memory(fp8);
  const MemoryCheckpoint next = stepped_copy(testing::synth_in_memory(bf16), 0.01, 49);
  for (auto [tp_size, tp_rank] : {std::pair<int64_t, int64_t>{1, 0}, {2, 1}}) {
    ModelLayout layout = host_layout(base, tp_size, tp_rank);
    run_load(layout, LoadMode::kCold, {base.views()});
    const auto addresses = storage_addresses(layout);
    UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
    receiver.set_version(kVersionA);
    auto sent = std::async(std::launch::async, [&, address = receiver.address()] {
      return send_quantized_delta(address, base, next);
    });
    UpdateReport report = receiver.receive(10s);
    sent.get();
    // Expected: the FP8 layout loaded from B's BF16 weights, quantized on receipt.
    ModelLayout expected = host_layout(base, tp_size, tp_rank);
    run_load(expected, LoadMode::kCold, {next.views()});
    LayoutComparison comparison = compare_layouts(layout, expected);
    EXPECT_EQ(comparison.mismatched, 0u) << "tp " << tp_size << ": " << ::testing::PrintToString(comparison.mismatches);
    EXPECT_EQ(storage_addresses(layout), addresses);
    EXPECT_GT(report.sparse_tensors, 10u);
    EXPECT_LT(report.bytes, total_bytes(base) / 10);
  }
}

TEST(Delta, QuantizedChangesNeedTheirFp8BaseNamedAndShapedAsTheWeight) {
  SynthOptions fp8 = testing::synth_options("llama", 5);
  fp8.quantize = SynthOptions::Quantization::kFp8Block;
  const MemoryCheckpoint base = testing::synth_in_memory(fp8);
  ModelLayout layout = host_layout(base);
  run_load(layout, LoadMode::kCold, {base.views()});
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  auto receiving = std::async(std::launch::async, [&] { return error_text([&] { receiver.receive(10s); }); });
  UpdateSender sender(receiver.address(), sender_options(TransportKind::kTcp));
  const std::string weight = "model.layers.0.mlp.down_proj.weight";
  const MemoryTensor& codes = base.tensor(weight);
  const MemoryTensor& scales = base.tensor(weight + "_scale_inv");
  sender.start(TensorFormat::kCheckpoint, declared_tensors(std::vector{codes.view(), scales.view()}), {kVersionA, kVersionB});
  std::vector<std::byte> values(codes.bytes.size() * 2);
  TensorView bf16{.name = codes.name, .dtype = Dtype::kBF16, .shape = codes.shape, .data = values.data(),
                  .bytes = values.size()};
  EXPECT_THAT(error_text([&] { sender.send_quantized_changes(scales.view(), codes.view(), bf16); }),
              HasSubstr("update sender: the FP8 base of tensor " + weight + " BF16 " + shape_text(codes.shape) +
                        " must be " + weight + " F8_E4M3 " + shape_text(codes.shape) + " with its scales F32 " +
                        shape_text(scales.shape)));
  // Zeros: nearly every code and every scale changes, so both go whole.
  EXPECT_EQ(sender.send_quantized_changes(codes.view(), scales.view(), bf16), 0u);
  sender.finish();
  EXPECT_EQ(receiving.get(), "no error");
}

TEST(Delta, UpdatesChainFromVersionToVersionOverOneConnection) {
  ModelLayout layout = cold_loaded_layout(version_a());
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kShm));
  receiver.set_version(kVersionA);
  const MemoryCheckpoint version_c = stepped_copy(version_b(), 0.01, 47);
  auto trainer = std::async(std::launch::async, [&, address = receiver.address()] {
    UpdateSender sender(address, sender_options(TransportKind::kShm, 1 << 20));
    for (auto [base, next, versions] : {std::tuple{&version_a(), &version_b(), UpdateVersions{kVersionA, kVersionB}},
                                        std::tuple{&version_b(), &version_c, UpdateVersions{kVersionB, kOtherVersion}}}) {
      sender.start(TensorFormat::kCheckpoint, declared_tensors(next->views()), versions);
      for (const MemoryTensor& tensor : next->tensors) sender.send_changes(base->tensor(tensor.name).view(), tensor.view());
      sender.finish();
    }
  });
  receiver.receive(10s);
  receiver.receive(10s);
  trainer.get();
  EXPECT_EQ(compare_layouts(layout, cold_loaded_layout(version_c)).mismatched, 0u);
  EXPECT_EQ(receiver.version(), kOtherVersion);
}

TEST(Delta, ManyTensorsAreComparedAtOnceOnSeveralThreads) {
  ModelLayout layout = cold_loaded_layout(version_a());
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  auto trainer = std::async(std::launch::async, [address = receiver.address()] {
    SenderOptions options = sender_options(TransportKind::kTcp, 1 << 20);
    options.delta_threads = 3;
    UpdateSender sender(address, options);
    sender.start(TensorFormat::kCheckpoint, declared_tensors(version_b().views()), {kVersionA, kVersionB});
    std::vector<TensorView> bases;
    for (const MemoryTensor& tensor : version_b().tensors) bases.push_back(version_a().tensor(tensor.name).view());
    const uint64_t sparse = sender.send_changes(bases, version_b().views());
    return std::pair{sparse, sender.finish()};
  });
  UpdateReport report = receiver.receive(10s);
  auto [sparse, echoed] = trainer.get();
  EXPECT_EQ(sparse, report.sparse_tensors);
  EXPECT_GT(report.sparse_tensors, version_b().tensors.size() / 2);
  EXPECT_EQ(compare_layouts(layout, cold_loaded_layout(version_b())).mismatched, 0u);
}

TEST(Delta, ABatchWithATensorTwiceOrWithoutItsBasesSendsNothing) {
  ModelLayout layout = cold_loaded_layout(version_a());
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  auto receiving = std::async(std::launch::async, [&] { return error_text([&] { receiver.receive(10s); }); });
  UpdateSender sender(receiver.address(), sender_options(TransportKind::kTcp));
  const MemoryTensor& tensor = version_b().tensor("model.layers.0.mlp.up_proj.weight");
  sender.start(TensorFormat::kCheckpoint, declared_tensors(std::vector{tensor.view()}), {kVersionA, kVersionB});
  const std::vector<TensorView> bases(2, version_a().tensor(tensor.name).view());
  const std::vector<TensorView> twice(2, tensor.view());
  EXPECT_THAT(error_text([&] { sender.send_changes(bases, twice); }),
              HasSubstr("tensor " + tensor.name + " comes twice in one send_changes()"));
  EXPECT_THAT(error_text([&] { sender.send_changes(bases, std::span(twice).first(1)); }),
              HasSubstr("send_changes() of 1 tensors with 2 bases"));
  EXPECT_EQ(sender.send_changes(std::span(bases).first(1), std::span(twice).first(1)), 1u);  // not sent before
  sender.finish();
  EXPECT_EQ(receiving.get(), "no error");
  EXPECT_EQ(compare_layouts(layout, cold_loaded_layout(version_a())).mismatched, 1u);  // its one parameter
}

TEST(Delta, ADeltaForAnotherVersionIsRefusedBeforeItsFirstByte) {
  ModelLayout layout = cold_loaded_layout(version_a());
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kOtherVersion);
  auto sent = send_delta_async(receiver.address(), sender_options(TransportKind::kTcp), version_a(), version_b(),
                               {kVersionA, kVersionB});
  const std::string expected = "the delta update applies to content digest " + kVersionA +
                               " but this receiver holds " + kOtherVersion;
  EXPECT_THAT(error_text([&] { receiver.receive(10s); }), HasSubstr(expected));
  EXPECT_THAT(error_text([&] { sent.get(); }), HasSubstr("refused the update: " + expected));
  EXPECT_EQ(compare_layouts(layout, cold_loaded_layout(version_a())).mismatched, 0u);
  EXPECT_EQ(receiver.version(), kOtherVersion);
}

TEST(Delta, AReceiverOfUnknownVersionRefusesEveryDelta) {
  ModelLayout layout = cold_loaded_layout(version_a());
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kShm));
  auto sent = send_delta_async(receiver.address(), sender_options(TransportKind::kShm), version_a(), version_b(),
                               {kVersionA, kVersionB});
  EXPECT_THAT(error_text([&] { receiver.receive(10s); }),
              HasSubstr("the delta update applies to content digest " + kVersionA +
                        " but this receiver's version is unknown"));
  EXPECT_THAT(error_text([&] { sent.get(); }), HasSubstr("version is unknown"));
  EXPECT_EQ(compare_layouts(layout, cold_loaded_layout(version_a())).mismatched, 0u);
}

TEST(Delta, AFullUpdateSetsTheVersionItNames) {
  ModelLayout layout = cold_loaded_layout(version_a());
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  auto trainer = std::async(std::launch::async, [address = receiver.address()] {
    UpdateSender sender(address, sender_options(TransportKind::kTcp));
    sender.start(TensorFormat::kCheckpoint, declared_tensors(version_b().views()), {.target = kVersionB});
    for (const TensorView& view : version_b().views()) sender.send(view);
    return sender.finish();
  });
  UpdateReport report = receiver.receive(10s);
  trainer.get();
  EXPECT_EQ(receiver.version(), kVersionB);
  EXPECT_EQ(report.sparse_tensors, 0u);
  EXPECT_EQ(report.dense_tensors, version_b().tensors.size());
}

TEST(Delta, TheSenderRefusesChangesOutsideADeltaAndDeltasItCannotSend) {
  ModelLayout layout = cold_loaded_layout(version_a());
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  auto receiving = std::async(std::launch::async, [&] { return error_text([&] { receiver.receive(10s); }); });
  UpdateSender sender(receiver.address(), sender_options(TransportKind::kTcp));
  EXPECT_THAT(error_text([&] { sender.start(TensorFormat::kEngine, {}, {kVersionA, kVersionB}); }),
              HasSubstr("a delta update takes checkpoint-format tensors, not engine format"));
  EXPECT_THAT(error_text([&] { sender.start(TensorFormat::kCheckpoint, {}, {std::string(200, 'a'), kVersionB}); }),
              HasSubstr("a version of 200 bytes, at most 128"));
  const MemoryTensor& tensor = version_b().tensors.front();
  sender.start(TensorFormat::kCheckpoint, declared_tensors(std::vector{tensor.view()}));
  EXPECT_THAT(error_text([&] { sender.send_changes(version_a().tensors.front().view(), tensor.view()); }),
              HasSubstr("send_changes(" + tensor.name + ") outside a delta update"));
  sender.send(tensor.view());
  sender.finish();
  EXPECT_EQ(receiving.get(), "no error");
}

// ---- a delta the receiver cannot decode, sent by hand over TCP ------------------------------

/// One delta update of `tensor` whose bucket carries `payload` as its changed elements,
/// spoken by hand (the sender never sends a bad one). Returns the receiver's error text.
std::string receive_hand_made_delta(UpdateReceiver& receiver, const MemoryTensor& tensor,
                                    std::vector<std::byte> payload,
                                    const UpdateVersions& versions = {kVersionA, kVersionB}) {
  auto receiving = std::async(std::launch::async, [&] { return error_text([&] { receiver.receive(10s); }); });
  transfer::Message accepted;
  transfer::Connection connection = testing::start_hand_made_delta(receiver.address(), tensor, versions, accepted);
  testing::send_hand_made_bucket(connection, tensor, payload);
  return receiving.get();
}

const MemoryTensor& changed_tensor() { return version_b().tensor("model.layers.0.mlp.up_proj.weight"); }

std::vector<std::byte> encoded_change() {
  const MemoryTensor& next = changed_tensor();
  return *transfer::encode_changed_elements(version_a().tensor(next.name).bytes, next.bytes, 2, next.bytes.size());
}

TEST(Delta, ACorruptedDeltaFailsNamingItsTensorWithTheModelUnchanged) {
  ModelLayout layout = cold_loaded_layout(version_a());
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  std::vector<std::byte> payload = encoded_change();
  payload[payload.size() / 2] ^= std::byte{0x40};  // a value flipped in transit
  EXPECT_THAT(receive_hand_made_delta(receiver, changed_tensor(), payload),
              HasSubstr("tensor model.layers.0.mlp.up_proj.weight (bucket 0): its changed elements are corrupted"));
  EXPECT_EQ(compare_layouts(layout, cold_loaded_layout(version_a())).mismatched, 0u);
}

TEST(Delta, ATruncatedDeltaFailsNamingItsTensor) {
  ModelLayout layout = cold_loaded_layout(version_a());
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  std::vector<std::byte> payload = encoded_change();
  payload.resize(payload.size() - 100);
  EXPECT_THAT(receive_hand_made_delta(receiver, changed_tensor(), payload),
              HasSubstr("tensor model.layers.0.mlp.up_proj.weight (bucket 0): its changed elements are truncated or "
                        "overlong"));
  EXPECT_EQ(compare_layouts(layout, cold_loaded_layout(version_a())).mismatched, 0u);
}

TEST(Delta, ChangedElementsInAFullUpdateAreAProtocolError) {
  ModelLayout layout = cold_loaded_layout(version_a());
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  EXPECT_THAT(receive_hand_made_delta(receiver, changed_tensor(), encoded_change(), {.target = kVersionB}),
              HasSubstr("bucket 0 carries changed elements of tensor model.layers.0.mlp.up_proj.weight in a full update"));
  EXPECT_EQ(compare_layouts(layout, cold_loaded_layout(version_a())).mismatched, 0u);
}

TEST(Delta, AModelQuantizedOnLoadRefusesADeltaAtStartNamingTheParameter) {
  // Online FP8 (one scale per parameter, computed after loading) holds no checkpoint values to
  // change in place.
  LayoutOptions options;
  options.quantize = Processing::kFp8PerTensor;
  ModelLayout layout = host_layout(version_a(), 1, 0, options);
  run_load(layout, LoadMode::kCold, {version_a().views()});
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  auto sent = send_delta_async(receiver.address(), sender_options(TransportKind::kTcp), version_a(), version_b(),
                               {kVersionA, kVersionB});
  const std::string text = error_text([&] { receiver.receive(10s); });
  EXPECT_THAT(text, HasSubstr("nothing of it was applied"));
  EXPECT_THAT(text, HasSubstr("arrives as changed elements but parameter model.layers.0.mlp.gate_up_proj.weight"));
  EXPECT_THAT(text, HasSubstr("is processed (quantized) after loading; send it whole"));
  EXPECT_THAT(error_text([&] { sent.get(); }), HasSubstr("refused the update"));
  EXPECT_EQ(receiver.version(), kVersionA);
}

TEST(Delta, AModelHeldInAnotherFloatDtypeTakesTheChangedElementsConverted) {
  // An engine that holds a BF16 checkpoint tensor in F32 (vLLM's DeepSeek-V3 keeps its
  // e_score_correction_bias so) takes its changed elements converted, as a whole tensor is.
  LayoutOptions options;
  options.dtype = Dtype::kF32;
  ModelLayout layout = host_layout(version_a(), 1, 0, options);
  run_load(layout, LoadMode::kCold, {version_a().views()});
  ModelLayout expected = host_layout(version_b(), 1, 0, options);
  run_load(expected, LoadMode::kCold, {version_b().views()});
  ASSERT_GT(compare_layouts(layout, expected).mismatched, 0u);
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kShm));
  receiver.set_version(kVersionA);
  auto sent = send_delta_async(receiver.address(), sender_options(TransportKind::kShm), version_a(), version_b(),
                               {kVersionA, kVersionB});
  UpdateReport report = receiver.receive(10s);
  sent.get();
  EXPECT_GT(report.sparse_tensors, version_b().tensors.size() / 2);
  LayoutComparison comparison = compare_layouts(layout, expected);
  EXPECT_EQ(comparison.mismatched, 0u) << ::testing::PrintToString(comparison.mismatches);
  EXPECT_EQ(receiver.version(), kVersionB);
}

TEST(Delta, TheSenderRefusesABaseOfAnotherShapeOrOnAGpu) {
  ModelLayout layout = cold_loaded_layout(version_a());
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  auto receiving = std::async(std::launch::async, [&] { return error_text([&] { receiver.receive(10s); }); });
  UpdateSender sender(receiver.address(), sender_options(TransportKind::kTcp));
  const MemoryTensor& tensor = changed_tensor();
  sender.start(TensorFormat::kCheckpoint, declared_tensors(std::vector{tensor.view()}), {kVersionA, kVersionB});
  const MemoryTensor& other = version_a().tensor("model.norm.weight");
  EXPECT_THAT(error_text([&] { sender.send_changes(other.view(), tensor.view()); }),
              HasSubstr("tensor " + tensor.name + " is BF16 " + shape_text(tensor.shape) + " but its base is BF16 " +
                        shape_text(other.shape)));
  TensorView on_gpu = version_a().tensor(tensor.name).view();
  on_gpu.device = Device{Device::Kind::kCuda, 0};
  EXPECT_THAT(error_text([&] { sender.send_changes(on_gpu, tensor.view()); }),
              HasSubstr("changed elements of tensor " + tensor.name + " are computed from host memory (cuda:0 and cpu given)"));
  EXPECT_TRUE(sender.send_changes(version_a().tensor(tensor.name).view(), tensor.view()));
  EXPECT_THAT(error_text([&] { sender.send_changes(version_a().tensor(tensor.name).view(), tensor.view()); }),
              HasSubstr("was sent whole already"));
  sender.finish();
  EXPECT_EQ(receiving.get(), "no error");
}

// ---- the encoding on its own ----------------------------------------------------------------

std::vector<std::byte> bytes_of_values(std::initializer_list<uint16_t> values) {
  std::vector<std::byte> bytes(values.size() * 2);
  std::memcpy(bytes.data(), std::data(values), bytes.size());
  return bytes;
}

TEST(ChangedElements, RoundTripTheChangedPositionsAndValues) {
  std::vector<std::byte> base = bytes_of_values({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  std::vector<std::byte> next = bytes_of_values({1, 20, 3, 4, 5, 6, 7, 8, 9, 10, 11, 120});
  auto encoded = transfer::encode_changed_elements(base, next, 2, 1000);
  ASSERT_TRUE(encoded.has_value());
  // Two counts, the positions 1 and 11 (gap 9 after the first), two values, the checksum.
  EXPECT_EQ(encoded->size(), 24u + 2 + 4);
  ChangedElements changes = transfer::decode_changed_elements(*encoded, 2, 12, "tensor t (bucket 0)");
  EXPECT_EQ(changes.indices, (std::vector<uint64_t>{1, 11}));
  EXPECT_EQ(changes.values, bytes_of_values({20, 120}));
  EXPECT_TRUE(transfer::decode_changed_elements(*transfer::encode_changed_elements(base, base, 2, 100), 2, 12, "t")
                  .indices.empty());
}

TEST(ChangedElements, RangesOnSeveralThreadsEncodeTheSameBytes) {
  // 32 MiB of BF16 with changes scattered, some at the ranges' edges, and an unchanged stretch.
  std::vector<uint16_t> base(16 << 20), next;
  std::mt19937_64 random(46);
  for (uint16_t& value : base) value = static_cast<uint16_t>(random());
  next = base;
  for (int i = 0; i < 20000; ++i) next[random() % (next.size() / 2)] ^= 1;
  for (uint64_t edge = 0; edge < next.size(); edge += next.size() / 16) next[edge] ^= 2, next[edge + 1] ^= 2;
  const auto bytes = [](const std::vector<uint16_t>& values) {
    return std::span(reinterpret_cast<const std::byte*>(values.data()), values.size() * 2);
  };
  auto one = transfer::encode_changed_elements(bytes(base), bytes(next), 2, 1 << 20, 1);
  auto several = transfer::encode_changed_elements(bytes(base), bytes(next), 2, 1 << 20, 4);
  ASSERT_TRUE(one.has_value() && several.has_value());
  EXPECT_EQ(*one, *several);
  ChangedElements changes = transfer::decode_changed_elements(*several, 2, next.size(), "t");
  for (size_t i = 0; i < changes.indices.size(); ++i) {
    uint16_t value;
    std::memcpy(&value, changes.values.data() + 2 * i, 2);
    ASSERT_EQ(value, next[changes.indices[i]]);
    ASSERT_NE(value, base[changes.indices[i]]);
  }
  // Past the limit on any thread: not encoded.
  EXPECT_FALSE(transfer::encode_changed_elements(bytes(base), bytes(next), 2, 50'000, 4).has_value());
}

TEST(ChangedElements, TooManyChangesAreNotEncoded) {
  std::vector<std::byte> base(4096), next(4096, std::byte{1});
  EXPECT_FALSE(transfer::encode_changed_elements(base, next, 2, 1024).has_value());
  EXPECT_FALSE(transfer::encode_changed_elements(base, base, 2, 16).has_value());  // not even the counts fit
}

TEST(ChangedElements, BadEncodingsAreRefusedNamingTheTensor) {
  std::vector<std::byte> base = bytes_of_values({1, 2, 3, 4});
  std::vector<std::byte> next = bytes_of_values({1, 2, 3, 40});
  std::vector<std::byte> encoded = *transfer::encode_changed_elements(base, next, 2, 1000);
  auto decoding = [](std::vector<std::byte> bytes, uint64_t elements) {
    return error_text([&] { transfer::decode_changed_elements(bytes, 2, elements, "tensor t (bucket 3)"); });
  };
  EXPECT_THAT(decoding({encoded.begin(), encoded.begin() + 10}, 4),
              HasSubstr("tensor t (bucket 3): its changed elements are truncated: 10 bytes"));
  EXPECT_THAT(decoding({encoded.begin(), encoded.end() - 1}, 4), HasSubstr("truncated or overlong"));
  std::vector<std::byte> corrupted = encoded;
  corrupted[16] ^= std::byte{1};
  EXPECT_THAT(decoding(corrupted, 4), HasSubstr("tensor t (bucket 3): its changed elements are corrupted"));
  // A well-formed encoding of element 3 for a tensor of 3 elements.
  EXPECT_THAT(decoding(encoded, 3), HasSubstr("tensor t (bucket 3): changed element 0 lies past the tensor's 3 elements"));
}

TEST(ChangedElements, TheSessionRefusesChangesItCannotPlace) {
  ModelLayout layout = cold_loaded_layout(version_a());
  LoadSession session(layout);
  session.begin(LoadMode::kUpdate);
  const MemoryTensor& tensor = changed_tensor();
  auto changes = std::make_shared<ChangedElements>();
  changes->indices = {5, 3};
  changes->values.resize(4);
  TensorView view{.name = tensor.name, .dtype = tensor.dtype, .shape = tensor.shape, .bytes = tensor.bytes.size()};
  view.changes = changes;
  EXPECT_THAT(error_text([&] { session.check(std::span(&view, 1)); }),
              HasSubstr("tensor " + tensor.name + ": changed element 1 is at index 3, not after the one before it"));
  changes->indices = {3};
  changes->values.resize(2);
  view.bytes = 64;
  EXPECT_THAT(error_text([&] { session.check(std::span(&view, 1)); }),
              HasSubstr("changed elements stand for the whole tensor"));
  const std::vector<int64_t> packed_shape = {64};
  TensorView packed{.name = "packed.weight", .dtype = Dtype::kF4, .shape = packed_shape, .bytes = 32};
  packed.changes = std::make_shared<ChangedElements>();
  EXPECT_THAT(error_text([&] { session.check(std::span(&packed, 1)); }),
              HasSubstr("tensor packed.weight: changed elements are whole-byte elements, and F4 packs several in a byte"));
}

}  // namespace
}  // namespace weightstream
