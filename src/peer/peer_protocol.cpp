// The peer control protocol's frames and the manifest's JSON (peer_protocol.hpp).
#include "peer/peer_protocol.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <vector>

#include <xxhash.h>

#include "weightstream/error.hpp"

namespace weightstream::transfer {
namespace {

std::string_view processing_name(Processing processing) {
  return processing == Processing::kFp8PerTensor ? "fp8_per_tensor" : "none";
}

Processing parse_processing(const std::string& text, const std::string& what) {
  if (text == "none") return Processing::kNone;
  if (text == "fp8_per_tensor") return Processing::kFp8PerTensor;
  WS_FAIL(ErrorCode::kProtocol, what + ": unknown processing '" + text + "'");
}

Dtype parse_dtype(const std::string& text, const std::string& what) {
  auto dtype = dtype_from_name(text);
  WS_EXPECT(dtype.has_value(), ErrorCode::kProtocol, what + ": unknown dtype '" + text + "'");
  return *dtype;
}

std::vector<int64_t> parse_shape(const nlohmann::json& json, const std::string& what) {
  std::vector<int64_t> shape = json.get<std::vector<int64_t>>();
  WS_EXPECT(shape.size() <= kMaxTensorRank, ErrorCode::kProtocol, what + ": shape of " + std::to_string(shape.size()) + " dimensions");
  for (int64_t dimension : shape) WS_EXPECT(dimension >= 0, ErrorCode::kProtocol, what + ": negative dimension");
  return shape;
}

}  // namespace

bool is_content_digest(std::string_view text) noexcept {
  return text.size() == 16 &&
         std::all_of(text.begin(), text.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::string to_hex(std::span<const std::byte> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string text;
  text.reserve(bytes.size() * 2);
  for (std::byte byte : bytes) {
    text += kDigits[static_cast<unsigned>(byte) >> 4];
    text += kDigits[static_cast<unsigned>(byte) & 15];
  }
  return text;
}

std::vector<std::byte> from_hex(std::string_view text, const std::string& what) {
  WS_EXPECT(text.size() % 2 == 0, ErrorCode::kProtocol, what + ": odd number of hex digits");
  auto digit = [&](char c) -> unsigned {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    WS_FAIL(ErrorCode::kProtocol, what + ": '" + std::string(1, c) + "' is not a hex digit");
  };
  std::vector<std::byte> bytes(text.size() / 2);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(digit(text[2 * i]) << 4 | digit(text[2 * i + 1]));
  return bytes;
}

void send_peer_message(Connection& connection, PeerMessage type, const nlohmann::json& body,
                       std::chrono::milliseconds timeout) {
  const std::string text = body.dump();
  const std::vector<std::byte> frame =
      encode_frame(kPeerMagic, kPeerProtocolVersion, static_cast<uint16_t>(type), std::as_bytes(std::span(text)));
  connection.send_bytes(frame, timeout, "a peer control message");
}

PeerFrame receive_peer_message(Connection& connection, std::chrono::milliseconds timeout, const std::string& awaiting,
                               uint64_t max_bytes) {
  std::array<std::byte, kFrameHeaderBytes> header;
  connection.receive_bytes(header, timeout, awaiting);
  const std::string& peer = connection.peer();
  const auto [magic, version, type, length] = decode_frame_header(header);
  WS_EXPECT(magic == kPeerMagic, ErrorCode::kProtocol,
            peer + " does not speak the weightstream peer protocol (bad magic while awaiting " + awaiting + ")");
  WS_EXPECT(version == kPeerProtocolVersion, ErrorCode::kProtocol,
            peer + " speaks peer protocol version " + std::to_string(version) + ", this build " +
                std::to_string(kPeerProtocolVersion));
  WS_EXPECT(type >= 1 && type <= 4, ErrorCode::kProtocol, peer + " sent unknown peer message type " + std::to_string(type));
  WS_EXPECT(length <= max_bytes, ErrorCode::kProtocol,
            peer + " sent a " + std::to_string(length) + "-byte message, over the limit of " +
                std::to_string(max_bytes));
  std::string text(length, '\0');
  connection.receive_bytes(std::as_writable_bytes(std::span(text)), timeout, awaiting);
  PeerFrame frame;
  frame.type = static_cast<PeerMessage>(type);
  try {
    frame.body = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& error) {
    WS_FAIL(ErrorCode::kProtocol, peer + " sent malformed JSON while awaiting " + awaiting + ": " + error.what());
  }
  WS_EXPECT(frame.body.is_object(), ErrorCode::kProtocol, peer + " sent a message that is not a JSON object");
  return frame;
}

nlohmann::json manifest_json(const PeerManifest& manifest) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const PeerTensor& tensor : manifest.tensors) {
    tensors.push_back({{"name", tensor.name}, {"dtype", dtype_name(tensor.dtype)}, {"shape", tensor.shape}, {"shard", tensor.shard}});
  }
  nlohmann::json parameters = nlohmann::json::array();
  for (const PeerParameter& parameter : manifest.parameters) {
    nlohmann::json parts = nlohmann::json::array();
    for (const ParameterPart& part : parameter.parts) {
      parts.push_back({{"tensor", part.tensor}, {"id", part.id}, {"shape", part.shape}, {"row_begin", part.row_begin},
                       {"rows", part.rows}, {"column_begin", part.column_begin}, {"columns", part.columns},
                       {"element_offset", part.element_offset}});
    }
    parameters.push_back({{"name", parameter.name}, {"dtype", dtype_name(parameter.dtype)}, {"shape", parameter.shape},
                          {"bytes", parameter.bytes}, {"xxh64", parameter.xxh64}, {"piece_xxh64", parameter.piece_xxh64},
                          {"processing", processing_name(parameter.processing)}, {"parts", parts},
                          {"remote_address", parameter.remote_address}, {"remote_key", to_hex(parameter.remote_key)}});
  }
  return {{"model_type", manifest.model_type},
          {"tp_size", manifest.parallel.tp_size},
          {"tp_rank", manifest.parallel.tp_rank},
          {"ep_size", manifest.parallel.ep_size},
          {"ep_rank", manifest.parallel.ep_rank},
          {"dtype", manifest.dtype},
          {"quantization", manifest.quantization},
          {"checkpoint_identity", manifest.checkpoint_identity},
          {"content_digest", manifest.content_digest},
          {"version", manifest.version},
          {"digest_piece_bytes", manifest.digest_piece_bytes},
          {"config_json", manifest.config_json},
          {"tensors", tensors},
          {"parameters", parameters},
          {"worker_address", to_hex(manifest.worker_address)},
          {"send_secret", to_hex(manifest.send_secret)},
          {"ucx_segment_bytes", manifest.ucx_segment_bytes}};
}

PeerManifest parse_manifest(const nlohmann::json& json, const std::string& peer) {
  std::string field = "manifest";
  try {
    PeerManifest manifest;
    manifest.model_type = (field = "model_type", json.at("model_type")).get<std::string>();
    manifest.parallel.tp_size = (field = "tp_size", json.at("tp_size")).get<int64_t>();
    manifest.parallel.tp_rank = (field = "tp_rank", json.at("tp_rank")).get<int64_t>();
    manifest.parallel.ep_size = (field = "ep_size", json.at("ep_size")).get<int64_t>();
    manifest.parallel.ep_rank = (field = "ep_rank", json.at("ep_rank")).get<int64_t>();
    const Parallelism& p = manifest.parallel;
    WS_EXPECT(p.tp_size >= 1 && p.tp_rank >= 0 && p.tp_rank < p.tp_size && p.ep_size >= 1 && p.ep_rank >= 0 &&
                  p.ep_rank < p.ep_size,
              ErrorCode::kProtocol, peer + ": manifest has tp rank " + std::to_string(p.tp_rank) + " of " +
                                        std::to_string(p.tp_size) + ", ep rank " + std::to_string(p.ep_rank) + " of " +
                                        std::to_string(p.ep_size));
    manifest.dtype = (field = "dtype", json.at("dtype")).get<std::string>();
    manifest.quantization = (field = "quantization", json.at("quantization")).get<std::string>();
    manifest.checkpoint_identity = (field = "checkpoint_identity", json.at("checkpoint_identity")).get<std::string>();
    manifest.content_digest = (field = "content_digest", json.at("content_digest")).get<std::string>();
    WS_EXPECT(manifest.content_digest.empty() || is_content_digest(manifest.content_digest), ErrorCode::kProtocol,
              peer + ": manifest has content digest '" + manifest.content_digest.substr(0, 64) +
                  "', neither empty nor 16 lowercase hex digits");
    manifest.version = (field = "version", json.at("version")).get<uint64_t>();
    manifest.digest_piece_bytes = (field = "digest_piece_bytes", json.at("digest_piece_bytes")).get<uint64_t>();
    WS_EXPECT(manifest.digest_piece_bytes > 0, ErrorCode::kProtocol, peer + ": manifest has digest pieces of 0 bytes");
    manifest.config_json = (field = "config_json", json.at("config_json")).get<std::string>();
    manifest.worker_address = from_hex((field = "worker_address", json.at("worker_address")).get<std::string>(), peer + ": worker_address");
    manifest.send_secret = from_hex((field = "send_secret", json.at("send_secret")).get<std::string>(), peer + ": send_secret");
    WS_EXPECT(manifest.send_secret.size() == 16, ErrorCode::kProtocol,
              peer + ": send_secret of " + std::to_string(manifest.send_secret.size()) + " bytes, not 16");
    manifest.ucx_segment_bytes = (field = "ucx_segment_bytes", json.at("ucx_segment_bytes")).get<uint64_t>();
    for (const nlohmann::json& tensor : (field = "tensors", json.at("tensors"))) {
      PeerTensor& entry = manifest.tensors.emplace_back();
      entry.name = (field = "tensors[].name", tensor.at("name")).get<std::string>();
      entry.dtype = parse_dtype((field = "tensors[].dtype", tensor.at("dtype")).get<std::string>(), peer + ": tensor " + entry.name);
      entry.shape = parse_shape((field = "tensors[].shape", tensor.at("shape")), peer + ": tensor " + entry.name);
      entry.shard = (field = "tensors[].shard", tensor.at("shard")).get<std::string>();
    }
    for (const nlohmann::json& parameter : (field = "parameters", json.at("parameters"))) {
      PeerParameter& entry = manifest.parameters.emplace_back();
      entry.name = (field = "parameters[].name", parameter.at("name")).get<std::string>();
      const std::string what = peer + ": parameter " + entry.name;
      entry.dtype = parse_dtype((field = "parameters[].dtype", parameter.at("dtype")).get<std::string>(), what);
      entry.shape = parse_shape((field = "parameters[].shape", parameter.at("shape")), what);
      entry.bytes = (field = "parameters[].bytes", parameter.at("bytes")).get<uint64_t>();
      auto size = tensor_byte_size(entry.dtype, entry.shape);
      WS_EXPECT(size && *size == entry.bytes, ErrorCode::kProtocol,
                what + ": " + std::to_string(entry.bytes) + " bytes do not match its dtype and shape");
      entry.xxh64 = (field = "parameters[].xxh64", parameter.at("xxh64")).get<uint64_t>();
      entry.piece_xxh64 = (field = "parameters[].piece_xxh64", parameter.at("piece_xxh64")).get<std::vector<uint64_t>>();
      const uint64_t pieces = (entry.bytes + manifest.digest_piece_bytes - 1) / manifest.digest_piece_bytes;
      WS_EXPECT(entry.piece_xxh64.empty() || entry.piece_xxh64.size() == pieces, ErrorCode::kProtocol,
                what + ": " + std::to_string(entry.piece_xxh64.size()) + " piece digests for " + std::to_string(pieces) +
                    " pieces of " + std::to_string(manifest.digest_piece_bytes) + " bytes");
      entry.processing = parse_processing((field = "parameters[].processing", parameter.at("processing")).get<std::string>(), what);
      entry.remote_address = (field = "parameters[].remote_address", parameter.at("remote_address")).get<uint64_t>();
      entry.remote_key = from_hex((field = "parameters[].remote_key", parameter.at("remote_key")).get<std::string>(), what);
      const uint64_t element_bytes = std::max<unsigned>(dtype_bits(entry.dtype) / 8, 1);
      for (const nlohmann::json& part : (field = "parameters[].parts", parameter.at("parts"))) {
        ParameterPart& slice = entry.parts.emplace_back();
        slice.tensor = (field = "parts[].tensor", part.at("tensor")).get<std::string>();
        slice.id = (field = "parts[].id", part.at("id")).get<std::string>();
        slice.shape = parse_shape((field = "parts[].shape", part.at("shape")), what);
        slice.row_begin = (field = "parts[].row_begin", part.at("row_begin")).get<int64_t>();
        slice.rows = (field = "parts[].rows", part.at("rows")).get<int64_t>();
        slice.column_begin = (field = "parts[].column_begin", part.at("column_begin")).get<int64_t>();
        slice.columns = (field = "parts[].columns", part.at("columns")).get<int64_t>();
        slice.element_offset = (field = "parts[].element_offset", part.at("element_offset")).get<uint64_t>();
        // The rectangle must lie inside its tensor and inside the parameter's bytes: the
        // puller copies out of it.
        const bool inside_tensor = slice.row_begin >= 0 && slice.rows >= 0 && slice.column_begin >= 0 &&
                                   slice.columns >= 0 && slice.row_begin + slice.rows <= slice.tensor_rows() &&
                                   slice.column_begin + slice.columns <= slice.tensor_columns();
        const bool inside_parameter = slice.element_offset <= entry.bytes / element_bytes &&
                                      slice.elements() <= entry.bytes / element_bytes - slice.element_offset;
        WS_EXPECT(inside_tensor && inside_parameter, ErrorCode::kProtocol,
                  what + ": part of tensor " + slice.tensor + " lies outside the tensor or the parameter");
      }
    }
    return manifest;
  } catch (const nlohmann::json::exception& error) {
    WS_FAIL(ErrorCode::kProtocol, peer + ": malformed manifest at field " + field + ": " + error.what());
  }
}

uint64_t ParameterDigester::digest(const std::byte* data, const Device& device, uint64_t bytes, uint64_t piece_bytes,
                                   std::vector<uint64_t>& pieces) {
  pieces.clear();
  pieces.reserve((bytes + piece_bytes - 1) / piece_bytes);
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> state(XXH64_createState(), &XXH64_freeState);
  XXH64_reset(state.get(), 0);
  // Each step is read (out of the GPU, through the pinned scratch) once, and hashed whole and
  // by pieces while in the cache.
  digest_steps(data, device, bytes, [&](const std::byte* step, uint64_t length) {
    for (uint64_t done = 0; done < length; done += piece_bytes) {
      const uint64_t piece = std::min(piece_bytes, length - done);
      pieces.push_back(XXH64(step + done, piece, 0));
      XXH64_update(state.get(), step + done, piece);
    }
  });
  return XXH64_digest(state.get());
}

uint64_t ParameterDigester::digest(const std::byte* data, const Device& device, uint64_t bytes,
                                   const std::function<void()>& between) {
  if (!device.is_cuda() && !between) return XXH64(data, bytes, 0);
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> state(XXH64_createState(), &XXH64_freeState);
  XXH64_reset(state.get(), 0);
  digest_steps(data, device, bytes, [&](const std::byte* step, uint64_t length) {
    XXH64_update(state.get(), step, length);
    if (between) between();
  });
  return XXH64_digest(state.get());
}

void ParameterDigester::digest_steps(const std::byte* data, const Device& device, uint64_t bytes,
                                     const std::function<void(const std::byte*, uint64_t)>& hash) {
  // Host bytes are hashed where they lie, a step at a time; GPU bytes through the pinned
  // scratch, a step at a time.
  const uint64_t step = device.is_cuda() ? kGpuStepBytes : kHostStepBytes;
  if (device.is_cuda() && scratch_.size() == 0) scratch_ = Buffer(Device{}, kGpuStepBytes, HostMemory::kPinned);
  for (uint64_t done = 0; done < bytes; done += step) {
    const uint64_t length = std::min(step, bytes - done);
    const std::byte* piece = data + done;
    if (device.is_cuda()) {
      copy_bytes(scratch_.data(), Device{}, piece, device, length);
      piece = scratch_.data();
    }
    hash(piece, length);
  }
}

PieceDigests::PieceDigests(uint64_t piece_bytes, uint64_t bytes, std::span<const std::pair<uint64_t, uint64_t>> ranges)
    : piece_bytes_(piece_bytes), bytes_(bytes) {
  for (auto [begin, end] : ranges) {
    for (uint64_t index = begin / piece_bytes; index * piece_bytes < std::min(end, bytes); ++index) {
      indices_.push_back(index);
    }
  }
  std::sort(indices_.begin(), indices_.end());
  indices_.erase(std::unique(indices_.begin(), indices_.end()), indices_.end());
  digests_.assign(indices_.size(), 0);
}

std::pair<uint64_t, uint64_t> PieceDigests::range(size_t k) const noexcept {
  const uint64_t offset = indices_[k] * piece_bytes_;
  return {offset, std::min(piece_bytes_, bytes_ - offset)};
}

void PieceDigests::landed(size_t k, const std::byte* data) noexcept {
  const auto [offset, size] = range(k);
  digests_[k] = XXH64(data + offset, size, 0);
  ++landed_;
}

}  // namespace weightstream::transfer
