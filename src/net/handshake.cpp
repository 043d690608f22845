// The mutual token proof both protocols open a connection with (handshake.hpp).
#include "net/handshake.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <vector>

#include "base/text.hpp"
#include "weightstream/error.hpp"

namespace weightstream::transfer {
namespace {

using Clock = std::chrono::steady_clock;

/// Largest handshake record body: a result with its reason.
constexpr uint64_t kMaxRecordBytes = 1024;
constexpr uint8_t kModeProves = 0;
constexpr uint8_t kModeOpen = 1;

std::string_view record_name(HandshakeRecord type) {
  switch (type) {
    case HandshakeRecord::kHello: return "AUTH_HELLO";
    case HandshakeRecord::kChallenge: return "AUTH_CHALLENGE";
    case HandshakeRecord::kProof: return "AUTH_PROOF";
    case HandshakeRecord::kResult: return "AUTH_RESULT";
  }
  return "unknown";
}

std::chrono::milliseconds left_until(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

/// The header of a record, read from its first kFrameHeaderBytes bytes.
FrameFields header_of(const std::byte* record) {
  return decode_frame_header(std::span<const std::byte, kFrameHeaderBytes>(record, kFrameHeaderBytes));
}

void send_record(Connection& connection, const HandshakeProtocol& protocol, HandshakeRecord type,
                 std::span<const std::byte> body, std::chrono::milliseconds timeout) {
  const std::vector<std::byte> frame =
      encode_frame(protocol.magic, protocol.version, static_cast<uint16_t>(type), body);
  connection.send_bytes(frame, timeout, "the handshake's " + std::string(record_name(type)));
}

/// What went wrong with a record's header, or empty when it is the record expected.
struct HeaderCheck {
  std::string problem;
  bool other_version = false;  ///< same protocol, another version: worth telling the peer
};

HeaderCheck check_header(const std::byte* header, const HandshakeProtocol& protocol, HandshakeRecord expected,
                         uint64_t body_bytes, bool exact) {
  const auto [magic, version, type, length] = header_of(header);
  if (magic != protocol.magic) return {"does not speak the weightstream " + std::string(protocol.name) + " protocol (bad magic)"};
  if (version != protocol.version) {
    return {"speaks " + std::string(protocol.name) + " protocol version " + std::to_string(version) +
                ", this build speaks " + std::to_string(protocol.version) + " (upgrade both ends to the same release)",
            true};
  }
  if (type != static_cast<uint16_t>(expected)) {
    return {"sent message type " + std::to_string(type) + " where the handshake's " +
            std::string(record_name(expected)) + " belongs"};
  }
  if (exact ? length != body_bytes : length > body_bytes) {
    return {"sent a " + std::to_string(length) + "-byte " + std::string(record_name(expected)) + " (expected " +
            (exact ? "" : "at most ") + std::to_string(body_bytes) + ")"};
  }
  return {};
}

}  // namespace

void check_listener_token(const std::string& token, bool open_without_token, const std::string& listener) {
  WS_EXPECT(!(open_without_token && !token.empty()), ErrorCode::kInvalidArgument,
            listener + ": both a token and an open listener (open_without_token) were asked for; give one of them");
  WS_EXPECT(open_without_token || !token.empty(), ErrorCode::kInvalidArgument,
            listener + " refuses to start without a token: give it a non-empty token (C++ `token`, Python `token=`, "
                       "CLI --token-stdin or WEIGHTSTREAM_PEER_TOKEN), or ask for an open listener in so many words "
                       "(C++ `open_without_token`, Python `open_without_token=True`, CLI --open-without-token)");
}

ListenerAuth listener_auth(const std::string& token, bool open_without_token, const std::string& listener) {
  check_listener_token(token, open_without_token, listener);
  if (open_without_token) {
    std::cerr << "weightstream: warning: " << listener
              << " listens without a token (open_without_token): anyone who can reach it is accepted\n"
              << std::flush;
  }
  return ListenerAuth{token, open_without_token};
}

void log_refused(const Connection& connection, const std::string& listener, const std::string& reason) {
  // Errors name the connection first ("tcp peer A: it ...", "tcp peer A disconnected ..."):
  // the line names it already.
  std::string text = reason;
  const std::string& named = connection.peer();
  if (text.starts_with(named + ": ")) {
    text.erase(0, named.size() + 2);
  } else if (text.starts_with(named + " ")) {
    text.replace(0, named.size(), "it");
  }
  std::cerr << "weightstream: refused a connection from " + connection.address() + " to " + listener + ": " + text + "\n"
            << std::flush;
}

HandshakeNonce fresh_nonce() {
  HandshakeNonce nonce;
  WS_EXPECT(RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) == 1,
            ErrorCode::kInternal, "cannot draw a handshake nonce: OpenSSL's RAND_bytes failed");
  return nonce;
}

HandshakeProof handshake_proof(const HandshakeProtocol& protocol, std::string_view token,
                               const HandshakeNonce& client_nonce, const HandshakeNonce& server_nonce,
                               std::string_view role) {
  const std::string label =
      "weightstream " + std::string(protocol.name) + " protocol " + std::to_string(protocol.version);
  std::vector<unsigned char> message;
  message.reserve(label.size() + 1 + 2 * kHandshakeNonceBytes + role.size());
  message.insert(message.end(), label.begin(), label.end());
  message.push_back(0);  // the label's end: no label is a prefix of another's input
  for (const HandshakeNonce* nonce : {&client_nonce, &server_nonce}) {
    for (std::byte byte : *nonce) message.push_back(static_cast<unsigned char>(byte));
  }
  message.insert(message.end(), role.begin(), role.end());
  HandshakeProof proof{};
  unsigned int length = 0;
  const unsigned char* made = HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), message.data(),
                                   message.size(), reinterpret_cast<unsigned char*>(proof.data()), &length);
  WS_EXPECT(made != nullptr && length == proof.size(), ErrorCode::kInternal, "HMAC-SHA256 of the handshake failed");
  return proof;
}

namespace {

bool same_proof(const HandshakeProof& a, const std::byte* b) {
  return CRYPTO_memcmp(a.data(), b, a.size()) == 0;
}

}  // namespace

void prove_to_server(Connection& connection, const HandshakeProtocol& protocol, std::string_view token,
                     std::chrono::milliseconds timeout, const std::string& what) {
  const auto deadline = Clock::now() + timeout;
  const HandshakeNonce client_nonce = fresh_nonce();
  send_record(connection, protocol, HandshakeRecord::kHello, client_nonce, timeout);

  // The challenge, or the result of a server that refuses at once (another version).
  std::byte header[kFrameHeaderBytes];
  connection.receive_bytes(header, left_until(deadline), "the handshake's AUTH_CHALLENGE");
  if (const FrameFields first = header_of(header);
      first.type == static_cast<uint16_t>(HandshakeRecord::kResult) && first.magic == protocol.magic) {
    const uint64_t length = first.length;
    std::string reason(std::min<uint64_t>(length, kMaxRecordBytes), '\0');
    if (length >= 3 && length <= kMaxRecordBytes) {
      connection.receive_bytes(std::as_writable_bytes(std::span(reason)), left_until(deadline),
                               "the handshake's AUTH_RESULT");
      reason = reason.substr(3);
    } else {
      reason = "no reason given";
    }
    WS_FAIL(ErrorCode::kProtocol, what + " refused this " + std::string(protocol.client) + ": " + reason);
  }
  constexpr uint64_t kChallengeBytes = 1 + kHandshakeNonceBytes + kHandshakeProofBytes;
  HeaderCheck check = check_header(header, protocol, HandshakeRecord::kChallenge, kChallengeBytes, true);
  WS_EXPECT(check.problem.empty(), ErrorCode::kProtocol, what + " " + check.problem);
  std::array<std::byte, kChallengeBytes> challenge;
  connection.receive_bytes(challenge, left_until(deadline), "the handshake's AUTH_CHALLENGE");
  const auto mode = static_cast<uint8_t>(challenge[0]);
  HandshakeNonce server_nonce;
  std::memcpy(server_nonce.data(), challenge.data() + 1, server_nonce.size());
  WS_EXPECT(mode == kModeProves || mode == kModeOpen, ErrorCode::kProtocol,
            what + " sent an AUTH_CHALLENGE of unknown mode " + std::to_string(mode));

  HandshakeProof proof{};
  if (mode == kModeOpen) {
    // An open listener proves nothing: one that holds a token never claims to be open.
    WS_EXPECT(token.empty(), ErrorCode::kPermission,
              what + " could not prove the token: it says it listens without one, and this side holds a token "
                     "(nothing derived from the token was sent)");
  } else {
    WS_EXPECT(!token.empty(), ErrorCode::kPermission,
              what + " requires a token, and this side has none (give it with --token-stdin, "
                     "WEIGHTSTREAM_PEER_TOKEN or the `token` option)");
    const HandshakeProof expected = handshake_proof(protocol, token, client_nonce, server_nonce, "server");
    WS_EXPECT(same_proof(expected, challenge.data() + 1 + kHandshakeNonceBytes), ErrorCode::kPermission,
              what + " could not prove the token: it holds another token, or is not the server meant "
                     "(nothing derived from this side's token was sent)");
    proof = handshake_proof(protocol, token, client_nonce, server_nonce, "client");
  }
  send_record(connection, protocol, HandshakeRecord::kProof, proof, left_until(deadline));

  connection.receive_bytes(header, left_until(deadline), "the handshake's AUTH_RESULT");
  check = check_header(header, protocol, HandshakeRecord::kResult, kMaxRecordBytes, false);
  WS_EXPECT(check.problem.empty(), ErrorCode::kProtocol, what + " " + check.problem);
  const uint64_t length = header_of(header).length;
  WS_EXPECT(length >= 3, ErrorCode::kProtocol, what + " sent a truncated AUTH_RESULT");
  std::vector<std::byte> result(length);
  connection.receive_bytes(result, left_until(deadline), "the handshake's AUTH_RESULT");
  if (static_cast<uint8_t>(result[0]) == 1) return;
  const uint16_t stated = static_cast<uint16_t>(static_cast<uint16_t>(result[1]) | static_cast<uint16_t>(result[2]) << 8);
  const uint64_t reason_bytes = std::min<uint64_t>(stated, length - 3);
  const std::string reason(reinterpret_cast<const char*>(result.data() + 3), reason_bytes);
  WS_FAIL(ErrorCode::kPermission, what + " refused this " + std::string(protocol.client) + ": " + reason);
}

ServerHandshake::ServerHandshake(const HandshakeProtocol& protocol, const ListenerAuth& auth)
    : protocol_(protocol), auth_(&auth) {}

void ServerHandshake::refuse(Connection& connection, std::chrono::milliseconds timeout, const std::string& reason) {
  const std::string text = reason.substr(0, kMaxRecordBytes - 3);
  std::vector<std::byte> body(3 + text.size());
  body[0] = std::byte{0};
  body[1] = static_cast<std::byte>(text.size() & 0xff);  // the reason's length, u16 little-endian
  body[2] = static_cast<std::byte>(text.size() >> 8);
  std::memcpy(body.data() + 3, text.data(), text.size());
  try {
    send_record(connection, protocol_, HandshakeRecord::kResult, body, timeout);
  } catch (const Error&) {
    // The client may already be gone; the refusal is reported here either way.
  }
}

bool ServerHandshake::advance(Connection& connection, std::chrono::milliseconds send_timeout) {
  while (!done_) {
    const HandshakeRecord expected = challenged_ ? HandshakeRecord::kProof : HandshakeRecord::kHello;
    const size_t body_bytes = challenged_ ? kHandshakeProofBytes : kHandshakeNonceBytes;
    const size_t want = have_ < kFrameHeaderBytes ? kFrameHeaderBytes : kFrameHeaderBytes + body_bytes;
    const size_t got = connection.receive_ready(std::span(record_).subspan(have_, want - have_),
                                                "the handshake's " + std::string(record_name(expected)));
    if (got == 0) return false;
    have_ += got;
    if (have_ == kFrameHeaderBytes) {
      // The header alone decides whether a body follows: its length is checked before any of it is read.
      const HeaderCheck check = check_header(record_.data(), protocol_, expected, body_bytes, true);
      if (!check.problem.empty()) {
        // A peer of another version hears this side's version in the refusal's header.
        if (check.other_version) {
          refuse(connection, send_timeout,
                 "it speaks " + std::string(protocol_.name) + " protocol version " + std::to_string(protocol_.version) +
                     ", this side version " + std::to_string(header_of(record_.data()).version) +
                     " (upgrade both ends to the same release)");
        }
        WS_FAIL(ErrorCode::kProtocol, connection.peer() + ": it " + check.problem);
      }
    }
    if (have_ == kFrameHeaderBytes + body_bytes) {
      have_ = 0;
      answer(connection, send_timeout);
    }
  }
  return true;
}

void ServerHandshake::answer(Connection& connection, std::chrono::milliseconds timeout) {
  const std::byte* body = record_.data() + kFrameHeaderBytes;
  if (!challenged_) {
    std::memcpy(client_nonce_.data(), body, client_nonce_.size());
    server_nonce_ = fresh_nonce();
    std::array<std::byte, 1 + kHandshakeNonceBytes + kHandshakeProofBytes> challenge{};
    challenge[0] = std::byte{auth_->open ? kModeOpen : kModeProves};
    std::memcpy(challenge.data() + 1, server_nonce_.data(), server_nonce_.size());
    if (!auth_->open) {
      const HandshakeProof proof = handshake_proof(protocol_, auth_->token, client_nonce_, server_nonce_, "server");
      std::memcpy(challenge.data() + 1 + kHandshakeNonceBytes, proof.data(), proof.size());
    }
    send_record(connection, protocol_, HandshakeRecord::kChallenge, challenge, timeout);
    challenged_ = true;
    return;
  }
  if (!auth_->open) {
    const HandshakeProof expected = handshake_proof(protocol_, auth_->token, client_nonce_, server_nonce_, "client");
    if (!same_proof(expected, body)) {
      const std::string reason = "the " + std::string(protocol_.client) + " could not prove the token (a wrong or missing token)";
      refuse(connection, timeout, reason);
      WS_FAIL(ErrorCode::kPermission, connection.peer() + ": " + reason);
    }
  }
  const std::byte accepted[3] = {std::byte{1}, std::byte{0}, std::byte{0}};
  send_record(connection, protocol_, HandshakeRecord::kResult, accepted, timeout);
  done_ = true;
}

bool ServerHandshake::step(Connection& connection, std::chrono::milliseconds timeout) {
  // One deadline for the whole record: a client that trickles a byte at a time gains nothing.
  const auto deadline = Clock::now() + timeout;
  const bool was_challenged = challenged_;
  for (;;) {
    if (advance(connection, left_until(deadline))) return true;
    if (challenged_ != was_challenged) return false;  // one record answered
    const std::string awaiting = challenged_ ? "AUTH_PROOF" : "AUTH_HELLO";
    pollfd entry{connection.fd(), POLLIN, 0};
    int ready;
    do {
      ready = ::poll(&entry, 1, static_cast<int>(std::min<int64_t>(left_until(deadline).count(), 1 << 30)));
    } while (ready < 0 && errno == EINTR);
    WS_EXPECT(ready != 0 && Clock::now() < deadline, ErrorCode::kTimeout,
              "timed out after " + detail::seconds_text(timeout) + " waiting for " + connection.peer() +
                  "'s handshake record " + awaiting + " (" + std::to_string(have_) + " bytes of it came)");
  }
}

void ServerHandshake::run(Connection& connection, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!step(connection, left_until(deadline))) {
  }
}

}  // namespace weightstream::transfer
