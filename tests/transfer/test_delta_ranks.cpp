// Delta updates in the engine's layout (issue 46, docs/DELTA.md): each receiver lists the
// windows of every tensor it holds, the sender compares and sends only the changed elements
// inside them (a tensor-parallel rank receives about its share), and after the delta the
// receiver checks what it holds against the sender's digests of the target, naming each tensor
// that differs (a base silently modified, a sender whose base is not the version it names).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <random>

#include "model/model_fixtures.hpp"
#include "update/delta.hpp"
#include "transfer/delta_fixtures.hpp"
#include "net/handshake.hpp"
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

// Held by gate_up_proj's part 1; its first rows are rank 0's at tp 2.
const std::string kUpProjection = "model.layers.0.mlp.up_proj.weight";

const MemoryCheckpoint& version_a() { return cached_checkpoint("llama", 1); }

const MemoryCheckpoint& version_b() {
  static const MemoryCheckpoint next = testing::changed_copy(version_a(), 0.01, 146);
  return next;
}

/// One delta base -> next into the receiver at each of `addresses` (one sender feeding them all);
/// the sender's report, or its error.
std::future<UpdateReport> send_delta_async(std::vector<std::string> addresses, TransportKind transport,
                                           const MemoryCheckpoint& base, const MemoryCheckpoint& next) {
  return std::async(std::launch::async, [=, &base, &next] {
    UpdateSender sender(addresses, sender_options(transport, 1 << 20));
    sender.start(TensorFormat::kCheckpoint, declared_tensors(next.views()), {kVersionA, kVersionB});
    for (const MemoryTensor& tensor : next.tensors) sender.send_changes(base.tensor(tensor.name).view(), tensor.view());
    return sender.finish();
  });
}

/// The receiver's report of the delta base -> next into `layout` (holding version A) over tcp.
UpdateReport delta_into(ModelLayout& layout, const MemoryCheckpoint& base, const MemoryCheckpoint& next) {
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  auto sent = send_delta_async({receiver.address()}, TransportKind::kTcp, base, next);
  UpdateReport report = receiver.receive(10s);
  sent.get();
  EXPECT_EQ(receiver.version(), kVersionB);
  return report;
}

TEST(DeltaRanks, EachTensorParallelRankReceivesAboutItsShareAndChecksIt) {
  ModelLayout whole = cold_loaded_layout(version_a());
  const uint64_t whole_bytes = delta_into(whole, version_a(), version_b()).bytes;
  uint64_t ranks_bytes = 0;
  for (int64_t rank : {0, 1}) {
    ModelLayout layout = cold_loaded_layout(version_a(), 2, rank);
    const auto addresses = storage_addresses(layout);
    UpdateReport report = delta_into(layout, version_a(), version_b());
    LayoutComparison comparison = compare_layouts(layout, cold_loaded_layout(version_b(), 2, rank));
    EXPECT_EQ(comparison.mismatched, 0u) << "rank " << rank << ": " << ::testing::PrintToString(comparison.mismatches);
    EXPECT_EQ(storage_addresses(layout), addresses);
    // Every tensor is split or replicated: a rank's delta is about half of the whole one.
    EXPECT_LT(report.bytes, whole_bytes * 6 / 10) << "rank " << rank;
    EXPECT_GT(report.bytes, whole_bytes * 4 / 10) << "rank " << rank;
    EXPECT_EQ(report.checked_tensors, report.sparse_tensors);
    EXPECT_GT(report.checked_tensors, version_b().tensors.size() / 2);
    ranks_bytes += report.bytes;
  }
  EXPECT_GE(ranks_bytes, whole_bytes * 9 / 10);
}

TEST(DeltaRanks, AnExpertParallelRankReceivesNothingOfAnotherRanksExperts) {
  SynthOptions synth = testing::synth_options("qwen3_moe", 1);
  const MemoryCheckpoint base = testing::synth_in_memory(synth);
  const MemoryCheckpoint next = testing::changed_copy(base, 0.01, 148);
  auto loaded = [&](const MemoryCheckpoint& checkpoint, int64_t tp_size, int64_t ep_size) {
    LayoutOptions options;
    options.parallel.ep_size = ep_size;
    options.parallel.ep_rank = ep_size - 1;
    ModelLayout layout = host_layout(checkpoint, tp_size, tp_size - 1, options);
    run_load(layout, LoadMode::kCold, {checkpoint.views()});
    return layout;
  };
  ModelLayout whole = loaded(base, 1, 1);
  const uint64_t whole_bytes = delta_into(whole, base, next).bytes;
  ModelLayout rank = loaded(base, 2, 2);
  UpdateReport report = delta_into(rank, base, next);
  EXPECT_EQ(compare_layouts(rank, loaded(next, 2, 2)).mismatched, 0u);
  EXPECT_LT(report.bytes, whole_bytes * 6 / 10);
}

TEST(DeltaRanks, OneSenderFeedingBothRanksSendsTheElementsEitherHolds) {
  ModelLayout rank0 = cold_loaded_layout(version_a(), 2, 0);
  ModelLayout rank1 = cold_loaded_layout(version_a(), 2, 1);
  UpdateReceiver receiver0(rank0, receiver_options(TransportKind::kTcp));
  UpdateReceiver receiver1(rank1, receiver_options(TransportKind::kTcp));
  receiver0.set_version(kVersionA);
  receiver1.set_version(kVersionA);
  auto sent = send_delta_async({receiver0.address(), receiver1.address()}, TransportKind::kTcp, version_a(), version_b());
  auto other = std::async(std::launch::async, [&] { return receiver1.receive(10s); });
  UpdateReport report0 = receiver0.receive(10s);
  UpdateReport report1 = other.get();
  sent.get();
  EXPECT_EQ(compare_layouts(rank0, cold_loaded_layout(version_b(), 2, 0)).mismatched, 0u);
  EXPECT_EQ(compare_layouts(rank1, cold_loaded_layout(version_b(), 2, 1)).mismatched, 0u);
  EXPECT_EQ(report0.bytes, report1.bytes);  // one stream of the union
  EXPECT_EQ(report0.checked_tensors, report0.sparse_tensors);
  EXPECT_EQ(report1.checked_tensors, report1.sparse_tensors);
}

// ---- the check after a delta ---------------------------------------------------------------

/// The byte of `layout`'s parameter that holds element `index` of tensor `tensor` (tp 1: every
/// part holds whole rows of its tensor).
std::byte* held_element(ModelLayout& layout, const std::string& tensor, uint64_t index) {
  const auto [parameter, part] = layout.route(tensor).targets.at(0);
  Parameter& held = layout.mutable_parameter(parameter);
  return held.data + (held.parts[part].element_offset + index) * (dtype_bits(held.dtype) / 8);
}

/// An element of `tensor` that B leaves as A has it.
uint64_t unchanged_element(const std::string& tensor) {
  const MemoryTensor& a = version_a().tensor(tensor);
  const MemoryTensor& b = version_b().tensor(tensor);
  for (uint64_t index = 0;; ++index) {
    if (std::memcmp(a.bytes.data() + 2 * index, b.bytes.data() + 2 * index, 2) == 0) return index;
  }
}

TEST(DeltaCheck, AReceiverWhoseBaseWasSilentlyModifiedFailsNamingTheParameter) {
  ModelLayout layout = cold_loaded_layout(version_a());
  *held_element(layout, kUpProjection, unchanged_element(kUpProjection)) ^= std::byte{4};
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kShm));
  receiver.set_version(kVersionA);
  auto sent = send_delta_async({receiver.address()}, TransportKind::kShm, version_a(), version_b());
  const std::string text = error_text([&] { receiver.receive(10s); });
  EXPECT_THAT(text, HasSubstr("model: update from"));
  EXPECT_THAT(text, HasSubstr("failed after it landed: the delta landed"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("keeps its old values")));
  EXPECT_THAT(text, HasSubstr("the delta landed, but what llama tp 1 rank 0 now holds differs from the version the "
                              "sender named (" + kVersionB + ") in 1 of "));
  EXPECT_THAT(text, HasSubstr("tensor " + kUpProjection + " in model.layers.0.mlp.gate_up_proj.weight[1] (its "
                              "elements here hash to "));
  EXPECT_THAT(text, HasSubstr("this receiver's version is now unknown: send a full update"));
  EXPECT_THAT(error_text([&] { sent.get(); }), HasSubstr("failed the update: the delta landed, but what"));
  EXPECT_EQ(receiver.version(), "");
  // Every other parameter holds B: the check names what differs, nothing else.
  LayoutComparison comparison = compare_layouts(layout, cold_loaded_layout(version_b()));
  EXPECT_EQ(comparison.mismatches, std::vector<std::string>{"model.layers.0.mlp.gate_up_proj.weight"});
}

TEST(DeltaCheck, ASenderWhoseBaseIsNotTheVersionItNamesIsCaughtByName) {
  // The trainer's idea of A already has B's values in one tensor: it sends no change of it.
  MemoryCheckpoint drifted = version_a();
  for (MemoryTensor& tensor : drifted.tensors) {
    if (tensor.name == kUpProjection) tensor.bytes = version_b().tensor(kUpProjection).bytes;
  }
  ModelLayout layout = cold_loaded_layout(version_a(), 2, 1);
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  auto sent = send_delta_async({receiver.address()}, TransportKind::kTcp, drifted, version_b());
  EXPECT_THAT(error_text([&] { receiver.receive(10s); }),
              HasSubstr("tensor " + kUpProjection + " in model.layers.0.mlp.gate_up_proj.weight[1]"));
  EXPECT_THAT(error_text([&] { sent.get(); }), HasSubstr("differs from the version the sender named"));
  EXPECT_EQ(receiver.version(), "");
}

/// A delta of kUpProjection A -> B spoken by hand, its FINISH carrying `digests`. Returns the
/// receiver's error text; `held` gets the windows its ACCEPTED listed.
std::string hand_made_delta(UpdateReceiver& receiver, std::vector<std::pair<uint32_t, uint64_t>> digests,
                            std::vector<std::vector<transfer::HeldWindow>>& held) {
  auto receiving = std::async(std::launch::async, [&] { return error_text([&] { receiver.receive(10s); }); });
  using namespace transfer;
  const auto timeout = std::chrono::milliseconds(10'000);
  const MemoryTensor& tensor = version_b().tensor(kUpProjection);
  Message accepted;
  Connection connection = testing::start_hand_made_delta(receiver.address(), tensor, {kVersionA, kVersionB}, accepted);
  held = accepted.held;
  testing::send_hand_made_bucket(
      connection, tensor,
      *encode_changed_elements(version_a().tensor(kUpProjection).bytes, tensor.bytes, 2, tensor.bytes.size()));
  EXPECT_EQ(receive_message(connection, timeout, "APPLIED").message.type, MessageType::kApplied);
  Message finish;
  finish.type = MessageType::kFinish;
  finish.buckets = 1;
  finish.digests = std::move(digests);
  send_message(connection, finish, timeout);
  return receiving.get();
}

TEST(DeltaCheck, ADigestOfAnotherTargetFailsTheUpdateNamingTheTensor) {
  ModelLayout layout = cold_loaded_layout(version_a(), 2, 0);
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  std::vector<std::vector<transfer::HeldWindow>> held;
  EXPECT_THAT(hand_made_delta(receiver, {{0, 0x1234}}, held),
              HasSubstr("tensor " + kUpProjection + " in model.layers.0.mlp.gate_up_proj.weight[1] (its elements here "
                        "hash to "));
  EXPECT_EQ(receiver.version(), "");
  // Rank 0 of 2 holds the first half of up_proj's rows, whole.
  const MemoryTensor& tensor = version_a().tensor(kUpProjection);
  const auto rows = static_cast<uint64_t>(tensor.shape[0]), columns = static_cast<uint64_t>(tensor.shape[1]);
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0], (std::vector<transfer::HeldWindow>{{0, rows / 2, 0, columns}}));
}

TEST(DeltaCheck, AFinishWithoutTheDigestOfAChangedTensorOrPastTheManifestIsAProtocolError) {
  ModelLayout layout = cold_loaded_layout(version_a());
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  receiver.set_version(kVersionA);
  std::vector<std::vector<transfer::HeldWindow>> held;
  EXPECT_THAT(hand_made_delta(receiver, {}, held),
              HasSubstr("FINISH carries no digest of tensor " + kUpProjection + ", which arrived as changed elements"));
  receiver.set_version(kVersionA);
  EXPECT_THAT(hand_made_delta(receiver, {{3, 0}}, held), HasSubstr("FINISH carries a digest of tensor 3, past the "
                                                                   "manifest's 1 tensors"));
}

/// A receiver spoken by hand over tcp: it welcomes one sender and answers the START of a delta
/// of `tensor` with `held` as its windows. Returns the error text of the sender's start().
std::string start_against_windows(const MemoryTensor& tensor, std::vector<std::vector<transfer::HeldWindow>> held) {
  using namespace transfer;
  const auto timeout = std::chrono::milliseconds(10'000);
  Listener listener = Listener::tcp("127.0.0.1:0");
  auto receiver = std::async(std::launch::async, [&] {
    Connection connection = listener.accept(timeout);
    const ListenerAuth auth = listener_auth("shared-secret", false, "hand-made receiver");
    ServerHandshake(kUpdateHandshake, auth).run(connection, timeout);
    Message welcome;
    welcome.type = MessageType::kWelcome;
    welcome.bucket_bytes = receive_message(connection, timeout, "HELLO").message.bucket_bytes;
    welcome.slots = 2;
    send_message(connection, welcome, timeout);
    receive_message(connection, timeout, "START");
    Message accepted;
    accepted.type = MessageType::kAccepted;
    accepted.held = std::move(held);
    send_message(connection, accepted, timeout);
    error_text([&] { receive_message(connection, timeout, "the sender's hang-up"); });
  });
  std::string text;
  {
    UpdateSender sender(listener.address(), sender_options(TransportKind::kTcp, 1 << 20));
    text = error_text([&] {
      sender.start(TensorFormat::kCheckpoint, declared_tensors(std::vector{tensor.view()}), {kVersionA, kVersionB});
    });
  }
  receiver.get();
  return text;
}

TEST(DeltaRanks, ASenderRefusesWindowsThatDoNotFitTheManifest) {
  const MemoryTensor& tensor = version_a().tensor(kUpProjection);
  const std::string shape = std::to_string(tensor.shape[0]) + " x " + std::to_string(tensor.shape[1]);
  const auto rows = static_cast<uint64_t>(tensor.shape[0]);
  const std::string none = start_against_windows(tensor, {});
  EXPECT_THAT(none, HasSubstr("protocol: update receiver at 127.0.0.1:"));
  EXPECT_THAT(none, HasSubstr("accepted a delta of 1 tensors with windows of 0"));
  EXPECT_THAT(start_against_windows(tensor, {{{rows - 1, 2, 0, 1}}}),
              HasSubstr("holds rows " + std::to_string(rows - 1) + "+2, columns 0+1 of tensor " + kUpProjection +
                        ", which has " + shape));
}

// ---- the windows on their own ----------------------------------------------------------------

TEST(HeldWindows, RunsJoinAdjacentRowsAndCountSharedElementsOnce) {
  using transfer::TensorWindows;
  auto runs = [](const TensorWindows& windows) {
    std::vector<std::pair<uint64_t, uint64_t>> found;
    windows.for_each_range([&](uint64_t begin, uint64_t end) { found.emplace_back(begin, end); });
    return found;
  };
  using Runs = std::vector<std::pair<uint64_t, uint64_t>>;
  EXPECT_EQ(runs(TensorWindows{.rows = 4, .columns = 8}), (Runs{{0, 32}}));
  // Rows 1-2 whole: one run.
  EXPECT_EQ(runs(TensorWindows{.rows = 4, .columns = 8, .windows = {{1, 2, 0, 8}}, .whole = false}), (Runs{{8, 24}}));
  // Columns 4-7 of every row, and columns 2-5 of row 0: overlapping windows, each element once.
  TensorWindows columns{.rows = 3, .columns = 8, .windows = {{0, 3, 4, 4}, {0, 1, 2, 4}}, .whole = false};
  EXPECT_EQ(runs(columns), (Runs{{2, 8}, {12, 16}, {20, 24}}));
  EXPECT_EQ(columns.elements(), 14u);
  // Columns 4-7 then 0-3 of the next row meet: one run.
  EXPECT_EQ(runs(TensorWindows{.rows = 2, .columns = 8, .windows = {{0, 1, 4, 4}, {1, 1, 0, 4}}, .whole = false}),
            (Runs{{4, 12}}));
  EXPECT_TRUE(runs(TensorWindows{.rows = 2, .columns = 8, .windows = {}, .whole = false}).empty());
}

TEST(HeldWindows, OnlyChangesInsideTheWindowsAreEncoded) {
  std::vector<std::byte> base(64), next(64);
  for (size_t i = 0; i < 32; ++i) next[2 * i] = std::byte{1};  // every element of a 4 x 8 tensor
  transfer::TensorWindows held{.rows = 4, .columns = 8, .windows = {{1, 2, 6, 2}}, .whole = false};
  auto encoded = transfer::encode_changed_elements(base, next, 2, 1000, 1, &held);
  ASSERT_TRUE(encoded.has_value());
  EXPECT_EQ(transfer::decode_changed_elements(*encoded, 2, 32, "t").indices, (std::vector<uint64_t>{14, 15, 22, 23}));
  EXPECT_EQ(transfer::windows_digest(next, 2, 8, held.windows), transfer::windows_digest(next, 2, 8, held.windows));
  EXPECT_NE(transfer::windows_digest(next, 2, 8, held.windows), transfer::windows_digest(base, 2, 8, held.windows));
  EXPECT_THAT(error_text([&] { transfer::windows_digest(next, 2, 8, std::vector<transfer::HeldWindow>{{3, 2, 0, 8}}); }),
              HasSubstr("a held window of rows 3+2, columns 0+8 lies outside a tensor of 4 x 8"));
}

TEST(HeldWindows, EachChangedElementIsFoundWhicheverOfItsBytesChanged) {
  // 1000 elements of each size, one byte changed in some of them (the first, the last and
  // every byte place in between), and the last partial block too.
  for (uint64_t element : {1, 2, 4, 8}) {
    std::vector<std::byte> base(1000 * element), next;
    std::mt19937_64 random(element);
    for (std::byte& value : base) value = static_cast<std::byte>(random());
    next = base;
    std::vector<uint64_t> expected;
    for (uint64_t index = 0; index < 1000; index += 7 + index % 5) {
      next[index * element + index % element] ^= std::byte{0x80};
      expected.push_back(index);
    }
    next[999 * element] ^= std::byte{1};
    expected.push_back(999);
    auto encoded = transfer::encode_changed_elements(base, next, element, base.size());
    ASSERT_TRUE(encoded.has_value());
    EXPECT_EQ(transfer::decode_changed_elements(*encoded, element, 1000, "t").indices, expected) << element << " bytes";
  }
}

}  // namespace
}  // namespace weightstream
