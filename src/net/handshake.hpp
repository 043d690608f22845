#pragma once
// The one handshake of both protocols on a socket (the update protocol, update/wire.hpp, and
// the peer control protocol, peer/peer_protocol.hpp): a mutual proof of a shared token that never
// crosses the wire, run on a fresh connection before the protocol's own HELLO. Its records
// share the protocols' 16-byte frame header (frame.hpp: magic u32, version u16, type u16, length u64),
// with the protocol's magic and version, so that a peer of another version fails at its
// first record with a version error on both sides.
//
//   AUTH_HELLO     (client -> server)  client_nonce[32]
//   AUTH_CHALLENGE (server -> client)  mode u8 (0: proves a token, 1: open listener),
//                                      server_nonce[32], server_proof[32] (zeros when open)
//   AUTH_PROOF     (client -> server)  client_proof[32] (zeros for an open listener)
//   AUTH_RESULT    (server -> client)  accepted u8, reason: u16 length, bytes
//
//   proof(role) = HMAC-SHA256(token, label || client_nonce || server_nonce || role)
//   label = "weightstream <protocol> protocol <version>", role = "server" or "client"
//
// The server proves first, and the client checks that proof before it sends anything
// derived from its token: a client facing a server without the token (or an open one while
// it holds a token) stops there and says so. Nonces are fresh from both sides (RAND_bytes),
// so a proof recorded on one connection is worthless on another. Proofs are compared in
// constant time (CRYPTO_memcmp). A stranger costs the server fixed-size records only and
// one whole-handshake deadline.
//
// Note: a connecting party receives the server's proof for nonces it chose, so it can test
// guesses of a weak token offline: tokens should be random (`openssl rand -hex 32`).
#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "net/frame.hpp"
#include "net/socket.hpp"

namespace weightstream::transfer {

/// Which protocol a handshake opens: its frame magic and version, and the label its proofs
/// are bound to.
struct HandshakeProtocol {
  uint32_t magic = 0;
  uint16_t version = 0;
  std::string_view name;    ///< "update" or "peer", for the label and messages
  std::string_view client;  ///< what its client is called in messages: "sender", "puller"
};

// The update protocol's is kUpdateHandshake (update/wire.hpp); the peer protocol's is
// kPeerHandshake (peer/peer_protocol.hpp).

inline constexpr size_t kHandshakeNonceBytes = 32;
inline constexpr size_t kHandshakeProofBytes = 32;  // SHA-256
using HandshakeNonce = std::array<std::byte, kHandshakeNonceBytes>;
using HandshakeProof = std::array<std::byte, kHandshakeProofBytes>;

/// Frame types of the handshake records (outside both protocols' own message types).
enum class HandshakeRecord : uint16_t { kHello = 0x4801, kChallenge = 0x4802, kProof = 0x4803, kResult = 0x4804 };

/// What a listener requires of the peers that connect.
struct ListenerAuth {
  std::string token;              ///< non-empty unless `open`
  bool open = false;  ///< accepts any peer (asked for in so many words)
};

/// The one rule for every listener (peer server, update receiver): a non-empty token, or
/// `open_without_token` asked for explicitly, and not both. `listener` names it in messages
/// ("peer server on 127.0.0.1:7000"). Throws Error(kInvalidArgument); an open listener is
/// announced by one warning on stderr, here.
ListenerAuth listener_auth(const std::string& token, bool open_without_token, const std::string& listener);
/// The same rule without the warning: what weightstream::require_listener_token
/// (weightstream/transfer.hpp) checks. Throws Error(kInvalidArgument).
void check_listener_token(const std::string& token, bool open_without_token, const std::string& listener);

/// A fresh random nonce (OpenSSL RAND_bytes). Throws Error(kInternal) when the generator fails.
HandshakeNonce fresh_nonce();

/// HMAC-SHA256(token, label || client_nonce || server_nonce || role).
HandshakeProof handshake_proof(const HandshakeProtocol& protocol, std::string_view token,
                               const HandshakeNonce& client_nonce, const HandshakeNonce& server_nonce,
                               std::string_view role);

/// Client side, on a fresh connection: proves the token to the server and checks the
/// server's proof first. `token` empty: accepted only by an open listener. `what` names the
/// server in messages ("receiver at 10.0.0.5:41877"). Throws Error(kPermission) when the
/// server cannot prove the token, requires one this side lacks, or refuses this side's
/// proof (its reason in the message); Error(kProtocol) for another protocol or version;
/// Error(kTimeout)/Error(kNetwork) as Connection does, all within `timeout` in total.
void prove_to_server(Connection& connection, const HandshakeProtocol& protocol, std::string_view token,
                     std::chrono::milliseconds timeout, const std::string& what);

/// How long a stranger has for its whole side of the handshake on a peer server, from the
/// moment it is accepted (an update receiver takes ReceiverOptions::handshake_timeout).
inline constexpr std::chrono::milliseconds kHandshakeTimeout{5'000};
/// Connections a listener holds mid-handshake at once. One more evicts the oldest (the one
/// nearest its deadline), so a flood of idle strangers cannot lock a real peer out for long:
/// each costs the listener one socket, a 48-byte record buffer and a deadline.
inline constexpr size_t kMaxHandshakingConnections = 64;

/// Logs, once, on stderr, that `listener` dropped `connection` before (or at) its first
/// request: "weightstream: refused a connection from ADDR to LISTENER: REASON". `reason` is
/// an error's text; a leading "PEER: " naming the connection again is left out.
void log_refused(const Connection& connection, const std::string& listener, const std::string& reason);

/// Server side of one connection, a record at a time, so a server that hears many
/// connections from one thread (poll) never waits on one of them. Before the client has
/// proven the token it costs this fixed-size record buffer only: lengths are checked
/// against the record expected before a byte of the body is read.
class ServerHandshake {
 public:
  ServerHandshake(const HandshakeProtocol& protocol, const ListenerAuth& auth);
  /// Reads the client's next record (all of it must come within `timeout`) and answers it.
  /// True once the client has proven the token (or the listener is open). Throws
  /// Error(kPermission) when the client cannot prove it, Error(kProtocol) for another
  /// protocol or version (the client is told why first, where it speaks one), as
  /// Connection does for a silent or vanished client.
  bool step(Connection& connection, std::chrono::milliseconds timeout);
  /// Runs every step on a blocking connection, within `timeout` in total.
  void run(Connection& connection, std::chrono::milliseconds timeout);
  /// Never waits for the client: takes what has arrived (never a byte past the handshake)
  /// and answers each record once it is whole. True once the client has proven the token.
  /// Throws as step() does, Error(kNetwork) when the client has closed; `send_timeout`
  /// bounds the answers (records of a few dozen bytes, which a fresh socket always takes).
  bool advance(Connection& connection, std::chrono::milliseconds send_timeout);
  bool done() const noexcept { return done_; }
  /// True once any byte of the handshake has come (a port probe that closes at once has sent none).
  bool heard() const noexcept { return challenged_ || have_ > 0; }

 private:
  /// Answers the whole record in `record_`.
  void answer(Connection& connection, std::chrono::milliseconds timeout);
  void refuse(Connection& connection, std::chrono::milliseconds timeout, const std::string& reason);
  HandshakeProtocol protocol_;
  const ListenerAuth* auth_;
  HandshakeNonce client_nonce_{};
  HandshakeNonce server_nonce_{};
  std::array<std::byte, kFrameHeaderBytes + std::max(kHandshakeNonceBytes, kHandshakeProofBytes)> record_{};
  size_t have_ = 0;  // bytes of the current record in record_
  bool challenged_ = false;
  bool done_ = false;
};

}  // namespace weightstream::transfer
