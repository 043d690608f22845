#pragma once
// The update protocol's wire format, version 9. Every message is a frame: a 16-byte header
// followed by a body of `length` bytes. All integers are little-endian.
//
//   header: magic u32 ("WSUP"), version u16, type u16, length u64 (<= kMaxMessageBytes)
//   string: u32 length, then that many bytes (no terminator)
//   blob:   u32 length, then that many bytes
//
//   (a connection opens with the handshake of handshake.hpp: the token is proven, never sent)
//   HELLO   (sender -> receiver)  transport u8, bucket_bytes u64, receivers u32 (the
//                                 receivers this sender feeds at once), receiver_index u32 (this
//                                 one's, below receivers), blob (NCCL unique id)
//   WELCOME (receiver -> sender)  bucket_bytes u64, slots u32, blob (CUDA IPC handles; ucx: the
//                                 worker address, the buckets' and counts' addresses and keys); shm passes
//                                 the bucket memfd with this message (SCM_RIGHTS)
//   REFUSE  (receiver -> sender)  reason string; the receiver then closes
//   START   (sender -> receiver)  format u8 (0 checkpoint, 1 engine), delta u8 (0 full, 1
//                                 delta), base string (the version a delta applies to; empty
//                                 for a full update), target string (the version after it, or
//                                 empty), then the update's
//                                 manifest: count u32, then per tensor: name string, dtype u8,
//                                 rank u8, rank x i64 dims (each name once)
//   ACCEPTED (receiver -> sender) the manifest fits the model, buckets may come (a manifest
//                                 refused is answered by ERROR instead): count u32 (0 for a full
//                                 update; a delta's: its declared tensors), then per declared
//                                 tensor the windows this receiver holds (delta.hpp): windows
//                                 u32, then per window row_begin, rows, column_begin, columns u64
//   BUCKET  (sender -> receiver)  index u64, slot u32, bytes u64, regions u32, then per region
//                                 shared for the first time: id u32, bytes u64, blob (handle);
//                                 then count u32, then per entry: name string, dtype u8,
//                                 rank u8, rank x i64 dims, tensor_offset u64, source u32
//                                 (0 bucket buffer, r + 1 region r), source_offset u64,
//                                 bytes u64, encoding u8 (0 the tensor's bytes, 1 its changed
//                                 elements: delta.hpp; the whole tensor, in the bucket buffer).
//                                 TCP: `bytes` bytes of payload follow the frame.
//   APPLIED (receiver -> sender)  index u64, slot u32: the slot may be refilled (a bucket with
//                                 no buffer bytes occupies no slot: nothing to refill)
//   FINISH  (sender -> receiver)  buckets u64, count u32, then per tensor of a delta sent as
//                                 changed elements: its index in the manifest u32, the
//                                 windows_digest u64 of this receiver's windows of it
//   REPORT  (receiver -> sender)  buckets, tensors, bytes, shared_bytes, placed_bytes, regions,
//                                 sparse_tensors, dense_tensors, checked_tensors u64, seconds,
//                                 connect_seconds f64, ten phases f64 (preparing,
//                                 first_bucket, waiting, parsing, opening, checking, copying,
//                                 finishing, verifying, closing), six counters u64,
//                                 count u32, count x i64 completed layers
//   ERROR   (either way)          code u8 (ErrorCode), message string; the update is over
//                                 (from the sender: it abandons the update)
//
// Every field read from a peer is hostile input: lengths are checked against the bytes
// left and against limits before anything is allocated, so a parser never reads out of
// bounds or allocates more than the frame's own size.
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "net/frame.hpp"
#include "net/handshake.hpp"
#include "net/socket.hpp"
#include "update/delta.hpp"
#include "weightstream/error.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream::transfer {

/// How a bucket entry carries its tensor.
enum class EntryEncoding : uint8_t {
  kBytes = 0,            ///< bytes [tensor_offset, tensor_offset + bytes) of the tensor
  kChangedElements = 1,  ///< the whole tensor's changed elements (delta.hpp)
};

/// One tensor (or one piece of it) in a bucket.
struct BucketEntry {
  std::string name;
  Dtype dtype = Dtype::kBF16;
  std::vector<int64_t> shape;
  uint64_t tensor_offset = 0;  ///< where the piece starts within the tensor's bytes
  /// Where the bytes are: 0, the bucket buffer; r + 1, shared region r (CUDA IPC only: the
  /// receiver reads the sender's own allocation in place, so each byte is copied once).
  uint32_t source = 0;
  uint64_t source_offset = 0;  ///< where the piece starts within its source
  uint64_t bytes = 0;          ///< bytes of the piece
  EntryEncoding encoding = EntryEncoding::kBytes;
};

/// A device allocation of the sender that the receiver may read in place (CUDA IPC): shared
/// the first time a bucket refers to it, opened once by the receiver, closed at the end of
/// the update.
struct SharedRegion {
  uint32_t id = 0;                  ///< 0, 1, 2... in the order they are shared
  uint64_t bytes = 0;               ///< size of the allocation
  std::vector<std::byte> handle;    ///< the transport's handle (a cudaIpcMemHandle_t)
};

/// What a bucket holds: its sequence number (from 0), the buffer it occupies, the regions
/// it shares for the first time, its entries.
struct BucketManifest {
  uint64_t index = 0;
  uint32_t slot = 0;          ///< which of the two bucket buffers (unused when `bytes` is 0)
  uint64_t bytes = 0;         ///< bytes used in the buffer
  std::vector<SharedRegion> regions;
  std::vector<BucketEntry> entries;
};

inline constexpr uint32_t kMagic = 0x50555357;  // "WSUP" read as little-endian bytes
// 4: a ucx WELCOME carries the rendezvous secret; 5: REPORT carries placed_bytes (and a ucx
// piece's header its bucket); 6: the handshake (handshake.hpp) proves the token, HELLO
// no longer carries it; 7: START carries the update's manifest, answered by ACCEPTED; 8: START
// names its versions (delta updates), entries their encoding, REPORT sparse and dense tensors;
// 9: ACCEPTED lists the receiver's windows, FINISH the digests of them, REPORT checked tensors
inline constexpr uint16_t kProtocolVersion = 9;
inline constexpr size_t kHeaderBytes = kFrameHeaderBytes;
/// The handshake of the update protocol (net/handshake.hpp); the peer protocol's is kPeerHandshake.
inline constexpr HandshakeProtocol kUpdateHandshake{kMagic, kProtocolVersion, "update", "sender"};
/// Largest message body: a manifest of 100,000 entries with long names fits easily.
inline constexpr uint64_t kMaxMessageBytes = 64ull << 20;
inline constexpr uint32_t kMaxNameBytes = 4096;
inline constexpr uint32_t kMaxTextBytes = 64 << 10;
inline constexpr uint32_t kMaxBlobBytes = 64 << 10;
inline constexpr uint32_t kMaxEntries = 1 << 20;
inline constexpr uint32_t kMaxLayers = 1 << 20;
/// Regions one update may share (a trainer's parameters live in a few large allocations).
inline constexpr uint32_t kMaxRegions = 1 << 16;
inline constexpr uint32_t kMaxHandleBytes = 256;
/// Receivers one sender may feed at once (one NCCL communicator of them all plus the sender).
inline constexpr uint32_t kMaxReceivers = 1024;

enum class MessageType : uint16_t {
  kHello = 1,
  kWelcome = 2,
  kRefuse = 3,
  kStart = 4,
  kBucket = 5,
  kApplied = 6,
  kFinish = 7,
  kReport = 8,
  kError = 9,
  kAccepted = 10,
};

/// `text` cut to what a REFUSE or ERROR message carries (kMaxTextBytes), marked where cut: a
/// refusal listing twenty 4 KiB tensor names still reaches the peer.
std::string message_text(std::string text);

/// "HELLO", "BUCKET", ...; "unknown" for a value outside the enum.
std::string_view message_type_name(MessageType type) noexcept;

struct FrameHeader {
  uint16_t version = kProtocolVersion;
  MessageType type = MessageType::kError;
  uint64_t length = 0;
};

/// One decoded message; only the fields of its type are set.
struct Message {
  MessageType type = MessageType::kError;
  // HELLO
  TransportKind transport = TransportKind::kTcp;
  uint32_t receivers = 1;       ///< receivers the sender feeds at once (NCCL: one broadcast to all)
  uint32_t receiver_index = 0;  ///< this receiver's place among them (NCCL rank - 1)
  // HELLO, WELCOME
  uint64_t bucket_bytes = 0;
  std::vector<std::byte> blob;
  // WELCOME
  uint32_t slots = 0;
  // START
  TensorFormat format = TensorFormat::kCheckpoint;
  std::vector<DeclaredTensor> declared;  ///< the update's manifest
  UpdateVersions versions;               ///< base set: a delta update
  // BUCKET (manifest), APPLIED (index, slot)
  BucketManifest manifest;
  // ACCEPTED of a delta update: the receiver's windows of each declared tensor, in order
  std::vector<std::vector<HeldWindow>> held;
  // FINISH
  uint64_t buckets = 0;
  /// A delta's: (index in the manifest, windows_digest of the receiver's windows) of each
  /// tensor sent as changed elements.
  std::vector<std::pair<uint32_t, uint64_t>> digests;
  // REPORT
  UpdateReport report;
  // REFUSE, ERROR
  ErrorCode code = ErrorCode::kProtocol;
  std::string text;
};

/// The 16 header bytes of a frame with a body of `length` bytes.
std::array<std::byte, kHeaderBytes> encode_header(MessageType type, uint64_t length);
/// Parses a frame header. Throws Error(kProtocol) naming `peer` on a wrong magic, an
/// unsupported version, an unknown type or a length over kMaxMessageBytes.
FrameHeader parse_header(std::span<const std::byte> bytes, const std::string& peer);

/// The body of `message` (its type decides which fields are written).
std::vector<std::byte> encode_body(const Message& message);
/// Parses the body of a frame of type `type`. Throws Error(kProtocol) naming `peer`, the
/// message and the field on any truncated, oversized or invalid field, or trailing bytes.
/// A BUCKET's entries are checked for themselves (known dtype, shape within kMaxTensorRank
/// with a valid byte size, piece inside its tensor, a bucket-buffer piece inside the
/// bucket's `bytes`); its new regions must be numbered consecutively. Whether an entry's
/// region exists and holds its bytes is the receiver's check (regions span buckets). A
/// START's declared tensors likewise (non-empty name within kMaxNameBytes, known dtype,
/// rank within kMaxTensorRank, a valid byte size; the count bounded by the bytes left
/// before anything is reserved); whether they fit the model, and repeats, are the
/// receiver's checks.
Message parse_body(MessageType type, std::span<const std::byte> body, const std::string& peer);

/// A message received, with the descriptor that came with it (if any).
struct Received {
  Message message;
  FileDescriptor fd;
  double parse_seconds = 0;  ///< of the time receive_message() took, decoding the body
};

/// Sends one message on `connection`; `pass_fd` >= 0 is passed with it (Unix sockets only).
void send_message(Connection& connection, const Message& message, std::chrono::milliseconds timeout,
                  int pass_fd = -1);
/// Receives one message. `awaiting` says what for ("bucket 3 or FINISH") in errors.
/// Throws Error(kTimeout) after `timeout` of silence, Error(kNetwork) when the peer
/// closes or resets, Error(kProtocol) for a malformed frame.
Received receive_message(Connection& connection, std::chrono::milliseconds timeout, const std::string& awaiting);

}  // namespace weightstream::transfer
