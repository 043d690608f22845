// The update protocol's wire format: every message round-trips, and hostile frames (bad
// magic, version or type, lengths past the end or over the limits, entries outside their
// tensor or bucket) are Error(kProtocol) naming the peer, the message and the field.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>

#include "net/frame.hpp"
#include "peer/peer_protocol.hpp"
#include "update/wire.hpp"

namespace weightstream::transfer {
namespace {

using ::testing::HasSubstr;

std::string error_text(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kProtocol) << error.what();
    return error.what();
  }
  return "no error";
}

Message bucket_message() {
  Message message;
  message.type = MessageType::kBucket;
  message.manifest.index = 7;
  message.manifest.slot = 1;
  message.manifest.bytes = 8448;
  message.manifest.entries.push_back({"model.layers.0.mlp.down_proj.weight", Dtype::kBF16, {64, 64}, 0, 0, 0, 8192});
  message.manifest.entries.push_back({"model.norm.weight", Dtype::kF32, {64}, 0, 0, 8192, 256});
  return message;
}

/// A bucket with two regions shared for the first time and an entry read from region 4.
Message shared_bucket_message() {
  Message message = bucket_message();
  message.manifest.regions.push_back({3, 1 << 30, std::vector<std::byte>(64, std::byte{0xab})});
  message.manifest.regions.push_back({4, 1 << 20, std::vector<std::byte>(64, std::byte{0xcd})});
  message.manifest.entries.push_back({"model.embed_tokens.weight", Dtype::kBF16, {128, 64}, 0, 5, 4096, 16384});
  return message;
}

TEST(Wire, BucketRoundTrips) {
  Message message = bucket_message();
  std::vector<std::byte> body = encode_body(message);
  Message parsed = parse_body(MessageType::kBucket, body, "peer");
  EXPECT_EQ(parsed.manifest.index, 7u);
  EXPECT_EQ(parsed.manifest.slot, 1u);
  ASSERT_EQ(parsed.manifest.entries.size(), 2u);
  EXPECT_EQ(parsed.manifest.entries[1].name, "model.norm.weight");
  EXPECT_EQ(parsed.manifest.entries[1].dtype, Dtype::kF32);
  EXPECT_EQ(parsed.manifest.entries[1].source, 0u);
  EXPECT_EQ(parsed.manifest.entries[1].source_offset, 8192u);
  EXPECT_TRUE(parsed.manifest.regions.empty());
  EXPECT_EQ(encode_body(parsed), body);
}

TEST(Wire, SharedRegionsRoundTrip) {
  Message message = shared_bucket_message();
  std::vector<std::byte> body = encode_body(message);
  Message parsed = parse_body(MessageType::kBucket, body, "peer");
  ASSERT_EQ(parsed.manifest.regions.size(), 2u);
  EXPECT_EQ(parsed.manifest.regions[1].id, 4u);
  EXPECT_EQ(parsed.manifest.regions[1].bytes, 1u << 20);
  EXPECT_EQ(parsed.manifest.regions[1].handle, std::vector<std::byte>(64, std::byte{0xcd}));
  ASSERT_EQ(parsed.manifest.entries.size(), 3u);
  // A region entry may lie past the bucket buffer's bytes: the receiver checks the region.
  EXPECT_EQ(parsed.manifest.entries[2].source, 5u);
  EXPECT_EQ(parsed.manifest.entries[2].source_offset, 4096u);
  EXPECT_EQ(encode_body(parsed), body);
}

TEST(Wire, HostileRegionsAreRejectedWithTheField) {
  Message gap = shared_bucket_message();
  gap.manifest.regions[1].id = 6;
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, encode_body(gap), "peer"); }),
              HasSubstr("region id: region 6 follows region 3 (regions are numbered in order)"));
  Message empty = shared_bucket_message();
  empty.manifest.regions[0].handle.clear();
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, encode_body(empty), "peer"); }),
              HasSubstr("empty handle of region 3"));
  Message long_handle = shared_bucket_message();
  long_handle.manifest.regions[0].handle.resize(kMaxHandleBytes + 1);
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, encode_body(long_handle), "peer"); }),
              HasSubstr("region handle: length 257 exceeds the limit 256"));
  std::vector<std::byte> counted = encode_body(shared_bucket_message());
  uint32_t regions = 0x7FFFFFFF;
  std::memcpy(counted.data() + 20, &regions, 4);
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, counted, "peer"); }),
              HasSubstr("regions: 2147483647 shared regions do not fit"));
  Message wrap = shared_bucket_message();
  wrap.manifest.entries[2].source_offset = UINT64_MAX - 10;
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, encode_body(wrap), "peer"); }),
              HasSubstr("entry 2 ('model.embed_tokens.weight') of bucket 7: region bytes"));
}

TEST(Wire, HelloReportAndErrorRoundTrip) {
  Message hello;
  hello.type = MessageType::kHello;
  hello.transport = TransportKind::kShm;
  hello.bucket_bytes = 1 << 20;
  hello.receivers = 3;
  hello.receiver_index = 2;
  Message parsed = parse_body(MessageType::kHello, encode_body(hello), "peer");
  EXPECT_EQ(parsed.transport, TransportKind::kShm);
  EXPECT_EQ(parsed.receivers, 3u);
  EXPECT_EQ(parsed.receiver_index, 2u);
  // A sender's place among its receivers is checked: NCCL ranks are made from it.
  hello.receiver_index = 3;
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kHello, encode_body(hello), "peer"); }),
              HasSubstr("receiver_index: 3 of 3 receivers"));
  hello.receivers = 0;
  hello.receiver_index = 0;
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kHello, encode_body(hello), "peer"); }),
              HasSubstr("receivers: 0 (1 to 1024)"));

  Message report;
  report.type = MessageType::kReport;
  report.report.buckets = 3;
  report.report.seconds = 0.25;
  report.report.shared_bytes = 1ull << 34;
  report.report.placed_bytes = 1ull << 33;
  report.report.regions = 2;
  report.report.connect_seconds = 0.125;
  report.report.phases.first_bucket = 0.5;
  report.report.phases.closing = 0.0625;
  report.report.phases.verifying = 0.03125;
  report.report.checked_tensors = 9;
  report.report.counters.model_hook_runs = 1;
  report.report.completed_layers = {-1, 0, 1};
  parsed = parse_body(MessageType::kReport, encode_body(report), "peer");
  EXPECT_EQ(parsed.report.completed_layers, (std::vector<int64_t>{-1, 0, 1}));
  EXPECT_EQ(parsed.report.counters.model_hook_runs, 1u);
  EXPECT_EQ(parsed.report.seconds, 0.25);
  EXPECT_EQ(parsed.report.shared_bytes, 1ull << 34);
  EXPECT_EQ(parsed.report.placed_bytes, 1ull << 33);
  EXPECT_EQ(parsed.report.regions, 2u);
  EXPECT_EQ(parsed.report.connect_seconds, 0.125);
  EXPECT_EQ(parsed.report.phases.first_bucket, 0.5);
  EXPECT_EQ(parsed.report.phases.verifying, 0.03125);
  EXPECT_EQ(parsed.report.checked_tensors, 9u);
  EXPECT_EQ(parsed.report.phases.closing, 0.0625);
}

TEST(Wire, HeadersAreChecked) {
  auto header = encode_header(MessageType::kStart, 1);
  EXPECT_EQ(parse_header(header, "peer").type, MessageType::kStart);
  auto bad_magic = header;
  bad_magic[0] = std::byte{'X'};
  EXPECT_THAT(error_text([&] { parse_header(bad_magic, "tcp peer 10.0.0.1:9"); }),
              HasSubstr("frame header from tcp peer 10.0.0.1:9: bad magic"));
  auto version = header;
  version[4] = std::byte{99};
  EXPECT_THAT(error_text([&] { parse_header(version, "peer"); }), HasSubstr("protocol version 99, this build speaks " + std::to_string(kProtocolVersion)));
  auto type = header;
  type[6] = std::byte{77};
  EXPECT_THAT(error_text([&] { parse_header(type, "peer"); }), HasSubstr("unknown message type 77"));
  auto huge = encode_header(MessageType::kBucket, uint64_t{1} << 40);
  EXPECT_THAT(error_text([&] { parse_header(huge, "peer"); }), HasSubstr("BUCKET length 1099511627776 exceeds the limit"));
}

// The one frame header of both protocols (net/frame.hpp): the bytes each protocol put on the
// wire before it was shared, field by field, little-endian.
TEST(Wire, BothProtocolsShareOneFrameHeaderByteForByte) {
  const auto update = encode_header(MessageType::kBucket, 0x0102030405060708);
  const std::array<uint8_t, 16> expected_update = {'W', 'S', 'U', 'P', kProtocolVersion, 0, 5, 0,
                                                   8, 7, 6, 5, 4, 3, 2, 1};
  for (size_t i = 0; i < 16; ++i) EXPECT_EQ(static_cast<uint8_t>(update[i]), expected_update[i]) << "byte " << i;

  const std::array<std::byte, 3> body = {std::byte{'{'}, std::byte{' '}, std::byte{'}'}};
  const std::vector<std::byte> peer = encode_frame(transfer::kPeerMagic, transfer::kPeerProtocolVersion, 2, body);
  const std::array<uint8_t, 19> expected_peer = {'W', 'S', 'P', 'E', transfer::kPeerProtocolVersion, 0, 2, 0,
                                                 3, 0, 0, 0, 0, 0, 0, 0, '{', ' ', '}'};
  ASSERT_EQ(peer.size(), expected_peer.size());
  for (size_t i = 0; i < peer.size(); ++i) EXPECT_EQ(static_cast<uint8_t>(peer[i]), expected_peer[i]) << "byte " << i;

  const transfer::FrameFields fields = decode_frame_header(std::span(update));
  EXPECT_EQ(fields.magic, kMagic);
  EXPECT_EQ(fields.version, kProtocolVersion);
  EXPECT_EQ(fields.type, static_cast<uint16_t>(MessageType::kBucket));
  EXPECT_EQ(fields.length, 0x0102030405060708u);
}

TEST(Wire, HostileBucketsAreRejectedWithTheField) {
  std::vector<std::byte> body = encode_body(bucket_message());
  // Truncated anywhere: never a read past the end.
  for (size_t cut = 0; cut < body.size(); ++cut) {
    std::span<const std::byte> part(body.data(), cut);
    EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, part, "peer"); }), HasSubstr("BUCKET message from peer"));
  }
  // A count no body could hold.
  std::vector<std::byte> counted = body;
  uint32_t count = 0xFFFFFFF0;
  std::memcpy(counted.data() + 24, &count, 4);  // after index, slot, bytes and the region count
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, counted, "peer"); }), HasSubstr("count:"));

  Message outside = bucket_message();
  outside.manifest.entries[0].tensor_offset = 1;  // 1 + 8192 > 8192 bytes of the tensor
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, encode_body(outside), "peer"); }),
              HasSubstr("entry 0 ('model.layers.0.mlp.down_proj.weight') of bucket 7: piece 1+8192 lies outside the "
                        "tensor's 8192 bytes"));
  Message past_bucket = bucket_message();
  past_bucket.manifest.entries[1].source_offset = 8300;
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, encode_body(past_bucket), "peer"); }),
              HasSubstr("bytes 8300+256 lie outside the bucket's 8448 bytes"));
  Message overflow = bucket_message();
  overflow.manifest.entries[0].shape = {int64_t{1} << 62, 1 << 20};
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, encode_body(overflow), "peer"); }),
              HasSubstr("has no valid byte size"));
  Message slot = bucket_message();
  slot.manifest.slot = 5;
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, encode_body(slot), "peer"); }),
              HasSubstr("slot: bucket buffer 5 does not exist"));
  std::vector<std::byte> trailing = body;
  trailing.push_back(std::byte{0});
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, trailing, "peer"); }), HasSubstr("1 trailing bytes"));
}

Message start_message() {
  Message message;
  message.type = MessageType::kStart;
  message.format = TensorFormat::kEngine;
  message.declared.push_back({"model.layers.0.mlp.down_proj.weight", Dtype::kF8E4M3, {64, 64}});
  message.declared.push_back({"model.layers.0.mlp.down_proj.weight_scale_inv", Dtype::kF32, {1, 1}});
  message.declared.push_back({"model.norm.weight", Dtype::kBF16, {64}});
  return message;
}

TEST(Wire, StartCarriesTheManifestAndAFullUpdatesAcceptedNoWindows) {
  Message message = start_message();
  std::vector<std::byte> body = encode_body(message);
  Message parsed = parse_body(MessageType::kStart, body, "peer");
  EXPECT_EQ(parsed.format, TensorFormat::kEngine);
  ASSERT_EQ(parsed.declared.size(), 3u);
  EXPECT_EQ(parsed.declared[0].name, "model.layers.0.mlp.down_proj.weight");
  EXPECT_EQ(parsed.declared[0].dtype, Dtype::kF8E4M3);
  EXPECT_EQ(parsed.declared[0].shape, (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(parsed.declared[2].shape, (std::vector<int64_t>{64}));
  EXPECT_EQ(encode_body(parsed), body);
  Message empty;
  empty.type = MessageType::kStart;
  EXPECT_TRUE(parse_body(MessageType::kStart, encode_body(empty), "peer").declared.empty());
  Message accepted;
  accepted.type = MessageType::kAccepted;
  EXPECT_EQ(encode_body(accepted).size(), 4u);  // a full update's: no windows
  EXPECT_TRUE(parse_body(MessageType::kAccepted, encode_body(accepted), "peer").held.empty());
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kAccepted, std::vector<std::byte>(5), "peer"); }),
              HasSubstr("ACCEPTED message from peer: end: 1 trailing bytes"));
  EXPECT_EQ(message_type_name(MessageType::kAccepted), "ACCEPTED");
}

TEST(Wire, ADeltasWindowsAndDigestsRoundTripAndAreBounded) {
  Message accepted;
  accepted.type = MessageType::kAccepted;
  accepted.held = {{{0, 64, 0, 128}}, {}, {{1, 2, 3, 4}, {5, 6, 7, 8}}};
  std::vector<std::byte> body = encode_body(accepted);
  EXPECT_EQ(parse_body(MessageType::kAccepted, body, "peer").held, accepted.held);
  body.resize(body.size() - 8);
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kAccepted, body, "peer"); }),
              HasSubstr("ACCEPTED message from peer: windows: 2 windows do not fit"));
  std::vector<std::byte> many(8, std::byte{0xff});
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kAccepted, many, "peer"); }),
              HasSubstr("count: 4294967295 tensors do not fit"));

  Message finish;
  finish.type = MessageType::kFinish;
  finish.buckets = 7;
  finish.digests = {{0, 0x1234}, {5, ~0ull}};
  Message parsed = parse_body(MessageType::kFinish, encode_body(finish), "peer");
  EXPECT_EQ(parsed.buckets, 7u);
  EXPECT_EQ(parsed.digests, finish.digests);
  body = encode_body(finish);
  body.resize(body.size() - 1);
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kFinish, body, "peer"); }),
              HasSubstr("FINISH message from peer: digests: 2 digests do not fit"));
}

TEST(Wire, ARefusalTooLongForOneMessageIsCutToFit) {
  Message error;
  error.type = MessageType::kError;
  error.text = message_text(std::string(kMaxTextBytes + 100, 'x'));
  EXPECT_EQ(error.text.size(), kMaxTextBytes);
  EXPECT_TRUE(error.text.ends_with("x ... (cut to fit one message)"));
  EXPECT_EQ(parse_body(MessageType::kError, encode_body(error), "peer").text, error.text);
  EXPECT_EQ(message_text("short"), "short");
}

TEST(Wire, HostileManifestsAreRejectedBeforeAnythingIsAllocated) {
  std::vector<std::byte> body = encode_body(start_message());
  // Truncated anywhere: never a read past the end.
  for (size_t cut = 0; cut < body.size(); ++cut) {
    std::span<const std::byte> part(body.data(), cut);
    EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, part, "peer"); }), HasSubstr("START message from peer"));
  }
  // A count over the limit, and one no body could hold: refused before anything is reserved.
  // The count follows the format, the delta flag and the two (empty) versions.
  constexpr size_t kCountAt = 1 + 1 + 4 + 4;
  std::vector<std::byte> counted = body;
  uint32_t count = 0xFFFFFFF0;
  std::memcpy(counted.data() + kCountAt, &count, 4);
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, counted, "peer"); }),
              HasSubstr("START message from peer: count: 4294967280 declared tensors exceed the limit"));
  count = 1000;
  std::memcpy(counted.data() + kCountAt, &count, 4);
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, counted, "peer"); }),
              HasSubstr("count: 1000 declared tensors cannot fit in the "));
  // A name longer than the limit, claimed by its length field.
  std::vector<std::byte> long_name = body;
  uint32_t length = kMaxNameBytes + 1;
  std::memcpy(long_name.data() + kCountAt + 4, &length, 4);
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, long_name, "peer"); }),
              HasSubstr("declared name: length 4097 exceeds the limit 4096"));
  Message unnamed = start_message();
  unnamed.declared[1].name.clear();
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, encode_body(unnamed), "peer"); }),
              HasSubstr("declared tensor 1 (''): empty name"));
  Message rank = start_message();
  rank.declared[2].shape.assign(kMaxTensorRank + 1, 1);
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, encode_body(rank), "peer"); }),
              HasSubstr("declared tensor 2 ('model.norm.weight'): rank 65 exceeds 64"));
  Message overflow = start_message();
  overflow.declared[0].shape = {int64_t{1} << 62, 1 << 20};
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, encode_body(overflow), "peer"); }),
              HasSubstr("declared tensor 0 ('model.layers.0.mlp.down_proj.weight'): shape [4611686018427387904, "
                        "1048576] of F8_E4M3 has no valid byte size"));
  Message negative = start_message();
  negative.declared[2].shape = {-64};
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, encode_body(negative), "peer"); }),
              HasSubstr("has no valid byte size"));
  std::vector<std::byte> dtype = body;
  dtype[kCountAt + 4 + 4 + std::strlen("model.layers.0.mlp.down_proj.weight")] = std::byte{200};
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, dtype, "peer"); }), HasSubstr("unknown dtype code 200"));
  std::vector<std::byte> format = body;
  format[0] = std::byte{2};
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, format, "peer"); }),
              HasSubstr("format: unknown tensor format 2"));
  std::vector<std::byte> trailing = body;
  trailing.push_back(std::byte{0});
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, trailing, "peer"); }), HasSubstr("1 trailing bytes"));
  std::vector<std::byte> kind = body;
  kind[1] = std::byte{7};
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, kind, "peer"); }), HasSubstr("delta: unknown update kind 7"));
  kind[1] = std::byte{1};  // a delta that names no base
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, kind, "peer"); }),
              HasSubstr("base version: a delta update names no base version"));
  std::vector<std::byte> long_version = body;
  length = kMaxVersionBytes + 1;
  std::memcpy(long_version.data() + 2, &length, 4);
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, long_version, "peer"); }),
              HasSubstr("base version: length 129 exceeds the limit 128"));
}

TEST(Wire, StartNamesTheVersionsOfADelta) {
  Message message = start_message();
  message.format = TensorFormat::kCheckpoint;
  message.versions = {"a0a0a0a0a0a0a0a0", "b1b1b1b1b1b1b1b1"};
  Message parsed = parse_body(MessageType::kStart, encode_body(message), "peer");
  EXPECT_EQ(parsed.versions.base, "a0a0a0a0a0a0a0a0");
  EXPECT_EQ(parsed.versions.target, "b1b1b1b1b1b1b1b1");
  message.format = TensorFormat::kEngine;
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kStart, encode_body(message), "peer"); }),
              HasSubstr("delta: a delta update in engine format"));
  message.format = TensorFormat::kCheckpoint;
  message.versions.base.clear();  // a full update may name the version it makes
  EXPECT_EQ(parse_body(MessageType::kStart, encode_body(message), "peer").versions.target, "b1b1b1b1b1b1b1b1");
}

TEST(Wire, ChangedElementsAreAWholeTensorInTheBucketBuffer) {
  Message message;
  message.type = MessageType::kBucket;
  message.manifest.bytes = 100;
  BucketEntry& entry = message.manifest.entries.emplace_back();
  entry.name = "model.norm.weight";
  entry.shape = {64};
  entry.bytes = 40;
  entry.encoding = EntryEncoding::kChangedElements;
  EXPECT_EQ(parse_body(MessageType::kBucket, encode_body(message), "peer").manifest.entries[0].encoding,
            EntryEncoding::kChangedElements);
  message.manifest.entries[0].tensor_offset = 2;
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, encode_body(message), "peer"); }),
              HasSubstr("changed elements of a whole tensor, in the bucket buffer, are expected"));
  message.manifest.entries[0].tensor_offset = 0;
  std::vector<std::byte> body = encode_body(message);
  body.back() = std::byte{9};  // the encoding is the entry's last byte
  EXPECT_THAT(error_text([&] { parse_body(MessageType::kBucket, body, "peer"); }), HasSubstr("unknown encoding 9"));
}

}  // namespace
}  // namespace weightstream::transfer
