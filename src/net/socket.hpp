#pragma once
// Sockets of both protocols (the update protocol, update/wire.hpp, and the peer control
// protocol, peer/peer_protocol.hpp): TCP and Unix-socket listeners and connections with
// deadlines, and frames (frame.hpp) over them, optionally carrying one file descriptor
// (SCM_RIGHTS). Every wait is bounded by a timeout; a silent or vanished peer
// becomes Error(kTimeout) or Error(kNetwork) naming the peer and what was awaited.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>


namespace weightstream::transfer {

/// An owned file descriptor, closed on destruction.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) noexcept : fd_(fd) {}
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(other.release()) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept;
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor();
  int get() const noexcept { return fd_; }
  int release() noexcept {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  explicit operator bool() const noexcept { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

/// One connected socket carrying framed messages and raw payload bytes.
class Connection {
 public:
  /// `address`: the other end's bare address, for logs ("127.0.0.1:5555"); empty: `peer`.
  Connection(FileDescriptor fd, std::string peer, std::string address = {})
      : fd_(std::move(fd)), peer_(std::move(peer)), address_(std::move(address)) {}
  /// Who is at the other end, for messages: "tcp peer 127.0.0.1:5555", "unix peer /tmp/x.sock".
  const std::string& peer() const noexcept { return peer_; }
  /// The other end's address as accepted ("127.0.0.1:5555", "unix socket /tmp/x.sock"), for logs.
  const std::string& address() const noexcept { return address_.empty() ? peer_ : address_; }
  /// Renames the other end for messages (a serving peer, not an update receiver).
  void set_peer(std::string peer) { peer_ = std::move(peer); }
  int fd() const noexcept { return fd_.get(); }

  /// Sends one frame: its `header`, then its `body`; `pass_fd` >= 0 is passed with the
  /// header's first byte (Unix sockets only). `what` names the frame in errors ("BUCKET message").
  void send_frame(std::span<const std::byte> header, std::span<const std::byte> body,
                  std::chrono::milliseconds timeout, const std::string& what, int pass_fd = -1);
  /// Reads exactly `bytes.size()` bytes (a frame's header), taking the one descriptor that
  /// came with the first of them into `passed_fd` (any other count of them is closed).
  /// Throws as receive_bytes does.
  void receive_with_fd(std::span<std::byte> bytes, std::chrono::milliseconds timeout, const std::string& what,
                       FileDescriptor& passed_fd);
  /// Writes raw bytes (a TCP bucket payload).
  void send_bytes(std::span<const std::byte> bytes, std::chrono::milliseconds timeout, const std::string& what);
  /// Reads exactly `bytes.size()` raw bytes. `timeout` bounds each wait (silence), not the whole.
  void receive_bytes(std::span<std::byte> bytes, std::chrono::milliseconds timeout, const std::string& what);
  /// Reads what has arrived, up to `bytes.size()`, without waiting: the count read (0 when
  /// nothing is ready). Throws Error(kNetwork) when the peer has closed or reset.
  size_t receive_ready(std::span<std::byte> bytes, const std::string& what);
  /// True when a message (or EOF) is ready to read without waiting.
  bool readable();
  /// True when the other end has closed or reset the connection (EOF or an error is next),
  /// consuming nothing: a message that is ready is not an end.
  bool closed();

 private:
  /// Reads exactly `bytes`; the first chunk may carry a descriptor.
  void read_exact(std::span<std::byte> bytes, std::chrono::milliseconds timeout, const std::string& what,
                  FileDescriptor* received_fd);
  FileDescriptor fd_;
  std::string peer_;
  std::string address_;
};

/// A listening socket (TCP or Unix).
class Listener {
 public:
  /// TCP on "HOST:PORT" (port 0 picks a free one); an empty `address` means "127.0.0.1:0".
  static Listener tcp(const std::string& address);
  /// A Unix stream socket at `path` (mode 0600). A socket file there that nobody listens on
  /// (left by a process that ended without removing it) is replaced; a live one or a file
  /// of another kind is Error(kNetwork). The file is removed on destruction and, where the
  /// process leaves SIGTERM at its default action, when SIGTERM ends the process.
  static Listener unix_socket(const std::string& path);
  /// A fresh socket path in `directory` ("weightstream-update-PID-N.sock"), after removing
  /// the ones there that processes which have ended left behind.
  static std::string fresh_unix_socket_path(const std::string& directory);
  Listener(Listener&&) noexcept = default;
  Listener& operator=(Listener&&) noexcept = default;
  ~Listener();

  /// The address a peer connects to ("127.0.0.1:43211" or the socket path).
  const std::string& address() const noexcept { return address_; }
  /// The host part as bound (for TCP): "127.0.0.1".
  const std::string& bound_host() const noexcept { return host_; }
  /// Waits for one peer. Throws Error(kTimeout) after `timeout`.
  Connection accept(std::chrono::milliseconds timeout);
  /// The listening descriptor, to wait on it together with other sockets.
  int fd() const noexcept { return fd_.get(); }

 private:
  /// A Unix socket's file: unlinked (and no longer listed for SIGTERM) on destruction.
  struct SocketFile {
    std::string path;
    int slot = -1;
    int owner = 0;  ///< pid of the process that bound it
    SocketFile() = default;
    SocketFile(const SocketFile&) = delete;
    SocketFile& operator=(const SocketFile&) = delete;
    ~SocketFile();
  };
  Listener() = default;
  std::unique_ptr<SocketFile> socket_file_;  // declared first: the file goes after the socket closes
  FileDescriptor fd_;
  std::string address_;
  std::string host_;
  bool unix_ = false;
};

/// Connects to "HOST:PORT" (TCP) or, for an address containing '/', a Unix socket path;
/// `what` names the other end in errors. Throws Error(kNetwork) naming it, the address and
/// the errno, Error(kTimeout).
Connection connect_to(const std::string& address, std::chrono::milliseconds timeout,
                      const std::string& what = "update receiver");

/// Splits "HOST:PORT" ("[::1]:PORT" for IPv6). Throws Error(kInvalidArgument).
std::pair<std::string, uint16_t> split_host_port(const std::string& address);

}  // namespace weightstream::transfer
