#pragma once
// Shared by the delta update tests (test_delta.cpp, test_delta_ranks.cpp): the versions they
// name, a checkpoint after one step, and a delta spoken by hand over TCP (the sender never
// sends a bad one).
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "model/model_fixtures.hpp"
#include "net/handshake.hpp"
#include "net/socket.hpp"
#include "update/wire.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream::testing {

// Versions are opaque to the transfer layer: content digests in real use.
inline const std::string kVersionA = "a0a0a0a0a0a0a0a0";
inline const std::string kVersionB = "b1b1b1b1b1b1b1b1";

/// `base` with `fraction` of each tensor's elements changed (one bit of each flipped, at
/// indices drawn from `seed`), and every element of `rewritten` (when named).
inline MemoryCheckpoint changed_copy(const MemoryCheckpoint& base, double fraction, uint64_t seed,
                                     const std::string& rewritten = {}) {
  MemoryCheckpoint next = base;
  std::mt19937_64 random(seed);
  for (MemoryTensor& tensor : next.tensors) {
    const uint64_t element = dtype_bits(tensor.dtype) / 8;
    const uint64_t elements = tensor.bytes.size() / element;
    const bool all = tensor.name == rewritten;
    const auto changes = all ? elements : static_cast<uint64_t>(static_cast<double>(elements) * fraction);
    for (uint64_t i = 0; i < changes; ++i) {
      const uint64_t index = all ? i : random() % elements;
      tensor.bytes[index * element] ^= std::byte{1};
    }
  }
  return next;
}

/// A delta update of `tensor` spoken by hand over TCP to the receiver at `address` (token
/// "shared-secret"), up to its receiver's ACCEPTED (or ERROR), kept in `accepted`.
inline transfer::Connection start_hand_made_delta(const std::string& address, const MemoryTensor& tensor,
                                                  const UpdateVersions& versions, transfer::Message& accepted) {
  using namespace transfer;
  const auto timeout = std::chrono::milliseconds(10'000);
  Connection connection = connect_to(address, timeout, "receiver");
  prove_to_server(connection, kUpdateHandshake, "shared-secret", timeout, "receiver");
  Message hello;
  hello.type = MessageType::kHello;
  hello.transport = TransportKind::kTcp;
  hello.bucket_bytes = 1 << 20;
  send_message(connection, hello, timeout);
  EXPECT_EQ(receive_message(connection, timeout, "WELCOME").message.type, MessageType::kWelcome);
  Message start;
  start.type = MessageType::kStart;
  start.versions = versions;
  start.declared = declared_tensors(std::vector{tensor.view()});
  send_message(connection, start, timeout);
  accepted = receive_message(connection, timeout, "ACCEPTED").message;
  EXPECT_EQ(accepted.type, MessageType::kAccepted);
  return connection;
}

/// Sends bucket 0 of a hand-made delta: `tensor` as the changed elements `payload`.
inline void send_hand_made_bucket(transfer::Connection& connection, const MemoryTensor& tensor,
                                  const std::vector<std::byte>& payload) {
  using namespace transfer;
  const auto timeout = std::chrono::milliseconds(10'000);
  Message bucket;
  bucket.type = MessageType::kBucket;
  bucket.manifest.bytes = payload.size();
  BucketEntry& entry = bucket.manifest.entries.emplace_back();
  entry.name = tensor.name;
  entry.dtype = tensor.dtype;
  entry.shape = tensor.shape;
  entry.bytes = payload.size();
  entry.encoding = EntryEncoding::kChangedElements;
  send_message(connection, bucket, timeout);
  connection.send_bytes(payload, timeout, "payload");
}

}  // namespace weightstream::testing
