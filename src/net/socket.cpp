// Sockets with deadlines, and frames over them, for both protocols (socket.hpp).
#include "net/socket.hpp"
#include "base/errno_text.hpp"
#include "base/text.hpp"
#include "weightstream/error.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <vector>

namespace weightstream::transfer {
namespace {

using Clock = std::chrono::steady_clock;

/// Connections the kernel queues before they are accepted: the most it allows (capped by
/// net.core.somaxconn). Listeners accept at once and bound what they keep themselves
/// (handshake.hpp), so a burst of strangers never fills the queue before a real peer.
constexpr int kListenBacklog = SOMAXCONN;

/// Descriptors one received message has room for (the protocol passes at most one).
constexpr size_t kMaxPassedDescriptors = 16;

using detail::seconds_text;

/// Waits until `fd` is ready for `events` or the deadline passes; false on timeout.
bool wait_ready(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left < 0) left = 0;
    pollfd entry{fd, events, 0};
    int result = ::poll(&entry, 1, static_cast<int>(std::min<long long>(left, 1 << 30)));
    if (result > 0) return true;  // ready, or an error/hang-up the next call reports
    if (result == 0) return false;
    if (errno != EINTR) return true;
  }
}

std::string endpoint_text(const sockaddr_storage& address) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (address.ss_family == AF_INET) {
    const auto& v4 = reinterpret_cast<const sockaddr_in&>(address);
    inet_ntop(AF_INET, &v4.sin_addr, host, sizeof(host));
    port = ntohs(v4.sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  if (address.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(address);
    inet_ntop(AF_INET6, &v6.sin6_addr, host, sizeof(host));
    port = ntohs(v6.sin6_port);
    return "[" + std::string(host) + "]:" + std::to_string(port);
  }
  return "?";
}

void set_nodelay(int fd) {
  int one = 1;
  // Manifests are small and each waits for an answer: Nagle's delay would add 40 ms each.
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

sockaddr_un unix_address(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  WS_EXPECT(path.size() < sizeof(address.sun_path), ErrorCode::kInvalidArgument,
            "Unix socket path " + path + " is longer than " + std::to_string(sizeof(address.sun_path) - 1) + " bytes");
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  return address;
}

}  // namespace

FileDescriptor& FileDescriptor::operator=(FileDescriptor&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

FileDescriptor::~FileDescriptor() {
  if (fd_ >= 0) ::close(fd_);
}

std::pair<std::string, uint16_t> split_host_port(const std::string& address) {
  std::string host;
  std::string port;
  if (address.starts_with('[')) {
    auto close = address.find(']');
    WS_EXPECT(close != std::string::npos && close + 1 < address.size() && address[close + 1] == ':',
              ErrorCode::kInvalidArgument, "address '" + address + "' is not [HOST]:PORT");
    host = address.substr(1, close - 1);
    port = address.substr(close + 2);
  } else {
    auto colon = address.rfind(':');
    WS_EXPECT(colon != std::string::npos, ErrorCode::kInvalidArgument, "address '" + address + "' is not HOST:PORT");
    host = address.substr(0, colon);
    port = address.substr(colon + 1);
  }
  WS_EXPECT(!host.empty() && !port.empty() && port.size() <= 5 &&
                port.find_first_not_of("0123456789") == std::string::npos && std::stoul(port) <= 65535,
            ErrorCode::kInvalidArgument, "address '" + address + "' is not HOST:PORT with a port from 0 to 65535");
  return {host, static_cast<uint16_t>(std::stoul(port))};
}

// ---- connection ---------------------------------------------------------------------------

void Connection::send_frame(std::span<const std::byte> header, std::span<const std::byte> body,
                            std::chrono::milliseconds timeout, const std::string& what, int pass_fd) {
  if (pass_fd >= 0) {
    // The descriptor travels with the header's first byte; the rest goes as ordinary data.
    iovec part{const_cast<std::byte*>(header.data()), header.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr envelope{};
    envelope.msg_iov = &part;
    envelope.msg_iovlen = 1;
    envelope.msg_control = control;
    envelope.msg_controllen = sizeof(control);
    cmsghdr* item = CMSG_FIRSTHDR(&envelope);
    item->cmsg_level = SOL_SOCKET;
    item->cmsg_type = SCM_RIGHTS;
    item->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(item), &pass_fd, sizeof(int));
    WS_EXPECT(wait_ready(fd(), POLLOUT, Clock::now() + timeout), ErrorCode::kTimeout,
              "cannot send " + what + " to " + peer_ + ": not writable within " + seconds_text(timeout));
    ssize_t sent;
    do {
      sent = ::sendmsg(fd(), &envelope, MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    WS_EXPECT(sent > 0, ErrorCode::kNetwork,
              "cannot send " + what + " with a descriptor to " + peer_ + ": " + detail::errno_text(errno));
    send_bytes(header.subspan(static_cast<size_t>(sent)), timeout, what);
  } else {
    send_bytes(header, timeout, what);
  }
  send_bytes(body, timeout, what);
}

void Connection::send_bytes(std::span<const std::byte> bytes, std::chrono::milliseconds timeout,
                            const std::string& what) {
  size_t done = 0;
  while (done < bytes.size()) {
    WS_EXPECT(wait_ready(fd(), POLLOUT, Clock::now() + timeout), ErrorCode::kTimeout,
              "cannot send " + what + " to " + peer_ + ": the peer took nothing for " + seconds_text(timeout) +
                  " (" + std::to_string(done) + " of " + std::to_string(bytes.size()) + " bytes sent)");
    ssize_t sent = ::send(fd(), bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      WS_FAIL(ErrorCode::kNetwork, "cannot send " + what + " to " + peer_ + ": " + detail::errno_text(errno) +
                                       " (the peer has gone)");
    }
    done += static_cast<size_t>(sent);
  }
}

void Connection::read_exact(std::span<std::byte> bytes, std::chrono::milliseconds timeout, const std::string& what,
                            FileDescriptor* received_fd) {
  size_t done = 0;
  while (done < bytes.size()) {
    WS_EXPECT(wait_ready(fd(), POLLIN, Clock::now() + timeout), ErrorCode::kTimeout,
              "timed out after " + seconds_text(timeout) + " of silence from " + peer_ + " waiting for " + what +
                  (done > 0 ? " (" + std::to_string(done) + " of " + std::to_string(bytes.size()) + " bytes came)"
                            : ""));
    ssize_t got;
    if (received_fd != nullptr && done == 0) {
      iovec part{bytes.data(), bytes.size()};
      // Room for more descriptors than the protocol ever passes: each one that arrives is
      // installed in this process and must be closed here unless kept (a peer may send any
      // number, before its token is checked); those beyond the room the kernel drops itself.
      alignas(cmsghdr) char control[CMSG_SPACE(kMaxPassedDescriptors * sizeof(int))] = {};
      msghdr envelope{};
      envelope.msg_iov = &part;
      envelope.msg_iovlen = 1;
      envelope.msg_control = control;
      envelope.msg_controllen = sizeof(control);
      got = ::recvmsg(fd(), &envelope, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      std::vector<FileDescriptor> passed;
      if (got >= 0) {
        for (cmsghdr* item = CMSG_FIRSTHDR(&envelope); item != nullptr; item = CMSG_NXTHDR(&envelope, item)) {
          if (item->cmsg_level != SOL_SOCKET || item->cmsg_type != SCM_RIGHTS || item->cmsg_len < CMSG_LEN(0)) continue;
          const size_t count = (item->cmsg_len - CMSG_LEN(0)) / sizeof(int);
          for (size_t i = 0; i < count; ++i) {
            int descriptor;
            std::memcpy(&descriptor, CMSG_DATA(item) + i * sizeof(int), sizeof(int));
            passed.emplace_back(descriptor);
          }
        }
      }
      // The protocol passes one descriptor with a message; any other count keeps none (the
      // message's reader then finds none where it needs one), and `passed` closes them all.
      if (passed.size() == 1) *received_fd = std::move(passed.front());
    } else {
      got = ::recv(fd(), bytes.data() + done, bytes.size() - done, MSG_DONTWAIT);
    }
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      int cause = errno;
      WS_FAIL(ErrorCode::kNetwork, "connection to " + peer_ + " failed waiting for " + what + ": " +
                                       detail::errno_text(cause) +
                                       (cause == ECONNRESET ? " (the peer has gone)" : ""));
    }
    WS_EXPECT(got > 0, ErrorCode::kNetwork,
              peer_ + " disconnected (the peer has gone) while this side waited for " + what +
                  (done > 0 ? " (" + std::to_string(done) + " of " + std::to_string(bytes.size()) + " bytes came)"
                            : ""));
    done += static_cast<size_t>(got);
  }
}

void Connection::receive_with_fd(std::span<std::byte> bytes, std::chrono::milliseconds timeout,
                                 const std::string& what, FileDescriptor& passed_fd) {
  read_exact(bytes, timeout, what, &passed_fd);
}

void Connection::receive_bytes(std::span<std::byte> bytes, std::chrono::milliseconds timeout, const std::string& what) {
  read_exact(bytes, timeout, what, nullptr);
}

size_t Connection::receive_ready(std::span<std::byte> bytes, const std::string& what) {
  for (;;) {
    const ssize_t got = ::recv(fd(), bytes.data(), bytes.size(), MSG_DONTWAIT);
    if (got > 0) return static_cast<size_t>(got);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    WS_EXPECT(got < 0, ErrorCode::kNetwork, peer_ + " disconnected (the peer has gone) while this side waited for " + what);
    const int cause = errno;
    WS_FAIL(ErrorCode::kNetwork, "connection to " + peer_ + " failed waiting for " + what + ": " +
                                     detail::errno_text(cause) + (cause == ECONNRESET ? " (the peer has gone)" : ""));
  }
}

bool Connection::readable() {
  pollfd entry{fd(), POLLIN, 0};
  return ::poll(&entry, 1, 0) > 0;
}

bool Connection::closed() {
  if (!readable()) return false;
  std::byte next;
  const ssize_t got = ::recv(fd(), &next, 1, MSG_PEEK | MSG_DONTWAIT);
  return got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

// ---- listener -------------------------------------------------------------------------------

Listener Listener::tcp(const std::string& address) {
  auto [host, port] = split_host_port(address.empty() ? "127.0.0.1:0" : address);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  int status = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  WS_EXPECT(status == 0, ErrorCode::kNetwork,
            "cannot listen on " + host + ":" + std::to_string(port) + ": " + ::gai_strerror(status));
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owned(found, ::freeaddrinfo);
  Listener listener;
  int last_errno = 0;
  for (addrinfo* candidate = found; candidate != nullptr; candidate = candidate->ai_next) {
    FileDescriptor fd(::socket(candidate->ai_family, candidate->ai_socktype | SOCK_CLOEXEC, candidate->ai_protocol));
    if (!fd) {
      last_errno = errno;
      continue;
    }
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), candidate->ai_addr, candidate->ai_addrlen) != 0 || ::listen(fd.get(), kListenBacklog) != 0) {
      last_errno = errno;
      continue;
    }
    sockaddr_storage bound{};
    socklen_t length = sizeof(bound);
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &length);
    listener.fd_ = std::move(fd);
    listener.address_ = endpoint_text(bound);
    listener.host_ = listener.address_.substr(0, listener.address_.rfind(':'));
    return listener;
  }
  WS_FAIL(ErrorCode::kNetwork,
          "cannot listen on " + host + ":" + std::to_string(port) + ": " + detail::errno_text(last_errno));
}

namespace {

// ---- socket files removed at SIGTERM ---------------------------------------------------------
//
// A receiver's socket file is removed when its Listener is destroyed; a process ended by
// SIGTERM runs no destructors, so the paths of live Unix listeners are also kept in a fixed
// table that a SIGTERM handler (installed only where SIGTERM has its default action, so a
// program's own handler is never replaced) unlinks before the signal ends the process as
// it would have. Only async-signal-safe work happens in the handler: atomics and unlink().

constexpr size_t kSocketSlots = 64;
struct SocketSlot {
  std::atomic<int> state{0};  // 0 free, 1 being written or cleared, 2 holds a live path
  pid_t owner = 0;            // the process that listens: a forked child's SIGTERM leaves it alone
  char path[sizeof(sockaddr_un::sun_path)] = {};
};
SocketSlot socket_slots[kSocketSlots];

void remove_socket_files_and_end(int signal) {
  for (SocketSlot& slot : socket_slots) {
    if (slot.state.load() == 2 && slot.owner == ::getpid()) ::unlink(slot.path);
  }
  // SA_RESETHAND restored the default action: the signal, pending until this returns,
  // then ends the process with the status its sender expects.
  ::raise(signal);
}

void remove_at_sigterm_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current{};
    if (::sigaction(SIGTERM, nullptr, &current) != 0) return;
    if ((current.sa_flags & SA_SIGINFO) != 0 || current.sa_handler != SIG_DFL) return;
    struct sigaction action{};
    action.sa_handler = remove_socket_files_and_end;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESETHAND | SA_RESTART;
    ::sigaction(SIGTERM, &action, nullptr);
  });
}

/// Lists `path` for removal at SIGTERM; the slot index, or -1 when the table is full.
int register_socket_file(const std::string& path) {
  remove_at_sigterm_once();
  for (size_t i = 0; i < kSocketSlots; ++i) {
    int expected = 0;
    if (socket_slots[i].state.compare_exchange_strong(expected, 1)) {
      socket_slots[i].owner = ::getpid();
      std::memcpy(socket_slots[i].path, path.c_str(), std::min(path.size() + 1, sizeof(socket_slots[i].path)));
      socket_slots[i].state.store(2);
      return static_cast<int>(i);
    }
  }
  return -1;
}

void unregister_socket_file(int slot) {
  if (slot < 0) return;
  socket_slots[slot].state.store(1);
  socket_slots[slot].path[0] = '\0';
  socket_slots[slot].state.store(0);
}

/// True when a connect() to the Unix socket at `path` is refused: a socket file left by a
/// process that ended without removing it.
bool nobody_listens(const std::string& path) {
  sockaddr_un address = unix_address(path);
  FileDescriptor probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!probe) return false;
  return ::connect(probe.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0 &&
         errno == ECONNREFUSED;
}

constexpr std::string_view kFreshSocketPrefix = "weightstream-update-";

/// Removes fresh receiver sockets ("weightstream-update-PID-N.sock") in `directory` that
/// belong to this user, whose process has ended and on which nobody listens.
void remove_stale_fresh_sockets(const std::string& directory) {
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(directory, error)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with(kFreshSocketPrefix) || !name.ends_with(".sock")) continue;
    const std::string rest = name.substr(kFreshSocketPrefix.size());
    const auto dash = rest.find('-');
    if (dash == std::string::npos || dash == 0 || rest.find_first_not_of("0123456789") != dash) continue;
    const long pid = std::strtol(rest.substr(0, dash).c_str(), nullptr, 10);
    if (pid <= 0 || pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    struct stat status{};
    const std::string path = entry.path().string();
    if (::lstat(path.c_str(), &status) != 0 || !S_ISSOCK(status.st_mode) || status.st_uid != ::geteuid()) continue;
    if (path.size() < sizeof(sockaddr_un::sun_path) && nobody_listens(path)) ::unlink(path.c_str());
  }
}

}  // namespace

Listener::SocketFile::~SocketFile() {
  unregister_socket_file(slot);
  if (owner == ::getpid()) ::unlink(path.c_str());  // not from a forked child unwinding
}

std::string Listener::fresh_unix_socket_path(const std::string& directory) {
  static std::atomic<unsigned> counter{0};
  remove_stale_fresh_sockets(directory);
  return directory + "/" + std::string(kFreshSocketPrefix) + std::to_string(::getpid()) + "-" +
         std::to_string(counter++) + ".sock";
}

Listener Listener::unix_socket(const std::string& path) {
  WS_EXPECT(!path.empty(), ErrorCode::kInvalidArgument, "a Unix socket listener needs a path");
  sockaddr_un address = unix_address(path);
  FileDescriptor fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  WS_EXPECT(static_cast<bool>(fd), ErrorCode::kNetwork, "cannot create a Unix socket: " + detail::errno_text(errno));
  auto bind_private = [&] {
    // Create the socket file with no access for others: the path is the only door to the
    // receiver, so the directory's permissions and this mode decide who may knock.
    mode_t previous = ::umask(0077);
    int bound = ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address));
    int bind_errno = errno;
    ::umask(previous);
    return bound == 0 ? 0 : bind_errno;
  };
  int bind_errno = bind_private();
  if (bind_errno == EADDRINUSE) {
    // A socket file nobody listens on is what a receiver ended by a signal or a crash
    // leaves: replace it. A live one, or a file of another kind, is not touched.
    struct stat status{};
    WS_EXPECT(::lstat(path.c_str(), &status) == 0 && S_ISSOCK(status.st_mode), ErrorCode::kNetwork,
              "cannot listen on Unix socket " + path + ": the path exists and is not a socket (not replaced)");
    WS_EXPECT(nobody_listens(path), ErrorCode::kNetwork,
              "cannot listen on Unix socket " + path + ": another process is listening on it");
    ::unlink(path.c_str());
    bind_errno = bind_private();
  }
  WS_EXPECT(bind_errno == 0, ErrorCode::kNetwork, "cannot listen on Unix socket " + path + ": " + detail::errno_text(bind_errno));
  Listener listener;
  listener.socket_file_ = std::make_unique<SocketFile>();
  listener.socket_file_->path = path;
  listener.socket_file_->owner = ::getpid();
  listener.socket_file_->slot = register_socket_file(path);
  ::chmod(path.c_str(), 0600);  // connecting needs write permission only; nobody needs execute
  WS_EXPECT(::listen(fd.get(), kListenBacklog) == 0, ErrorCode::kNetwork,
            "cannot listen on Unix socket " + path + ": " + detail::errno_text(errno));
  listener.fd_ = std::move(fd);
  listener.address_ = path;
  listener.host_ = "unix";
  listener.unix_ = true;
  return listener;
}

Listener::~Listener() = default;

Connection Listener::accept(std::chrono::milliseconds timeout) {
  WS_EXPECT(wait_ready(fd_.get(), POLLIN, Clock::now() + timeout), ErrorCode::kTimeout,
            "no sender connected to " + address_ + " within " + seconds_text(timeout));
  sockaddr_storage peer{};
  socklen_t length = sizeof(peer);
  FileDescriptor fd(::accept4(fd_.get(), reinterpret_cast<sockaddr*>(&peer), &length, SOCK_CLOEXEC));
  WS_EXPECT(static_cast<bool>(fd), ErrorCode::kNetwork, "cannot accept on " + address_ + ": " + detail::errno_text(errno));
  if (unix_) return Connection(std::move(fd), "unix peer on " + address_, "unix socket " + address_);
  set_nodelay(fd.get());
  const std::string remote = endpoint_text(peer);
  return Connection(std::move(fd), "tcp peer " + remote, remote);
}

Connection connect_to(const std::string& address, std::chrono::milliseconds timeout, const std::string& what) {
  auto deadline = Clock::now() + timeout;
  if (address.find('/') != std::string::npos) {
    sockaddr_un target = unix_address(address);
    FileDescriptor fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    WS_EXPECT(static_cast<bool>(fd), ErrorCode::kNetwork, "cannot create a Unix socket: " + detail::errno_text(errno));
    WS_EXPECT(::connect(fd.get(), reinterpret_cast<const sockaddr*>(&target), sizeof(target)) == 0,
              ErrorCode::kNetwork, "cannot connect to " + what + " at Unix socket " + address + ": " +
                                       detail::errno_text(errno));
    return Connection(std::move(fd), "receiver at " + address);
  }
  auto [host, port] = split_host_port(address);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  int status = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  WS_EXPECT(status == 0, ErrorCode::kNetwork, "cannot resolve " + what + " " + address + ": " + ::gai_strerror(status));
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> owned(found, ::freeaddrinfo);
  std::string cause = "no address";
  for (addrinfo* candidate = found; candidate != nullptr; candidate = candidate->ai_next) {
    FileDescriptor fd(::socket(candidate->ai_family, candidate->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                               candidate->ai_protocol));
    if (!fd) continue;
    if (::connect(fd.get(), candidate->ai_addr, candidate->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        cause = detail::errno_text(errno);
        continue;
      }
      if (!wait_ready(fd.get(), POLLOUT, deadline)) {
        cause = "no answer within " + seconds_text(timeout);
        continue;
      }
      int error = 0;
      socklen_t length = sizeof(error);
      ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length);
      if (error != 0) {
        cause = detail::errno_text(error);
        continue;
      }
    }
    // Back to blocking mode: every wait goes through poll() with a deadline anyway.
    ::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK);
    set_nodelay(fd.get());
    return Connection(std::move(fd), "receiver at " + address);
  }
  WS_FAIL(ErrorCode::kNetwork, "cannot connect to " + what + " at " + address + ": " + cause);
}

}  // namespace weightstream::transfer
