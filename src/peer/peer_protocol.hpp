#pragma once
// The peer control protocol, on a TCP connection to the serving peer (net/socket.hpp). Every
// message is a frame (net/frame.hpp): magic u32 ("WSPE"), version u16, type u16, length u64,
// then `length` bytes of JSON. Bulk bytes never travel here: they move over UCX, read one-sided
// (ucp_get) where the puller's endpoint has native RMA, else sent by the server's UCX
// worker in answer to the puller's requests (ucx.hpp: a tagged send straight from the
// registered parameter, received straight into the puller's destination; the request
// carries the manifest's send_secret).
//
//   (a connection opens with the handshake of handshake.hpp: the token is proven, never sent)
//   HELLO    (puller -> server)  {}; the server answers MANIFEST or REFUSE
//   MANIFEST (server -> puller)  the PeerManifest (binary fields as hex)
//   REFUSE   (server -> puller)  {"reason"}; the server then closes
//   VERSION  (puller -> server)  {}; the server answers VERSION {"version", "updating"}
//
// Every message from a peer is hostile input: the length is bounded before anything is
// allocated, and the JSON is checked field by field (a missing or mistyped field is
// Error(kProtocol) naming the peer and the field).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "net/frame.hpp"
#include "net/handshake.hpp"
#include "net/socket.hpp"
#include "weightstream/device.hpp"
#include "weightstream/peer.hpp"

namespace weightstream::transfer {

enum class PeerMessage : uint16_t { kHello = 1, kManifest = 2, kRefuse = 3, kVersion = 4 };

inline constexpr uint32_t kPeerMagic = 0x45505357;  // "WSPE" read as little-endian bytes
// 2: the manifest carries send_secret; 3: and ucx_segment_bytes; 5: the handshake
// (handshake.hpp) proves the token, HELLO no longer carries it; 6: the manifest carries
// content_digest
inline constexpr uint16_t kPeerProtocolVersion = 6;
inline constexpr HandshakeProtocol kPeerHandshake{kPeerMagic, kPeerProtocolVersion, "peer", "puller"};
/// The pieces a server hashes each parameter in besides the whole (PeerParameter::piece_xxh64),
/// and a puller reads host memory in: half a UCX tcp receive segment, so a piece arrives whole
/// in one segment and is still in the cache when it is hashed. Reads of 1 MiB or 8 MiB were
/// hashed from memory instead, 256 KiB reads cost more in messages than they saved
/// (bench/RESULTS.md).
inline constexpr uint64_t kPeerDigestPieceBytes = 512ull << 10;
/// Largest message: the manifest of a rank with 100,000 parameters fits.
inline constexpr uint64_t kMaxPeerMessageBytes = 512ull << 20;

struct PeerFrame {
  PeerMessage type = PeerMessage::kRefuse;
  nlohmann::json body;
};

/// Sends one message.
void send_peer_message(Connection& connection, PeerMessage type, const nlohmann::json& body,
                       std::chrono::milliseconds timeout);
/// Receives one message of at most `max_bytes`. Throws Error(kProtocol) naming the peer for
/// a bad frame or JSON, or a longer one (refused before anything is allocated),
/// Error(kTimeout)/Error(kNetwork) as Connection does.
PeerFrame receive_peer_message(Connection& connection, std::chrono::milliseconds timeout, const std::string& awaiting,
                               uint64_t max_bytes = kMaxPeerMessageBytes);

nlohmann::json manifest_json(const PeerManifest& manifest);
/// Parses a manifest. Throws Error(kProtocol) naming `peer` and the field.
PeerManifest parse_manifest(const nlohmann::json& json, const std::string& peer);

std::string to_hex(std::span<const std::byte> bytes);
/// True for a content digest as published: 16 lowercase hex digits.
bool is_content_digest(std::string_view text) noexcept;
std::vector<std::byte> from_hex(std::string_view text, const std::string& what);

/// xxh64 (seed 0) of parameters' bytes: the manifest's digests, and a pull's checks of what
/// landed. GPU memory is read back in bounded pieces (64 MiB) into one pinned host buffer,
/// allocated at the first GPU digest and reused by every later one (a pageable copy out of
/// the GPU runs at a fraction of the link, and pinning per call costs more than the copy).
class ParameterDigester {
 public:
  /// `between`, when given, runs after every few MiB hashed: a puller turns its UCX worker
  /// there, so the reads in flight go on landing while a parameter is checked.
  uint64_t digest(const std::byte* data, const Device& device, uint64_t bytes,
                  const std::function<void()>& between = {});
  /// The digest of the whole, and in `pieces` the xxh64 of each `piece_bytes` piece (a
  /// divisor of both step sizes: a power of two up to 4 MiB), in one pass.
  uint64_t digest(const std::byte* data, const Device& device, uint64_t bytes, uint64_t piece_bytes,
                  std::vector<uint64_t>& pieces);

  static constexpr uint64_t kHostStepBytes = 4ull << 20;
  static constexpr uint64_t kGpuStepBytes = 64ull << 20;

 private:
  /// Hands `hash` the bytes a step at a time (GPU bytes copied into the scratch first).
  void digest_steps(const std::byte* data, const Device& device, uint64_t bytes,
                    const std::function<void(const std::byte*, uint64_t)>& hash);
  Buffer scratch_;
};

/// The digest pieces of a served parameter that a puller reads into host memory (all of
/// them, or those that hold the ranges it needs), each hashed as it lands, inside UCX's
/// completion of its read, while its bytes are still in this core's cache.
class PieceDigests {
 public:
  /// The pieces of `piece_bytes` of a `bytes`-byte parameter that hold any of `ranges`
  /// ([begin, end) byte offsets).
  PieceDigests(uint64_t piece_bytes, uint64_t bytes, std::span<const std::pair<uint64_t, uint64_t>> ranges);
  /// How many pieces are read; offset and size of the k-th, and its index among the
  /// parameter's pieces (for PeerParameter::piece_xxh64).
  size_t size() const noexcept { return indices_.size(); }
  std::pair<uint64_t, uint64_t> range(size_t k) const noexcept;
  uint64_t index(size_t k) const noexcept { return indices_[k]; }
  /// The k-th piece has landed in `data` (the whole parameter's memory). Never throws: it
  /// runs inside UCX's progress, as an Endpoint::Landed.
  void landed(size_t k, const std::byte* data) noexcept;
  /// Pieces landed so far (a counter for Endpoint::wait_until), and the k-th one's xxh64.
  const uint64_t& landed_count() const noexcept { return landed_; }
  uint64_t digest(size_t k) const noexcept { return digests_[k]; }

 private:
  uint64_t piece_bytes_;
  uint64_t bytes_;
  std::vector<uint64_t> indices_;  // of the pieces read, ascending
  std::vector<uint64_t> digests_;  // of each piece read, once landed
  uint64_t landed_ = 0;
};

}  // namespace weightstream::transfer
