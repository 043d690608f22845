#pragma once
// A loopback HTTP server for endpoints no real server plays in these tests: one that accepts
// connections and never answers (a dead endpoint), or one that answers every request with
// one canned response (a token endpoint or a metadata server handing out a fixed answer, a
// server that echoes a secret, or quotes back the Authorization it was sent). Object stores themselves are always the real emulators.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace weightstream::testing {

class LoopbackServer {
 public:
  /// `response` empty: accept and read, never answer (a dead endpoint).
  explicit LoopbackServer(std::string response) : response_(std::move(response)) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
    EXPECT_EQ(::listen(listener_, 16), 0);
    socklen_t length = sizeof(address);
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    thread_ = std::jthread([this](std::stop_token stop) { serve(stop); });
  }
  ~LoopbackServer() {
    thread_.request_stop();
    ::shutdown(listener_, SHUT_RDWR);
    thread_ = {};
    ::close(listener_);
    for (int fd : held_) ::close(fd);
  }
  LoopbackServer(const LoopbackServer&) = delete;
  LoopbackServer& operator=(const LoopbackServer&) = delete;

  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  /// "127.0.0.1:PORT".
  std::string authority() const { return "127.0.0.1:" + std::to_string(port_); }
  int connections() const { return connections_.load(); }
  /// Every request answered so far, headers and body as received.
  std::vector<std::string> requests() const {
    std::lock_guard lock(mutex_);
    return requests_;
  }

 private:
  void serve(std::stop_token stop) {
    while (!stop.stop_requested()) {
      int fd = ::accept(listener_, nullptr, nullptr);
      if (fd < 0) return;
      ++connections_;
      if (response_.empty()) {
        held_.push_back(fd);  // accepted, read by nobody, never answered
        continue;
      }
      std::string request;
      char buffer[4096];
      while (request.find("\r\n\r\n") == std::string::npos) {
        ssize_t got = ::recv(fd, buffer, sizeof(buffer), 0);
        if (got <= 0) break;
        request.append(buffer, static_cast<size_t>(got));
      }
      // The body too (a form POST), so that closing does not reset the connection under
      // unread bytes before the client has read the answer.
      const size_t header_end = request.find("\r\n\r\n");
      size_t body_length = 0;
      for (const char* name : {"\r\nContent-Length:", "\r\ncontent-length:"}) {
        if (auto at = request.find(name); at != std::string::npos && at < header_end)
          body_length = std::strtoul(request.c_str() + at + std::string_view(name).size(), nullptr, 10);
      }
      while (header_end != std::string::npos && request.size() < header_end + 4 + body_length) {
        ssize_t got = ::recv(fd, buffer, sizeof(buffer), 0);
        if (got <= 0) break;
        request.append(buffer, static_cast<size_t>(got));
      }
      {
        std::lock_guard lock(mutex_);
        requests_.push_back(request);
      }
      const std::string response = echo_authorization(request);
      ::send(fd, response.data(), response.size(), MSG_NOSIGNAL);
      ::close(fd);
    }
  }

  // The response with each kEchoAuthorization replaced by the request's Authorization value
  // (a server that quotes back the signature it refused), Content-Length adjusted.
  std::string echo_authorization(const std::string& request) const {
    std::string response = response_;
    if (response.find(kEchoAuthorization) == std::string::npos) return response;
    std::string value;
    if (auto at = request.find("\r\nAuthorization: "); at != std::string::npos) {
      at += 17;
      value = request.substr(at, request.find("\r\n", at) - at);
    }
    for (size_t marker; (marker = response.find(kEchoAuthorization)) != std::string::npos;)
      response.replace(marker, kEchoAuthorization.size(), value);
    const size_t body = response.find("\r\n\r\n");
    const size_t length = response.find("Content-Length: ");
    if (body != std::string::npos && length != std::string::npos && length < body) {
      const size_t end = response.find("\r\n", length);
      response.replace(length + 16, end - length - 16, std::to_string(response.size() - body - 4));
    }
    return response;
  }

 public:
  /// Put in a canned response, replaced by the Authorization header of each request answered.
  static constexpr std::string_view kEchoAuthorization = "{{authorization}}";

 private:
  std::string response_;
  int listener_ = -1;
  int port_ = 0;
  std::vector<int> held_;
  std::atomic<int> connections_{0};
  mutable std::mutex mutex_;
  std::vector<std::string> requests_;
  std::jthread thread_;
};

/// An HTTP/1.1 response with a JSON body, closing the connection.
inline std::string json_response(int status, const std::string& reason, const std::string& body) {
  return "HTTP/1.1 " + std::to_string(status) + " " + reason +
         "\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\n\r\n" + body;
}

}  // namespace weightstream::testing
