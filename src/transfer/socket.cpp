// Sockets with deadlines and framed messages for the update protocol.
#include "transfer/socket.hpp"
#include "base/errno_text.hpp"

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
#include <cstring>
#include <filesystem>

namespace weightstream::transfer {
namespace {

using Clock = std::chrono::steady_clock;

std::string seconds_text(std::chrono::milliseconds timeout) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3g s", static_cast<double>(timeout.count()) / 1000.0);
  return text;
}

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

void Connection::send(const Message& message, std::chrono::milliseconds timeout, int pass_fd) {
  std::vector<std::byte> body = encode_body(message);
  auto header = encode_header(message.type, body.size());
  std::string what = std::string(message_type_name(message.type)) + " message";
  if (pass_fd >= 0) {
    // The descriptor travels with the header's first byte; the rest goes as ordinary data.
    iovec part{header.data(), header.size()};
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
    send_bytes(std::span(header).subspan(static_cast<size_t>(sent)), timeout, what);
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
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
      msghdr envelope{};
      envelope.msg_iov = &part;
      envelope.msg_iovlen = 1;
      envelope.msg_control = control;
      envelope.msg_controllen = sizeof(control);
      got = ::recvmsg(fd(), &envelope, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (got > 0) {
        for (cmsghdr* item = CMSG_FIRSTHDR(&envelope); item != nullptr; item = CMSG_NXTHDR(&envelope, item)) {
          if (item->cmsg_level == SOL_SOCKET && item->cmsg_type == SCM_RIGHTS && item->cmsg_len == CMSG_LEN(sizeof(int))) {
            int passed;
            std::memcpy(&passed, CMSG_DATA(item), sizeof(int));
            *received_fd = FileDescriptor(passed);
          }
        }
      }
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

Received Connection::receive(std::chrono::milliseconds timeout, const std::string& awaiting) {
  std::array<std::byte, kHeaderBytes> header_bytes;
  Received received;
  read_exact(header_bytes, timeout, awaiting, &received.fd);
  FrameHeader header = parse_header(header_bytes, peer_);
  std::vector<std::byte> body(header.length);
  read_exact(body, timeout, std::string(message_type_name(header.type)) + " message body", nullptr);
  const auto parse_started = std::chrono::steady_clock::now();
  received.message = parse_body(header.type, body, peer_);
  received.parse_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - parse_started).count();
  return received;
}

void Connection::receive_bytes(std::span<std::byte> bytes, std::chrono::milliseconds timeout, const std::string& what) {
  read_exact(bytes, timeout, what, nullptr);
}

bool Connection::readable() {
  pollfd entry{fd(), POLLIN, 0};
  return ::poll(&entry, 1, 0) > 0;
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
    if (::bind(fd.get(), candidate->ai_addr, candidate->ai_addrlen) != 0 || ::listen(fd.get(), 16) != 0) {
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

Listener Listener::unix_socket(const std::string& path) {
  std::string chosen = path;
  if (chosen.empty()) {
    static std::atomic<unsigned> counter{0};
    const char* directory = std::getenv("TMPDIR");
    chosen = std::string(directory != nullptr && *directory ? directory : "/tmp") + "/weightstream-update-" +
             std::to_string(::getpid()) + "-" + std::to_string(counter++) + ".sock";
  }
  sockaddr_un address = unix_address(chosen);
  FileDescriptor fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  WS_EXPECT(static_cast<bool>(fd), ErrorCode::kNetwork, "cannot create a Unix socket: " + detail::errno_text(errno));
  // Create the socket file with no access for others: the path is the only door to the
  // receiver, so the directory's permissions and this mode decide who may knock.
  mode_t previous = ::umask(0077);
  int bound = ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address));
  int bind_errno = errno;
  ::umask(previous);
  WS_EXPECT(bound == 0, ErrorCode::kNetwork, "cannot listen on Unix socket " + chosen + ": " + detail::errno_text(bind_errno));
  ::chmod(chosen.c_str(), 0600);  // connecting needs write permission only; nobody needs execute
  WS_EXPECT(::listen(fd.get(), 16) == 0, ErrorCode::kNetwork,
            "cannot listen on Unix socket " + chosen + ": " + detail::errno_text(errno));
  Listener listener;
  listener.fd_ = std::move(fd);
  listener.address_ = chosen;
  listener.host_ = "unix";
  listener.unlink_path_ = chosen;
  listener.unix_ = true;
  return listener;
}

Listener::~Listener() {
  if (fd_ && !unlink_path_.empty()) ::unlink(unlink_path_.c_str());
}

Connection Listener::accept(std::chrono::milliseconds timeout) {
  WS_EXPECT(wait_ready(fd_.get(), POLLIN, Clock::now() + timeout), ErrorCode::kTimeout,
            "no sender connected to " + address_ + " within " + seconds_text(timeout));
  sockaddr_storage peer{};
  socklen_t length = sizeof(peer);
  FileDescriptor fd(::accept4(fd_.get(), reinterpret_cast<sockaddr*>(&peer), &length, SOCK_CLOEXEC));
  WS_EXPECT(static_cast<bool>(fd), ErrorCode::kNetwork, "cannot accept on " + address_ + ": " + detail::errno_text(errno));
  if (unix_) return Connection(std::move(fd), "unix peer on " + address_);
  set_nodelay(fd.get());
  return Connection(std::move(fd), "tcp peer " + endpoint_text(peer));
}

Connection connect_to(const std::string& address, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  if (address.find('/') != std::string::npos) {
    sockaddr_un target = unix_address(address);
    FileDescriptor fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    WS_EXPECT(static_cast<bool>(fd), ErrorCode::kNetwork, "cannot create a Unix socket: " + detail::errno_text(errno));
    WS_EXPECT(::connect(fd.get(), reinterpret_cast<const sockaddr*>(&target), sizeof(target)) == 0,
              ErrorCode::kNetwork, "cannot connect to update receiver at Unix socket " + address + ": " +
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
  WS_EXPECT(status == 0, ErrorCode::kNetwork, "cannot resolve update receiver " + address + ": " + ::gai_strerror(status));
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
  WS_FAIL(ErrorCode::kNetwork, "cannot connect to update receiver at " + address + ": " + cause);
}

}  // namespace weightstream::transfer
