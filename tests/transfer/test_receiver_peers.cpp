// The receiver against hostile or careless local peers: descriptors passed before the token
// check, connections that never speak, and the socket file of a receiver that SIGTERM
// ended (or that a crash left behind).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>

#include "model/model_fixtures.hpp"
#include "support/test_support.hpp"
#include "transfer/transfer_fixtures.hpp"
#include "net/handshake.hpp"
#include "net/socket.hpp"
#include "update/wire.hpp"
#include "weightstream/error.hpp"
#include "weightstream/options.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using testing::cached_checkpoint;
using testing::cold_loaded_layout;
using testing::error_text;
using testing::receiver_options;
using testing::TempDir;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

const testing::MemoryCheckpoint& checkpoint_of(uint64_t seed) { return cached_checkpoint("llama", seed); }

/// A real update of the seed-2 checkpoint from a thread; the future holds the sender's report.
std::future<UpdateReport> send_async(const std::string& address, TransportKind kind) {
  return testing::send_async(address, testing::sender_options(kind, 1 << 20), checkpoint_of(2).views());
}

void expect_updated_to_seed_2(const ModelLayout& layout) {
  ModelLayout expected = cold_loaded_layout(checkpoint_of(2));
  LayoutComparison comparison = compare_layouts(layout, expected);
  EXPECT_GT(comparison.compared, 10u);
  EXPECT_EQ(comparison.mismatched, 0u);
}

size_t open_descriptors() {
  size_t count = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++count;
  return count;
}

/// A raw Unix-socket connection to `path`.
transfer::FileDescriptor connect_unix(const std::string& path) {
  transfer::FileDescriptor fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0) << path;
  return fd;
}

/// Leaves a socket file at `path` that nobody listens on, as a receiver killed by SIGKILL does.
void leave_stale_socket(const std::string& path) {
  transfer::FileDescriptor fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  ASSERT_EQ(::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)), 0) << path;
  ASSERT_EQ(::listen(fd.get(), 1), 0);
}  // closed: the file stays

bool exists(const std::string& path) {
  struct stat status{};
  return ::lstat(path.c_str(), &status) == 0;
}

// ---- descriptors passed by a peer -----------------------------------------------------------

TEST(ReceiverPeers, DescriptorsPassedBeforeTheTokenCheckAreClosed) {
  ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kShm));
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  transfer::FileDescriptor pipe_read(pipe_fds[0]);
  transfer::FileDescriptor pipe_write(pipe_fds[1]);

  // A handshake whose first byte carries two descriptors, and a proof made without the
  // token, sent at once behind it.
  auto record = [](transfer::HandshakeRecord type, size_t bytes) {
    std::vector<std::byte> frame(16 + bytes);
    const uint32_t magic = transfer::kMagic;
    const uint16_t version = transfer::kProtocolVersion;
    const auto kind = static_cast<uint16_t>(type);
    const uint64_t length = bytes;
    std::memcpy(frame.data(), &magic, 4);
    std::memcpy(frame.data() + 4, &version, 2);
    std::memcpy(frame.data() + 6, &kind, 2);
    std::memcpy(frame.data() + 8, &length, 8);
    return frame;
  };
  std::vector<std::byte> header = record(transfer::HandshakeRecord::kHello, transfer::kHandshakeNonceBytes);
  std::vector<std::byte> body(header.begin() + 16, header.end());  // the nonce
  header.resize(16);
  const std::vector<std::byte> proof = record(transfer::HandshakeRecord::kProof, transfer::kHandshakeProofBytes);
  body.insert(body.end(), proof.begin(), proof.end());

  const size_t before = open_descriptors();
  {
    UpdateReceiver receiver(layout, receiver_options(TransportKind::kShm));
    ::testing::internal::CaptureStderr();
    // Each is refused, logged, and dropped; the receiver goes on to the real sender behind them.
    std::vector<transfer::FileDescriptor> peers;
    for (int i = 0; i < 100; ++i) {
      transfer::FileDescriptor& peer = peers.emplace_back(connect_unix(receiver.address()));
      iovec part{header.data(), header.size()};
      alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
      msghdr envelope{};
      envelope.msg_iov = &part;
      envelope.msg_iovlen = 1;
      envelope.msg_control = control;
      envelope.msg_controllen = sizeof(control);
      cmsghdr* item = CMSG_FIRSTHDR(&envelope);
      item->cmsg_level = SOL_SOCKET;
      item->cmsg_type = SCM_RIGHTS;
      item->cmsg_len = CMSG_LEN(2 * sizeof(int));
      std::memcpy(CMSG_DATA(item), pipe_fds, 2 * sizeof(int));
      ASSERT_EQ(::sendmsg(peer.get(), &envelope, MSG_NOSIGNAL), static_cast<ssize_t>(header.size()));
      ASSERT_EQ(::send(peer.get(), body.data(), body.size(), MSG_NOSIGNAL), static_cast<ssize_t>(body.size()));
    }
    auto sent = send_async(receiver.address(), TransportKind::kShm);
    UpdateReport report = receiver.receive(20s);
    sent.get();
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(report.tensors, checkpoint_of(2).tensors.size());
    expect_updated_to_seed_2(layout);
    size_t refusals = 0;
    for (size_t at = 0; (at = log.find("the sender could not prove the token", at)) != std::string::npos; ++at) ++refusals;
    EXPECT_EQ(refusals, 100u) << log;
    EXPECT_THAT(log, HasSubstr("weightstream: refused a connection from unix socket " + receiver.address() +
                               " to update receiver at " + receiver.address()));
  }
  EXPECT_EQ(open_descriptors(), before);  // 100 connections, 200 descriptors passed: none kept
}

// ---- bad peers do not stop the receiver -----------------------------------------------------

/// A raw TCP connection to `address` that sends `bytes` (what it can of them) and stays open.
transfer::Connection send_raw(const std::string& address, std::span<const std::byte> bytes) {
  transfer::Connection peer = transfer::connect_to(address, 5s, "receiver");
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t sent = ::send(peer.fd(), bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent <= 0) break;  // refused and closed by the receiver, or its buffers are full: enough
    done += static_cast<size_t>(sent);
  }
  return peer;
}

TEST(ReceiverPeers, WrongTokensGarbageAndRefusedHellosAreLoggedAndTheNextSenderIsServed) {
  ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  ::testing::internal::CaptureStderr();
  auto received = std::async(std::launch::async, [&] { return receiver.receive(60s); });

  // A sender with another token: the receiver proves first, so the sender stops and says so.
  SenderOptions wrong;
  wrong.transport = TransportKind::kTcp;
  wrong.token = "another-secret";
  wrong.timeout = 10s;
  EXPECT_THAT(error_text([&] { UpdateSender sender(receiver.address(), wrong); }),
              HasSubstr("could not prove the token"));
  // 100 KB of random bytes: refused at their first 16, and closed.
  std::vector<std::byte> noise(100 << 10);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (std::byte& byte : noise) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    byte = static_cast<std::byte>(state >> 56);
  }
  transfer::Connection garbage = send_raw(receiver.address(), noise);
  // A header claiming 512 MiB: refused on its length, nothing allocated.
  std::vector<std::byte> huge(16);
  const uint32_t magic = transfer::kMagic;
  const uint16_t version = transfer::kProtocolVersion;
  const auto kind = static_cast<uint16_t>(transfer::HandshakeRecord::kHello);
  const uint64_t length = 512ull << 20;
  std::memcpy(huge.data(), &magic, 4);
  std::memcpy(huge.data() + 4, &version, 2);
  std::memcpy(huge.data() + 6, &kind, 2);
  std::memcpy(huge.data() + 8, &length, 8);
  transfer::Connection claims = send_raw(receiver.address(), huge);
  // A sender with the token asking for a transport this receiver does not serve.
  SenderOptions other = wrong;
  other.token = "shared-secret";
  other.transport = TransportKind::kShm;
  EXPECT_THAT(error_text([&] { UpdateSender sender(receiver.address(), other); }),
              HasSubstr("but this receiver serves tcp"));
  // Both raw peers were closed by the receiver.
  EXPECT_THAT(error_text([&] { garbage.receive_bytes(std::span(huge).first(1), 10s, "the end"); }),
              ::testing::AnyOf(HasSubstr("disconnected"), HasSubstr("reset")));
  EXPECT_THAT(error_text([&] { claims.receive_bytes(std::span(huge).first(1), 10s, "the end"); }),
              ::testing::AnyOf(HasSubstr("disconnected"), HasSubstr("reset")));

  auto sent = send_async(receiver.address(), TransportKind::kTcp);
  UpdateReport report = received.get();
  sent.get();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(report.tensors, checkpoint_of(2).tensors.size());
  expect_updated_to_seed_2(layout);
  const std::string refused = "weightstream: refused a connection from 127.0.0.1:";
  EXPECT_THAT(log, HasSubstr("does not speak the weightstream update protocol (bad magic)"));
  EXPECT_THAT(log, HasSubstr("sent a 536870912-byte AUTH_HELLO (expected 32)"));
  EXPECT_THAT(log, HasSubstr("while this side waited for the handshake's AUTH_PROOF"));  // the wrong token's sender
  EXPECT_THAT(log, HasSubstr("but this receiver serves tcp"));
  size_t lines = 0;
  for (size_t at = 0; (at = log.find(refused, at)) != std::string::npos; ++at) ++lines;
  EXPECT_EQ(lines, 4u) << log;  // each bad peer once
}

// UpdateReceiver::stats, what `audit --via --metrics-listen` shows: each refused peer counted
// as it is logged, the senders welcomed, and updates started, completed and failed (a
// refusal by the engine, refuse(), is one that failed).
TEST(ReceiverPeers, StatsCountRefusedPeersSendersAndUpdatesStartedCompletedAndFailed) {
  ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kTcp));
  EXPECT_EQ(receiver.stats().updates_started, 0u);
  ::testing::internal::CaptureStderr();
  auto received = std::async(std::launch::async, [&] { return receiver.receive(60s); });
  SenderOptions wrong;
  wrong.transport = TransportKind::kTcp;
  wrong.token = "another-secret";
  wrong.timeout = 10s;
  EXPECT_THAT(error_text([&] { UpdateSender sender(receiver.address(), wrong); }), HasSubstr("could not prove the token"));
  auto sent = send_async(receiver.address(), TransportKind::kTcp);
  received.get();
  sent.get();
  ReceiverStats applied = receiver.stats();
  EXPECT_EQ(applied.connections_refused, 1u);  // logged before the real sender was heard
  EXPECT_EQ(applied.senders_accepted, 1u);
  EXPECT_EQ(applied.updates_started, 1u);
  EXPECT_EQ(applied.updates_completed, 1u);
  EXPECT_EQ(applied.updates_failed, 0u);
  EXPECT_FALSE(applied.updating);

  auto refused = std::async(std::launch::async, [&] { receiver.refuse("the engine replaced a parameter", 60s); });
  auto refused_sender = send_async(receiver.address(), TransportKind::kTcp);
  EXPECT_THAT(error_text([&] { refused.get(); }), HasSubstr("the engine replaced a parameter"));
  EXPECT_THAT(error_text([&] { refused_sender.get(); }), HasSubstr("the engine replaced a parameter"));
  ::testing::internal::GetCapturedStderr();
  ReceiverStats after = receiver.stats();
  EXPECT_EQ(after.senders_accepted, 2u);
  EXPECT_EQ(after.updates_started, 2u);
  EXPECT_EQ(after.updates_completed, 1u);
  EXPECT_EQ(after.updates_failed, 1u);
  EXPECT_FALSE(after.updating);
}

// ---- peers that never speak -----------------------------------------------------------------

TEST(ReceiverPeers, TwentySilentConnectionsDoNotDelayARealSender) {
  for (TransportKind kind : {TransportKind::kTcp, TransportKind::kShm}) {
    SCOPED_TRACE(std::string(transport_name(kind)));
    ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
    UpdateReceiver receiver(layout, receiver_options(kind));  // update timeout 10 s, handshake 3 s
    std::vector<transfer::Connection> silent;
    for (int i = 0; i < 20; ++i) silent.push_back(transfer::connect_to(receiver.address(), 2s));

    const auto begun = Clock::now();
    auto sent = send_async(receiver.address(), kind);
    UpdateReport report = receiver.receive(20s);
    const double waited = std::chrono::duration<double>(Clock::now() - begun).count() - report.seconds;
    sent.get();
    EXPECT_LT(waited, 1.0) << "the update started " << waited << " s after the sender connected";
    expect_updated_to_seed_2(layout);
  }
}

TEST(ReceiverPeers, ASilentPeerIsDroppedAfterTheHandshakeTimeout) {
  ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
  ReceiverOptions options = receiver_options(TransportKind::kTcp);
  options.handshake_timeout = 200ms;
  UpdateReceiver receiver(layout, options);
  transfer::Connection silent = transfer::connect_to(receiver.address(), 2s);
  const auto begun = Clock::now();
  std::string text = error_text([&] { receiver.receive(700ms); });
  // Not the update timeout (10 s): the receiver waited for the accept timeout only.
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - begun).count(), 5.0);
  EXPECT_THAT(text, StartsWith("timeout: no sender connected to " + receiver.address() + " within 0."));
  EXPECT_THAT(text, HasSubstr("1 peer(s) connected but sent no HELLO within the handshake timeout of 0.2 s"));
  // The peer was closed: its next read sees the end.
  EXPECT_THAT(error_text([&] { receive_message(silent, 2s, "anything"); }), HasSubstr("disconnected"));
}

// ---- the socket file ------------------------------------------------------------------------

TEST(ReceiverSocketFile, RemovedWhenSigtermEndsTheReceiver) {
  TempDir directory;
  ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
  int report[2];
  ASSERT_EQ(::pipe(report), 0);
  pid_t child = ::fork();
  if (child == 0) {
    ::close(report[0]);
    try {
      ReceiverOptions options = receiver_options(TransportKind::kShm);
      options.socket_directory = directory.path().string();
      UpdateReceiver receiver(layout, options);
      std::string address = receiver.address() + "\n";
      (void)!::write(report[1], address.data(), address.size());
      for (;;) ::pause();  // until the signal
    } catch (...) {
    }
    ::_exit(3);
  }
  ::close(report[1]);
  std::string address;
  char c;
  while (::read(report[0], &c, 1) == 1 && c != '\n') address += c;
  ::close(report[0]);
  ASSERT_THAT(address, StartsWith(directory.path().string() + "/weightstream-update-"));
  EXPECT_TRUE(exists(address));
  ASSERT_EQ(::kill(child, SIGTERM), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << "status " << status;  // still ended by it
  EXPECT_FALSE(exists(address)) << address << " was left behind";
}

TEST(ReceiverSocketFile, RemovedWhenTheReceiverIsDestroyed) {
  TempDir directory;
  ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
  std::string address;
  {
    ReceiverOptions options = receiver_options(TransportKind::kShm);
    options.socket_directory = directory.path().string();
    UpdateReceiver receiver(layout, options);
    address = receiver.address();
    EXPECT_TRUE(exists(address));
  }
  EXPECT_FALSE(exists(address));
}

TEST(ReceiverSocketFile, AStaleSocketAtTheGivenPathIsReplaced) {
  TempDir directory;
  const std::string path = (directory / "engine.sock").string();
  leave_stale_socket(path);
  ASSERT_TRUE(exists(path));
  ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
  ReceiverOptions options = receiver_options(TransportKind::kShm);
  options.listen = path;
  UpdateReceiver receiver(layout, options);
  EXPECT_EQ(receiver.address(), path);
  auto sent = send_async(receiver.address(), TransportKind::kShm);
  receiver.receive(10s);
  sent.get();
  expect_updated_to_seed_2(layout);
}

TEST(ReceiverSocketFile, ALiveSocketOrAnotherFileIsNotReplaced) {
  TempDir directory;
  ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
  ReceiverOptions options = receiver_options(TransportKind::kShm);
  options.listen = (directory / "engine.sock").string();
  UpdateReceiver live(layout, options);
  EXPECT_THAT(error_text([&] { UpdateReceiver second(layout, options); }),
              HasSubstr("cannot listen on Unix socket " + options.listen + ": another process is listening on it"));
  EXPECT_TRUE(exists(options.listen));

  options.listen = (directory / "notes.txt").string();
  std::ofstream(options.listen) << "not a socket";
  EXPECT_THAT(error_text([&] { UpdateReceiver third(layout, options); }),
              HasSubstr(options.listen + ": the path exists and is not a socket (not replaced)"));
  EXPECT_TRUE(exists(options.listen));
}

TEST(ReceiverSocketFile, FreshSocketsOfEndedProcessesAreCleanedAtStart) {
  TempDir directory;
  pid_t ended = ::fork();
  if (ended == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(ended, nullptr, 0), ended);  // a pid whose process is gone
  const std::string stale = (directory / ("weightstream-update-" + std::to_string(ended) + "-0.sock")).string();
  leave_stale_socket(stale);
  ASSERT_TRUE(exists(stale));
  ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
  ReceiverOptions options = receiver_options(TransportKind::kShm);
  options.socket_directory = directory.path().string();
  UpdateReceiver receiver(layout, options);
  EXPECT_FALSE(exists(stale)) << stale << " was left";
  EXPECT_THAT(receiver.address(), StartsWith(directory.path().string() + "/weightstream-update-" +
                                             std::to_string(::getpid()) + "-"));
}

TEST(ReceiverSocketFile, TheFreshSocketIsInTheTemporaryDirectoryTheEnvironmentNames) {
  TempDir directory;
  testing::ScopedEnv tmpdir("TMPDIR", directory.path().string());
  EXPECT_EQ(options_from_environment(process_environment()).temporary_directory, directory.path().string());
  ModelLayout layout = cold_loaded_layout(checkpoint_of(1));
  UpdateReceiver receiver(layout, receiver_options(TransportKind::kShm));
  EXPECT_THAT(receiver.address(), StartsWith(directory.path().string() + "/weightstream-update-"));
  testing::ScopedEnv unset("TMPDIR", std::nullopt);
  EXPECT_EQ(options_from_environment(process_environment()).temporary_directory, "/tmp");
}

}  // namespace
}  // namespace weightstream
