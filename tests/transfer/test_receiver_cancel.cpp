// UpdateReceiver::cancel (issue 33): an engine shutting down, or a supervisor whose sender
// process died, stops a receive() in another thread at once: waiting for a sender (also with
// idle peers connected), waiting for the next update, or in the middle of one. Each case
// waits far longer than the test if the cancel did not reach it (the accept timeout, or the
// 10 s update timeout), which would then be the error seen instead of "cancelled".
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

#include "model/model_fixtures.hpp"
#include "support/test_support.hpp"
#include "net/socket.hpp"
#include "transfer/transfer_fixtures.hpp"
#include "weightstream/error.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using testing::cached_checkpoint;
using testing::cold_loaded_layout;
using testing::error_text;
using testing::receiver_options;
using namespace std::chrono_literals;

const testing::MemoryCheckpoint& checkpoint_of(uint64_t seed) { return cached_checkpoint("llama", seed); }

SenderOptions sender_options(TransportKind kind) {
  SenderOptions options;
  options.transport = kind;
  options.token = "shared-secret";
  options.bucket_bytes = 64 << 10;
  options.timeout = 10s;
  return options;
}

/// Runs receiver.receive(accept_timeout) in a thread; the future holds its error text.
std::future<std::string> receive_async(UpdateReceiver& receiver, std::chrono::milliseconds accept_timeout) {
  return std::async(std::launch::async, [&receiver, accept_timeout] {
    return error_text([&] { receiver.receive(accept_timeout); });
  });
}

TEST(ReceiverCancel, StopsTheWaitForASenderWithIdlePeersConnected) {
  for (TransportKind kind : {TransportKind::kTcp, TransportKind::kShm}) {
    SCOPED_TRACE(std::string(transport_name(kind)));
    ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
    UpdateReceiver receiver(layout, receiver_options(kind));
    std::vector<transfer::Connection> idle;
    for (int i = 0; i < 20; ++i) idle.push_back(transfer::connect_to(receiver.address(), 2s));
    auto waiting = receive_async(receiver, 10min);
    receiver.cancel();
    std::string text = waiting.get();
    EXPECT_THAT(text, StartsWith("cancelled: update receiver at " + receiver.address()));
    EXPECT_THAT(text, HasSubstr("cancelled while waiting for a sender to connect"));
    // Cancelled for good: the next call says so at once.
    EXPECT_THAT(error_text([&] { receiver.receive(10min); }), StartsWith("cancelled: "));
  }
}

TEST(ReceiverCancel, StopsTheWaitForTheNextUpdateOfAConnectedSender) {
  ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  auto first = std::async(std::launch::async, [&] { return receiver.receive(1min); });
  UpdateSender sender(receiver.address(), sender_options(TransportKind::kTcp));  // answered by that receive()
  sender.start(TensorFormat::kCheckpoint, declared_tensors(checkpoint_of(2).views()));
  for (const TensorView& view : checkpoint_of(2).views()) sender.send(view);
  sender.finish();
  EXPECT_EQ(first.get().tensors, checkpoint_of(2).tensors.size());
  // The trainer computes its next weights: the receiver waits for START, as long as asked.
  auto waiting = receive_async(receiver, 10min);
  receiver.cancel();
  EXPECT_THAT(waiting.get(), AllOf(StartsWith("cancelled: "), HasSubstr("cancelled while waiting for")));
}

TEST(ReceiverCancel, StopsAnUpdateUnderWayAndKeepsLayersNotCompleted) {
  ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
  ModelLayout before = cold_loaded_layout(checkpoint_of(1));
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  auto receiving = receive_async(receiver, 1min);
  UpdateSender sender(receiver.address(), sender_options(TransportKind::kTcp));  // answered by that receive()
  sender.start(TensorFormat::kCheckpoint, declared_tensors(checkpoint_of(2).views()));
  // One tensor, then silence: a sender stuck mid-update (the update timeout is 10 s).
  sender.send(checkpoint_of(2).views().front());
  sender.flush();
  receiver.cancel();
  std::string text = receiving.get();
  EXPECT_THAT(text, StartsWith("cancelled: "));
  EXPECT_THAT(text, ::testing::AnyOf(HasSubstr("cancelled while waiting for"),
                                     HasSubstr("cancelled (the receiver was cancelled, which shut the connection down)")));
  // No layer was complete: the layout is as the cold load left it.
  EXPECT_EQ(compare_layouts(layout, before).mismatched, 0u);
}

}  // namespace
}  // namespace weightstream
