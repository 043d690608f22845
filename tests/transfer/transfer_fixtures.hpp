#pragma once
// Shared by the transfer layer's tests: an error's code and text as one string, and the
// receiver and sender options every update test starts from (one shared token, 10 s).
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "net/socket.hpp"
#include "weightstream/error.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream::testing {

/// "code: message" of the Error `action` throws, or "no error".
inline std::string error_text(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    return std::string(error_code_name(error.code())) + ": " + error.what();
  }
  return "no error";
}

inline ReceiverOptions receiver_options(TransportKind kind) {
  ReceiverOptions options;
  options.transport = kind;
  options.token = "shared-secret";
  options.timeout = std::chrono::seconds(10);
  return options;
}

inline SenderOptions sender_options(TransportKind kind, uint64_t bucket_bytes = 64 << 10) {
  SenderOptions options;
  options.transport = kind;
  options.token = "shared-secret";
  options.bucket_bytes = bucket_bytes;
  options.timeout = std::chrono::seconds(10);
  return options;
}

/// Sends `views` in `format` from a thread; the future holds the sender's report or error.
inline std::future<UpdateReport> send_async(std::string address, SenderOptions options, std::vector<TensorView> views,
                                            TensorFormat format = TensorFormat::kCheckpoint) {
  return std::async(std::launch::async, [=] {
    UpdateSender sender(address, options);
    sender.start(format, declared_tensors(views));
    for (const TensorView& view : views) sender.send(view);
    return sender.finish();
  });
}

/// A TCP proxy on loopback that relays every connection to `target` and records the bytes
/// each side sent: what anyone on the path would see.
class RecordingProxy {
 public:
  explicit RecordingProxy(std::string target)
      : target_(std::move(target)), listener_(transfer::Listener::tcp("127.0.0.1:0")) {
    thread_ = std::thread([this] { accept_loop(); });
  }
  ~RecordingProxy() {
    stop_ = true;
    thread_.join();
    for (std::thread& relay : relays_) relay.join();
  }
  RecordingProxy(const RecordingProxy&) = delete;
  RecordingProxy& operator=(const RecordingProxy&) = delete;

  const std::string& address() const noexcept { return listener_.address(); }
  /// Bytes the connecting side (sender, puller) sent, and those the listening side sent,
  /// over every connection so far.
  std::string from_client() const {
    std::lock_guard lock(mutex_);
    return from_client_;
  }
  std::string from_server() const {
    std::lock_guard lock(mutex_);
    return from_server_;
  }
  /// What the connecting side sent on the `index`-th connection.
  std::string from_client_on(size_t index) const {
    std::lock_guard lock(mutex_);
    return index < per_connection_.size() ? per_connection_[index] : std::string();
  }

 private:
  void accept_loop() {
    while (!stop_) {
      pollfd wait{listener_.fd(), POLLIN, 0};
      if (::poll(&wait, 1, 50) <= 0) continue;
      try {
        transfer::Connection client = listener_.accept(std::chrono::milliseconds(0));
        transfer::Connection server = transfer::connect_to(target_, std::chrono::seconds(5), "proxied server");
        size_t index;
        {
          std::lock_guard lock(mutex_);
          index = per_connection_.size();
          per_connection_.emplace_back();
        }
        relays_.emplace_back([this, index, c = std::move(client), s = std::move(server)]() mutable {
          relay(c, s, index);
        });
      } catch (const Error&) {
      }
    }
  }
  void relay(transfer::Connection& client, transfer::Connection& server, size_t index) {
    bool open[2] = {true, true};
    while (!stop_ && (open[0] || open[1])) {
      pollfd waits[2] = {{open[0] ? client.fd() : -1, POLLIN, 0}, {open[1] ? server.fd() : -1, POLLIN, 0}};
      if (::poll(waits, 2, 50) <= 0) continue;
      for (int side = 0; side < 2; ++side) {
        if (waits[side].revents == 0) continue;
        char buffer[65536];
        const int from = side == 0 ? client.fd() : server.fd();
        const int to = side == 0 ? server.fd() : client.fd();
        const ssize_t got = ::recv(from, buffer, sizeof(buffer), MSG_DONTWAIT);
        if (got <= 0) {
          open[side] = false;
          ::shutdown(to, SHUT_WR);
          continue;
        }
        {
          std::lock_guard lock(mutex_);
          (side == 0 ? from_client_ : from_server_).append(buffer, static_cast<size_t>(got));
          if (side == 0) per_connection_[index].append(buffer, static_cast<size_t>(got));
        }
        for (ssize_t sent = 0; sent < got;) {
          const ssize_t n = ::send(to, buffer + sent, static_cast<size_t>(got - sent), MSG_NOSIGNAL);
          if (n <= 0) break;
          sent += n;
        }
      }
    }
  }

  std::string target_;
  transfer::Listener listener_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::vector<std::thread> relays_;
  mutable std::mutex mutex_;
  std::string from_client_;
  std::string from_server_;
  std::vector<std::string> per_connection_;
};

}  // namespace weightstream::testing
