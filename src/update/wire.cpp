// Encoding and hostile-input parsing of the update protocol's messages (see wire.hpp).
#include "update/wire.hpp"

#include <bit>
#include <cstring>

namespace weightstream::transfer {
namespace {

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian; add byte swaps here");

class Writer {
 public:
  template <typename T>
  void put(T value) {
    const auto* bytes = reinterpret_cast<const std::byte*>(&value);
    out_.insert(out_.end(), bytes, bytes + sizeof(T));
  }
  void put_bytes(std::span<const std::byte> bytes) {
    put(static_cast<uint32_t>(bytes.size()));
    out_.insert(out_.end(), bytes.begin(), bytes.end());
  }
  void put_string(std::string_view text) {
    put_bytes(std::span(reinterpret_cast<const std::byte*>(text.data()), text.size()));
  }
  void reserve(size_t bytes) { out_.reserve(bytes); }
  std::vector<std::byte> take() { return std::move(out_); }

 private:
  std::vector<std::byte> out_;
};

/// Reads fields from a body, failing with the peer, message and field on any overrun.
class Reader {
 public:
  Reader(std::span<const std::byte> body, MessageType type, const std::string& peer)
      : body_(body), type_(type), peer_(peer) {}

  [[noreturn]] void fail(const std::string& field, const std::string& cause) const {
    WS_FAIL(ErrorCode::kProtocol, std::string(message_type_name(type_)) + " message from " + peer_ + ": " + field +
                                      ": " + cause);
  }

  template <typename T>
  T get(const char* field) {
    if (body_.size() - position_ < sizeof(T)) {
      fail(field, "truncated (" + std::to_string(body_.size() - position_) + " bytes left, " +
                      std::to_string(sizeof(T)) + " needed)");
    }
    T value;
    std::memcpy(&value, body_.data() + position_, sizeof(T));
    position_ += sizeof(T);
    return value;
  }

  std::span<const std::byte> get_bytes(const char* field, uint32_t limit) {
    uint32_t length = get<uint32_t>(field);
    if (length > limit) fail(field, "length " + std::to_string(length) + " exceeds the limit " + std::to_string(limit));
    if (body_.size() - position_ < length) {
      fail(field, "length " + std::to_string(length) + " runs past the end of the message (" +
                      std::to_string(body_.size() - position_) + " bytes left)");
    }
    auto bytes = body_.subspan(position_, length);
    position_ += length;
    return bytes;
  }

  std::string get_string(const char* field, uint32_t limit) {
    auto bytes = get_bytes(field, limit);
    return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }

  size_t left() const noexcept { return body_.size() - position_; }

  void expect_end() const {
    if (left() != 0) fail("end", std::to_string(left()) + " trailing bytes");
  }

 private:
  std::span<const std::byte> body_;
  size_t position_ = 0;
  MessageType type_;
  const std::string& peer_;
};

bool known_type(uint16_t type) { return type >= 1 && type <= 10; }

std::string printable(std::string_view name) {
  std::string text;
  for (char c : name.substr(0, 200)) text += (c >= 0x20 && c < 0x7f) ? c : '?';
  if (name.size() > 200) text += "...";
  return text;
}

/// START: the update's kind, versions and manifest.
void put_start(Writer& out, const Message& message) {
  out.reserve(8 + 64 * message.declared.size());
  out.put(static_cast<uint8_t>(message.format == TensorFormat::kEngine ? 1 : 0));
  out.put(static_cast<uint8_t>(message.versions.base.empty() ? 0 : 1));
  out.put_string(message.versions.base);
  out.put_string(message.versions.target);
  out.put(static_cast<uint32_t>(message.declared.size()));
  for (const DeclaredTensor& tensor : message.declared) {
    out.put_string(tensor.name);
    out.put(static_cast<uint8_t>(tensor.dtype));
    out.put(static_cast<uint8_t>(tensor.shape.size()));
    for (int64_t dimension : tensor.shape) out.put(dimension);
  }
}

/// BUCKET: the regions shared for the first time, then the entries.
void put_bucket(Writer& out, const Message& message) {
  out.reserve(64 + 128 * message.manifest.regions.size() + 96 * message.manifest.entries.size());
  out.put(message.manifest.index);
  out.put(message.manifest.slot);
  out.put(message.manifest.bytes);
  out.put(static_cast<uint32_t>(message.manifest.regions.size()));
  for (const SharedRegion& region : message.manifest.regions) {
    out.put(region.id);
    out.put(region.bytes);
    out.put_bytes(region.handle);
  }
  out.put(static_cast<uint32_t>(message.manifest.entries.size()));
  for (const BucketEntry& entry : message.manifest.entries) {
    out.put_string(entry.name);
    out.put(static_cast<uint8_t>(entry.dtype));
    out.put(static_cast<uint8_t>(entry.shape.size()));
    for (int64_t dimension : entry.shape) out.put(dimension);
    out.put(entry.tensor_offset);
    out.put(entry.source);
    out.put(entry.source_offset);
    out.put(entry.bytes);
    out.put(static_cast<uint8_t>(entry.encoding));
  }
}

/// REPORT: the receiver's counts, times and completed layers.
void put_report(Writer& out, const Message& message) {
  const UpdateReport& report = message.report;
  out.put(report.buckets);
  out.put(report.tensors);
  out.put(report.bytes);
  out.put(report.shared_bytes);
  out.put(report.placed_bytes);
  out.put(report.regions);
  out.put(report.sparse_tensors);
  out.put(report.dense_tensors);
  out.put(report.checked_tensors);
  out.put(report.seconds);
  out.put(report.connect_seconds);
  for (const auto& [name, phase] : kUpdatePhases) out.put(report.phases.*phase);
  const LoadCounters& counters = report.counters;
  for (uint64_t value : {counters.tensors_applied, counters.bytes_applied, counters.tensors_skipped,
                         counters.parameters_completed, counters.layer_processing_runs, counters.model_hook_runs}) {
    out.put(value);
  }
  out.put(static_cast<uint32_t>(report.completed_layers.size()));
  for (int64_t layer : report.completed_layers) out.put(layer);
}

/// HELLO: the transport, the bucket size and this receiver's place among the receivers.
void parse_hello(Reader& in, Message& message) {
  auto transport = in.get<uint8_t>("transport");
  if (transport < 1 || transport > 5) in.fail("transport", "unknown transport " + std::to_string(transport));
  message.transport = static_cast<TransportKind>(transport);
  message.bucket_bytes = in.get<uint64_t>("bucket_bytes");
  if (message.bucket_bytes == 0) in.fail("bucket_bytes", "zero");
  message.receivers = in.get<uint32_t>("receivers");
  if (message.receivers == 0 || message.receivers > kMaxReceivers) {
    in.fail("receivers", std::to_string(message.receivers) + " (1 to " + std::to_string(kMaxReceivers) + ")");
  }
  message.receiver_index = in.get<uint32_t>("receiver_index");
  if (message.receiver_index >= message.receivers) {
    in.fail("receiver_index", std::to_string(message.receiver_index) + " of " + std::to_string(message.receivers) +
                                  " receivers");
  }
  auto blob = in.get_bytes("blob", kMaxBlobBytes);
  message.blob.assign(blob.begin(), blob.end());
}

/// START: the update's kind and versions, then its declared tensors, each checked for itself.
void parse_start(Reader& in, Message& message) {
  auto format = in.get<uint8_t>("format");
  if (format > 1) in.fail("format", "unknown tensor format " + std::to_string(format));
  message.format = format == 1 ? TensorFormat::kEngine : TensorFormat::kCheckpoint;
  auto delta = in.get<uint8_t>("delta");
  if (delta > 1) in.fail("delta", "unknown update kind " + std::to_string(delta));
  message.versions.base = in.get_string("base version", kMaxVersionBytes);
  message.versions.target = in.get_string("target version", kMaxVersionBytes);
  if ((delta == 1) != !message.versions.base.empty()) {
    in.fail("base version", delta == 1 ? "a delta update names no base version" : "a full update names a base version");
  }
  if (delta == 1 && message.format == TensorFormat::kEngine) in.fail("delta", "a delta update in engine format");
  auto count = in.get<uint32_t>("count");
  if (count > kMaxEntries) in.fail("count", std::to_string(count) + " declared tensors exceed the limit");
  // Each declared tensor takes at least 7 bytes: reserve no more than the body can hold.
  if (count > in.left() / 7) {
    in.fail("count", std::to_string(count) + " declared tensors cannot fit in the " + std::to_string(in.left()) +
                         " bytes left");
  }
  message.declared.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    DeclaredTensor tensor;
    tensor.name = in.get_string("declared name", kMaxNameBytes);
    auto where = [&] { return "declared tensor " + std::to_string(i) + " ('" + printable(tensor.name) + "')"; };
    if (tensor.name.empty()) in.fail(where(), "empty name");
    auto dtype = in.get<uint8_t>("declared dtype");
    if (dtype > static_cast<uint8_t>(Dtype::kF6E3M2)) in.fail(where(), "unknown dtype code " + std::to_string(dtype));
    tensor.dtype = static_cast<Dtype>(dtype);
    auto rank = in.get<uint8_t>("declared rank");
    if (rank > kMaxTensorRank) in.fail(where(), "rank " + std::to_string(rank) + " exceeds " + std::to_string(kMaxTensorRank));
    tensor.shape.resize(rank);
    for (uint8_t d = 0; d < rank; ++d) tensor.shape[d] = in.get<int64_t>("declared shape");
    if (!tensor_byte_size(tensor.dtype, tensor.shape)) {
      in.fail(where(), "shape " + shape_text(tensor.shape) + " of " + std::string(dtype_name(tensor.dtype)) +
                           " has no valid byte size");
    }
    message.declared.push_back(std::move(tensor));
  }
}

/// ACCEPTED: the receiver's windows of each declared tensor.
void parse_accepted(Reader& in, Message& message) {
  auto count = in.get<uint32_t>("count");
  // Each tensor's windows take at least 4 bytes: reserve no more than the body can hold.
  if (count > kMaxEntries || count > in.left() / 4) in.fail("count", std::to_string(count) + " tensors do not fit");
  message.held.resize(count);
  for (std::vector<HeldWindow>& windows : message.held) {
    auto held = in.get<uint32_t>("windows");
    if (held > in.left() / 32) in.fail("windows", std::to_string(held) + " windows do not fit");
    windows.resize(held);
    for (HeldWindow& window : windows) {
      for (uint64_t* value : {&window.row_begin, &window.rows, &window.column_begin, &window.columns}) {
        *value = in.get<uint64_t>("window");
      }
    }
  }
}

/// BUCKET: its regions (numbered in order), then its entries, each checked for itself.
void parse_bucket(Reader& in, Message& message) {
  BucketManifest& manifest = message.manifest;
  manifest.index = in.get<uint64_t>("index");
  manifest.slot = in.get<uint32_t>("slot");
  if (manifest.slot > 1) in.fail("slot", "bucket buffer " + std::to_string(manifest.slot) + " does not exist");
  manifest.bytes = in.get<uint64_t>("bytes");
  auto regions = in.get<uint32_t>("regions");
  // Each region takes at least 16 bytes: reserve no more than the body can hold.
  if (regions > kMaxRegions || regions > in.left() / 16) {
    in.fail("regions", std::to_string(regions) + " shared regions do not fit");
  }
  manifest.regions.reserve(regions);
  for (uint32_t i = 0; i < regions; ++i) {
    SharedRegion region;
    region.id = in.get<uint32_t>("region id");
    if (i > 0 && region.id != manifest.regions.back().id + 1) {
      in.fail("region id", "region " + std::to_string(region.id) + " follows region " +
                               std::to_string(manifest.regions.back().id) + " (regions are numbered in order)");
    }
    region.bytes = in.get<uint64_t>("region bytes");
    auto handle = in.get_bytes("region handle", kMaxHandleBytes);
    if (handle.empty()) in.fail("region handle", "empty handle of region " + std::to_string(region.id));
    region.handle.assign(handle.begin(), handle.end());
    manifest.regions.push_back(std::move(region));
  }
  auto count = in.get<uint32_t>("count");
  if (count > kMaxEntries) in.fail("count", std::to_string(count) + " entries exceed the limit");
  // Each entry takes at least 39 bytes: reserve no more than the body can hold.
  if (count > in.left() / 39) {
    in.fail("count", std::to_string(count) + " entries cannot fit in the " + std::to_string(in.left()) +
                         " bytes left");
  }
  manifest.entries.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    BucketEntry entry;
    entry.name = in.get_string("entry name", kMaxNameBytes);
    // Built only for a message: this runs for every tensor of every update.
    auto where = [&] {
      return "entry " + std::to_string(i) + " ('" + printable(entry.name) + "') of bucket " +
             std::to_string(manifest.index);
    };
    if (entry.name.empty()) in.fail(where(), "empty name");
    auto dtype = in.get<uint8_t>("entry dtype");
    if (dtype > static_cast<uint8_t>(Dtype::kF6E3M2)) in.fail(where(), "unknown dtype code " + std::to_string(dtype));
    entry.dtype = static_cast<Dtype>(dtype);
    auto rank = in.get<uint8_t>("entry rank");
    if (rank > kMaxTensorRank) in.fail(where(), "rank " + std::to_string(rank) + " exceeds " + std::to_string(kMaxTensorRank));
    entry.shape.resize(rank);
    for (uint8_t d = 0; d < rank; ++d) entry.shape[d] = in.get<int64_t>("entry shape");
    entry.tensor_offset = in.get<uint64_t>("entry tensor_offset");
    entry.source = in.get<uint32_t>("entry source");
    entry.source_offset = in.get<uint64_t>("entry source_offset");
    entry.bytes = in.get<uint64_t>("entry bytes");
    auto encoding = in.get<uint8_t>("entry encoding");
    if (encoding > 1) in.fail(where(), "unknown encoding " + std::to_string(encoding));
    entry.encoding = static_cast<EntryEncoding>(encoding);
    if (entry.encoding == EntryEncoding::kChangedElements && (entry.source != 0 || entry.tensor_offset != 0)) {
      in.fail(where(), "changed elements of a whole tensor, in the bucket buffer, are expected");
    }
    auto size = tensor_byte_size(entry.dtype, entry.shape);
    if (!size) in.fail(where(), "shape " + shape_text(entry.shape) + " of " + std::string(dtype_name(entry.dtype)) + " has no valid byte size");
    if (entry.tensor_offset > *size || entry.bytes > *size - entry.tensor_offset) {
      in.fail(where(), "piece " + std::to_string(entry.tensor_offset) + "+" + std::to_string(entry.bytes) +
                           " lies outside the tensor's " + std::to_string(*size) + " bytes");
    }
    if (entry.source == 0 &&
        (entry.source_offset > manifest.bytes || entry.bytes > manifest.bytes - entry.source_offset)) {
      in.fail(where(), "bytes " + std::to_string(entry.source_offset) + "+" + std::to_string(entry.bytes) +
                           " lie outside the bucket's " + std::to_string(manifest.bytes) + " bytes");
    }
    if (entry.source != 0 && entry.source_offset > UINT64_MAX - entry.bytes) {
      in.fail(where(), "region bytes " + std::to_string(entry.source_offset) + "+" + std::to_string(entry.bytes) +
                           " overflow");
    }
    manifest.entries.push_back(std::move(entry));
  }
}

/// FINISH: the buckets sent and the digests of the receiver's windows.
void parse_finish(Reader& in, Message& message) {
  message.buckets = in.get<uint64_t>("buckets");
  auto count = in.get<uint32_t>("digests");
  if (count > kMaxEntries || count > in.left() / 12) in.fail("digests", std::to_string(count) + " digests do not fit");
  message.digests.resize(count);
  for (auto& [index, digest] : message.digests) {
    index = in.get<uint32_t>("digest index");
    digest = in.get<uint64_t>("digest");
  }
}

/// REPORT: the receiver's counts, times and completed layers.
void parse_report(Reader& in, Message& message) {
  UpdateReport& report = message.report;
  report.buckets = in.get<uint64_t>("buckets");
  report.tensors = in.get<uint64_t>("tensors");
  report.bytes = in.get<uint64_t>("bytes");
  report.shared_bytes = in.get<uint64_t>("shared_bytes");
  report.placed_bytes = in.get<uint64_t>("placed_bytes");
  report.regions = in.get<uint64_t>("regions");
  report.sparse_tensors = in.get<uint64_t>("sparse_tensors");
  report.dense_tensors = in.get<uint64_t>("dense_tensors");
  report.checked_tensors = in.get<uint64_t>("checked_tensors");
  report.seconds = in.get<double>("seconds");
  report.connect_seconds = in.get<double>("connect_seconds");
  for (const auto& [name, phase] : kUpdatePhases) report.phases.*phase = in.get<double>(name);
  LoadCounters& counters = report.counters;
  for (uint64_t* value : {&counters.tensors_applied, &counters.bytes_applied, &counters.tensors_skipped,
                          &counters.parameters_completed, &counters.layer_processing_runs,
                          &counters.model_hook_runs}) {
    *value = in.get<uint64_t>("counters");
  }
  auto count = in.get<uint32_t>("layers");
  if (count > kMaxLayers || count > in.left() / 8) in.fail("layers", std::to_string(count) + " layers do not fit");
  for (uint32_t i = 0; i < count; ++i) report.completed_layers.push_back(in.get<int64_t>("layer"));
}

}  // namespace

std::string message_text(std::string text) {
  constexpr std::string_view kCut = " ... (cut to fit one message)";
  if (text.size() <= kMaxTextBytes) return text;
  text.resize(kMaxTextBytes - kCut.size());
  return text.append(kCut);
}

std::string_view message_type_name(MessageType type) noexcept {
  switch (type) {
    case MessageType::kHello: return "HELLO";
    case MessageType::kWelcome: return "WELCOME";
    case MessageType::kRefuse: return "REFUSE";
    case MessageType::kStart: return "START";
    case MessageType::kBucket: return "BUCKET";
    case MessageType::kApplied: return "APPLIED";
    case MessageType::kFinish: return "FINISH";
    case MessageType::kReport: return "REPORT";
    case MessageType::kError: return "ERROR";
    case MessageType::kAccepted: return "ACCEPTED";
  }
  return "unknown";
}

std::array<std::byte, kHeaderBytes> encode_header(MessageType type, uint64_t length) {
  return encode_frame_header({kMagic, kProtocolVersion, static_cast<uint16_t>(type), length});
}

FrameHeader parse_header(std::span<const std::byte> bytes, const std::string& peer) {
  WS_EXPECT(bytes.size() == kHeaderBytes, ErrorCode::kProtocol,
            "frame header from " + peer + ": " + std::to_string(bytes.size()) + " bytes, expected 16");
  const FrameFields fields = decode_frame_header(bytes.first<kHeaderBytes>());
  const uint32_t magic = fields.magic;
  const uint16_t version = fields.version, type = fields.type;
  const uint64_t length = fields.length;
  WS_EXPECT(magic == kMagic, ErrorCode::kProtocol,
            "frame header from " + peer + ": bad magic 0x" + [&] {
              char text[16];
              std::snprintf(text, sizeof(text), "%08x", magic);
              return std::string(text);
            }() + " (not a weightstream update peer)");
  WS_EXPECT(version == kProtocolVersion, ErrorCode::kProtocol,
            "frame header from " + peer + ": protocol version " + std::to_string(version) + ", this build speaks " +
                std::to_string(kProtocolVersion));
  WS_EXPECT(known_type(type), ErrorCode::kProtocol,
            "frame header from " + peer + ": unknown message type " + std::to_string(type));
  WS_EXPECT(length <= kMaxMessageBytes, ErrorCode::kProtocol,
            "frame header from " + peer + ": " + std::string(message_type_name(MessageType(type))) + " length " +
                std::to_string(length) + " exceeds the limit " + std::to_string(kMaxMessageBytes));
  return {version, static_cast<MessageType>(type), length};
}

std::vector<std::byte> encode_body(const Message& message) {
  Writer out;
  switch (message.type) {
    case MessageType::kHello:
      out.put(static_cast<uint8_t>(message.transport));
      out.put(message.bucket_bytes);
      out.put(message.receivers);
      out.put(message.receiver_index);
      out.put_bytes(message.blob);
      break;
    case MessageType::kWelcome:
      out.put(message.bucket_bytes);
      out.put(message.slots);
      out.put_bytes(message.blob);
      break;
    case MessageType::kRefuse:
      out.put_string(message.text);
      break;
    case MessageType::kStart:
      put_start(out, message);
      break;
    case MessageType::kAccepted:
      out.put(static_cast<uint32_t>(message.held.size()));
      for (const std::vector<HeldWindow>& windows : message.held) {
        out.put(static_cast<uint32_t>(windows.size()));
        for (const HeldWindow& window : windows) {
          for (uint64_t value : {window.row_begin, window.rows, window.column_begin, window.columns}) out.put(value);
        }
      }
      break;
    case MessageType::kBucket:
      put_bucket(out, message);
      break;
    case MessageType::kApplied:
      out.put(message.manifest.index);
      out.put(message.manifest.slot);
      break;
    case MessageType::kFinish:
      out.put(message.buckets);
      out.put(static_cast<uint32_t>(message.digests.size()));
      for (const auto& [index, digest] : message.digests) {
        out.put(index);
        out.put(digest);
      }
      break;
    case MessageType::kReport:
      put_report(out, message);
      break;
    case MessageType::kError:
      out.put(static_cast<uint8_t>(message.code));
      out.put_string(message.text);
      break;
  }
  return out.take();
}

Message parse_body(MessageType type, std::span<const std::byte> body, const std::string& peer) {
  Reader in(body, type, peer);
  Message message;
  message.type = type;
  switch (type) {
    case MessageType::kHello:
      parse_hello(in, message);
      break;
    case MessageType::kWelcome: {
      message.bucket_bytes = in.get<uint64_t>("bucket_bytes");
      message.slots = in.get<uint32_t>("slots");
      if (message.slots != 2) in.fail("slots", std::to_string(message.slots) + " bucket buffers, expected 2");
      auto blob = in.get_bytes("blob", kMaxBlobBytes);
      message.blob.assign(blob.begin(), blob.end());
      break;
    }
    case MessageType::kRefuse:
      message.text = in.get_string("reason", kMaxTextBytes);
      break;
    case MessageType::kStart:
      parse_start(in, message);
      break;
    case MessageType::kAccepted:
      parse_accepted(in, message);
      break;
    case MessageType::kBucket:
      parse_bucket(in, message);
      break;
    case MessageType::kApplied:
      message.manifest.index = in.get<uint64_t>("index");
      message.manifest.slot = in.get<uint32_t>("slot");
      if (message.manifest.slot > 1) in.fail("slot", "bucket buffer " + std::to_string(message.manifest.slot) + " does not exist");
      break;
    case MessageType::kFinish:
      parse_finish(in, message);
      break;
    case MessageType::kReport:
      parse_report(in, message);
      break;
    case MessageType::kError: {
      auto code = in.get<uint8_t>("code");
      if (code > static_cast<uint8_t>(ErrorCode::kInternal)) in.fail("code", "unknown error code " + std::to_string(code));
      message.code = static_cast<ErrorCode>(code);
      message.text = in.get_string("message", kMaxTextBytes);
      break;
    }
    default:
      in.fail("type", "unknown message type " + std::to_string(static_cast<uint16_t>(type)));
  }
  in.expect_end();
  return message;
}

}  // namespace weightstream::transfer
