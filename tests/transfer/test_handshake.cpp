// The handshake both protocols open with (src/transfer/handshake.hpp): the token is proven
// both ways and never sent; the server proves first, so a client facing a server without
// the token stops before it sends anything derived from its own; a recorded proof is
// worthless on another connection; no listener starts without a token unless asked to.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <cstring>
#include <future>

#include "model/model_fixtures.hpp"
#include "support/test_support.hpp"
#include "net/handshake.hpp"
#include "net/socket.hpp"
#include "transfer/transfer_fixtures.hpp"
#include "update/wire.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::error_text;
using testing::RecordingProxy;
using namespace std::chrono_literals;
using transfer::Connection;
using transfer::FileDescriptor;
using transfer::HandshakeRecord;
using transfer::kUpdateHandshake;

constexpr char kToken[] = "handshake-token-7f3a9c";

/// Two connected ends of a Unix stream socket pair: `client` and `server`.
struct SocketPair {
  Connection client{FileDescriptor(), ""};
  Connection server{FileDescriptor(), ""};
  SocketPair() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    client = Connection(FileDescriptor(fds[0]), "test server");
    server = Connection(FileDescriptor(fds[1]), "test client");
  }
};

std::vector<std::byte> record(HandshakeRecord type, std::span<const std::byte> body,
                              uint16_t version = transfer::kProtocolVersion) {
  std::vector<std::byte> frame(16 + body.size());
  const uint32_t magic = transfer::kMagic;
  const auto kind = static_cast<uint16_t>(type);
  const uint64_t length = body.size();
  std::memcpy(frame.data(), &magic, 4);
  std::memcpy(frame.data() + 4, &version, 2);
  std::memcpy(frame.data() + 6, &kind, 2);
  std::memcpy(frame.data() + 8, &length, 8);
  std::copy(body.begin(), body.end(), frame.begin() + 16);
  return frame;
}

/// Everything `connection` receives until the other end closes (or 2 s pass).
std::string drain(Connection& connection) {
  std::string bytes;
  for (;;) {
    std::byte byte;
    try {
      connection.receive_bytes(std::span(&byte, 1), 2s, "anything");
    } catch (const Error&) {
      return bytes;
    }
    bytes += static_cast<char>(byte);
  }
}

/// A server that runs the handshake with each connection accepted, with `auth`; the error
/// text of each (or "no error").
class HandshakeServer {
 public:
  explicit HandshakeServer(transfer::ListenerAuth auth, size_t connections)
      : auth_(std::move(auth)), listener_(transfer::Listener::tcp("127.0.0.1:0")) {
    done_ = std::async(std::launch::async, [this, connections] {
      std::vector<std::string> results;
      for (size_t i = 0; i < connections; ++i) {
        Connection connection = listener_.accept(10s);
        results.push_back(error_text([&] { transfer::ServerHandshake(kUpdateHandshake, auth_).run(connection, 5s); }));
      }
      return results;
    });
  }
  const std::string& address() const { return listener_.address(); }
  std::vector<std::string> results() { return done_.get(); }

 private:
  transfer::ListenerAuth auth_;
  transfer::Listener listener_;
  std::future<std::vector<std::string>> done_;
};

TEST(Handshake, BothSidesProveTheTokenAndItNeverCrossesTheWire) {
  HandshakeServer server({kToken, false}, 1);
  RecordingProxy proxy(server.address());
  Connection client = transfer::connect_to(proxy.address(), 5s);
  EXPECT_EQ(error_text([&] { transfer::prove_to_server(client, kUpdateHandshake, kToken, 5s, "receiver"); }),
            "no error");
  EXPECT_EQ(server.results(), std::vector<std::string>{"no error"});
  EXPECT_THAT(proxy.from_client(), Not(HasSubstr(kToken)));
  EXPECT_THAT(proxy.from_server(), Not(HasSubstr(kToken)));
  EXPECT_EQ(proxy.from_client().size(), 2 * (16 + 32u));  // a nonce and a proof, nothing else
}

TEST(Handshake, AClientWithAWrongTokenIsRefusedAndTold) {
  // A client that does not check the server's proof and sends one made without the token.
  HandshakeServer server({kToken, false}, 1);
  Connection client = transfer::connect_to(server.address(), 5s);
  const std::array<std::byte, 32> nonce{}, proof{};
  client.send_bytes(record(HandshakeRecord::kHello, nonce), 5s, "hello");
  std::array<std::byte, 16 + 65> challenge;
  client.receive_bytes(challenge, 5s, "challenge");
  client.send_bytes(record(HandshakeRecord::kProof, proof), 5s, "proof");
  EXPECT_THAT(drain(client), HasSubstr("the sender could not prove the token (a wrong or missing token)"));
  EXPECT_THAT(server.results().at(0),
              AllOf(HasSubstr("permission: "), HasSubstr("the sender could not prove the token")));
}

TEST(Handshake, AClientDetectsAServerWithAnotherTokenBeforeSendingItsProof) {
  SocketPair pair;
  auto client = std::async(std::launch::async, [&] {
    return error_text([&] { transfer::prove_to_server(pair.client, kUpdateHandshake, kToken, 5s, "receiver at X"); });
  });
  // A fake server: it answers the client's nonce with a proof made with another token.
  std::array<std::byte, 16 + 32> hello;
  pair.server.receive_bytes(hello, 5s, "hello");
  transfer::HandshakeNonce client_nonce, server_nonce = transfer::fresh_nonce();
  std::memcpy(client_nonce.data(), hello.data() + 16, 32);
  const transfer::HandshakeProof wrong =
      transfer::handshake_proof(kUpdateHandshake, "another-token", client_nonce, server_nonce, "server");
  std::vector<std::byte> body(1, std::byte{0});
  body.insert(body.end(), server_nonce.begin(), server_nonce.end());
  body.insert(body.end(), wrong.begin(), wrong.end());
  pair.server.send_bytes(record(HandshakeRecord::kChallenge, body), 5s, "challenge");
  const std::string text = client.get();
  EXPECT_THAT(text, HasSubstr("permission: receiver at X could not prove the token: it holds another token, or is not "
                              "the server meant (nothing derived from this side's token was sent)"));
  pair.client = Connection(FileDescriptor(), "");  // closed: everything it sent is in the socket
  // After its nonce the client sent nothing: no proof, no token.
  EXPECT_EQ(drain(pair.server), "");
  const std::string sent(reinterpret_cast<const char*>(hello.data()), hello.size());
  EXPECT_THAT(sent, Not(HasSubstr(kToken)));
  // Its hello holds a nonce and nothing derived from the token: the right proof is not in it.
  const transfer::HandshakeProof right =
      transfer::handshake_proof(kUpdateHandshake, kToken, client_nonce, server_nonce, "client");
  EXPECT_THAT(sent, Not(HasSubstr(std::string(reinterpret_cast<const char*>(right.data()), right.size()))));
}

TEST(Handshake, AReplayedProofIsRefused) {
  HandshakeServer server({kToken, false}, 2);
  RecordingProxy proxy(server.address());
  {
    Connection client = transfer::connect_to(proxy.address(), 5s);
    transfer::prove_to_server(client, kUpdateHandshake, kToken, 5s, "receiver");
  }
  // Wait until the proxy has relayed the whole first exchange.
  for (int i = 0; i < 200 && proxy.from_client_on(0).size() < 96; ++i) std::this_thread::sleep_for(10ms);
  const std::string recorded = proxy.from_client_on(0);
  ASSERT_EQ(recorded.size(), 96u);
  // The recorded nonce and proof, replayed on a new connection: the server's nonce differs.
  Connection replay = transfer::connect_to(server.address(), 5s);
  replay.send_bytes(std::as_bytes(std::span(recorded)), 5s, "replay");
  EXPECT_THAT(drain(replay), HasSubstr("could not prove the token"));
  const auto results = server.results();
  EXPECT_EQ(results.at(0), "no error");
  EXPECT_THAT(results.at(1), HasSubstr("the sender could not prove the token"));
}

TEST(Handshake, AClientWithoutATokenAndAnOpenServerAreToldApart) {
  {
    HandshakeServer server({kToken, false}, 1);
    Connection client = transfer::connect_to(server.address(), 5s);
    EXPECT_THAT(error_text([&] { transfer::prove_to_server(client, kUpdateHandshake, "", 5s, "receiver at Y"); }),
                HasSubstr("permission: receiver at Y requires a token, and this side has none"));
  }
  {
    // An open server proves nothing: a client that holds a token does not trust it.
    HandshakeServer server({"", true}, 1);
    Connection client = transfer::connect_to(server.address(), 5s);
    EXPECT_THAT(error_text([&] { transfer::prove_to_server(client, kUpdateHandshake, kToken, 5s, "receiver at Z"); }),
                HasSubstr("receiver at Z could not prove the token: it says it listens without one"));
  }
  {
    HandshakeServer server({"", true}, 1);
    Connection client = transfer::connect_to(server.address(), 5s);
    EXPECT_EQ(error_text([&] { transfer::prove_to_server(client, kUpdateHandshake, "", 5s, "receiver"); }), "no error");
    EXPECT_EQ(server.results().at(0), "no error");
  }
}

TEST(Handshake, APeerOfAnotherVersionFailsWithAVersionError) {
  HandshakeServer server({kToken, false}, 1);
  Connection client = transfer::connect_to(server.address(), 5s);
  // An update sender of version 5 opened with its HELLO (token inside).
  transfer::Message hello;
  hello.type = transfer::MessageType::kHello;
  hello.bucket_bytes = 1 << 20;
  std::vector<std::byte> body = transfer::encode_body(hello);
  std::vector<std::byte> frame = record(HandshakeRecord::kHello, body, 5);
  const uint16_t type = 1;  // HELLO
  std::memcpy(frame.data() + 6, &type, 2);
  client.send_bytes(frame, 5s, "old hello");
  EXPECT_THAT(server.results().at(0),
              HasSubstr("protocol: tcp peer 127.0.0.1:"));
  std::array<std::byte, 16> header;
  client.receive_bytes(header, 5s, "refusal");
  uint16_t version;
  std::memcpy(&version, header.data() + 4, 2);
  EXPECT_EQ(version, transfer::kProtocolVersion);  // what an old peer's parser reports as the other's version
}

TEST(Handshake, ServerReportsAnOldClientsVersion) {
  SocketPair pair;
  transfer::ListenerAuth auth{kToken, false};
  std::array<std::byte, 32> nonce{};
  pair.client.send_bytes(record(HandshakeRecord::kHello, nonce, 5), 5s, "old hello");
  EXPECT_THAT(error_text([&] { transfer::ServerHandshake(kUpdateHandshake, auth).run(pair.server, 5s); }),
              HasSubstr("it speaks update protocol version 5, this build speaks " + std::to_string(transfer::kProtocolVersion)));
}

// ---- the one rule of listeners ----------------------------------------------------------------

TEST(ListenerToken, AnEmptyTokenIsRefusedUnlessAnOpenListenerIsAskedFor) {
  EXPECT_THAT(error_text([] { require_listener_token("", false, "peer server on 127.0.0.1:0"); }),
              HasSubstr("invalid_argument: peer server on 127.0.0.1:0 refuses to start without a token"));
  EXPECT_THAT(error_text([] { require_listener_token("t", true, "x"); }),
              HasSubstr("both a token and an open listener (open_without_token) were asked for"));
  EXPECT_EQ(error_text([] { require_listener_token("t", false, "x"); }), "no error");
  EXPECT_EQ(error_text([] { require_listener_token("", true, "x"); }), "no error");
}

TEST(ListenerToken, AnUpdateReceiverRefusesAnEmptyTokenAndWarnsWhenOpen) {
  ModelLayout layout = testing::cold_loaded_layout(testing::cached_checkpoint("llama", 1));
  for (TransportKind kind : {TransportKind::kTcp, TransportKind::kShm}) {
    ReceiverOptions options;
    options.transport = kind;
    EXPECT_THAT(error_text([&] { UpdateReceiver receiver(layout, options); }),
                AllOf(HasSubstr("invalid_argument: update receiver on "),
                      HasSubstr("refuses to start without a token"), HasSubstr("open_without_token")));
    options.open_without_token = true;
    ::testing::internal::CaptureStderr();
    std::string address;
    EXPECT_EQ(error_text([&] { address = UpdateReceiver(layout, options).address(); }), "no error");
    const std::string warned = ::testing::internal::GetCapturedStderr();
    EXPECT_THAT(warned, HasSubstr("weightstream: warning: update receiver on " + address +
                                  " listens without a token (open_without_token)"));
    EXPECT_EQ(warned.find("warning"), warned.rfind("warning"));  // once
  }
}

TEST(ListenerToken, AnOpenReceiverTakesASenderWithoutAToken) {
  ModelLayout layout = testing::cold_loaded_layout(testing::cached_checkpoint("llama", 1));
  ReceiverOptions options = testing::receiver_options(TransportKind::kTcp);
  options.token.clear();
  options.open_without_token = true;
  UpdateReceiver receiver(layout, options);
  SenderOptions sender_options = testing::sender_options(TransportKind::kTcp);
  sender_options.token.clear();
  auto sent = testing::send_async(receiver.address(), sender_options, testing::cached_checkpoint("llama", 2).views());
  EXPECT_GT(receiver.receive(10s).tensors, 0u);
  EXPECT_GT(sent.get().tensors, 0u);
}

TEST(ListenerToken, AnUpdateCarriesNoTokenOnTheWire) {
  ModelLayout layout = testing::cold_loaded_layout(testing::cached_checkpoint("llama", 1));
  ReceiverOptions options = testing::receiver_options(TransportKind::kTcp);
  options.token = kToken;
  UpdateReceiver receiver(layout, options);
  RecordingProxy proxy(receiver.address());
  SenderOptions sender_options = testing::sender_options(TransportKind::kTcp);
  sender_options.token = kToken;
  auto sent = testing::send_async(proxy.address(), sender_options, testing::cached_checkpoint("llama", 2).views());
  EXPECT_GT(receiver.receive(10s).tensors, 0u);
  EXPECT_GT(sent.get().tensors, 0u);
  EXPECT_GT(proxy.from_client().size(), 1000u);  // the whole update went through the proxy
  EXPECT_THAT(proxy.from_client(), Not(HasSubstr(kToken)));
  EXPECT_THAT(proxy.from_server(), Not(HasSubstr(kToken)));
}

}  // namespace
}  // namespace weightstream
