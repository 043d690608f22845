#pragma once
// A small HTTP/1.1 client over libcurl for the S3 backend (internal to the storage layer).
// Easy handles are pooled and reused, so their connections stay open across requests
// (libcurl keeps a connection cache per easy handle); a limiter bounds requests in flight.
// This layer only moves bytes: retries, signing and S3 semantics live in S3Client.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "storage/s3_signer.hpp"

namespace weightstream::s3 {

/// Connection settings shared by every request of one client.
struct HttpSettings {
  bool verify_tls = true;
  std::string ca_bundle;           ///< CA file; empty uses libcurl's default
  double stall_seconds = 30;       ///< a transfer under 1 byte/s for this long fails
  double connect_seconds = 3;      ///< a connection not made within this long fails
  double first_byte_seconds = 3;   ///< no response byte this long after the request was sent fails
  unsigned max_connections = 32;   ///< requests in flight at once (and pooled handles)
};

/// One request.
struct HttpRequest {
  std::string method = "GET";  ///< GET, HEAD or PUT
  std::string url;
  /// Headers sent as given (Host among them when the caller signs it).
  std::vector<Field> headers;
  /// A 2xx body is written across these segments, one after another, when
  /// `into_destination`; one byte more than they hold aborts the transfer (an over-long body).
  std::span<const std::span<std::byte>> destination;
  bool into_destination = false;
  /// Body of a PUT.
  std::string_view upload;
  /// Hard cap on this attempt's duration in seconds (0: none).
  double timeout_seconds = 0;
  /// Largest body kept in HttpResponse::body (error documents, listings).
  size_t max_body_bytes = 16 * 1024 * 1024;
};

/// The outcome of one request. A transport failure sets `transport_error`; an HTTP status
/// of any value is a successful transport.
struct HttpResponse {
  int transport_error = 0;        ///< libcurl's CURLcode, 0 on success
  std::string transport_message;  ///< libcurl's description of it
  bool timed_out = false;         ///< one of the timeouts below, or the attempt's cap, fired
  /// Which timeout ended the transfer, when one did.
  enum class Timeout { kNone, kConnect, kFirstByte, kStall, kAttemptCap };
  Timeout timeout = Timeout::kNone;
  uint64_t uploaded_bytes = 0;    ///< request body bytes sent
  long status = 0;
  std::vector<Field> headers;     ///< names lowercased
  std::string body;               ///< body, when not written to the destination
  uint64_t body_bytes = 0;        ///< body bytes received in all
  bool overflow = false;          ///< more body than the destination or max_body_bytes holds

  /// The value of header `name` (lowercase), or empty.
  std::string header(std::string_view name) const;
};

/// Thread-safe: any number of threads may call perform(); at most max_connections run at once.
class HttpClient {
 public:
  explicit HttpClient(HttpSettings settings);
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  /// Sends `request` and waits for the whole response. Never throws for a network or HTTP
  /// failure (they are in the response); throws Error(kInternal) if libcurl cannot start.
  HttpResponse perform(const HttpRequest& request);

  /// Easy handles created so far (each keeps its connections): a test of reuse.
  size_t handles_created() const;

 private:
  struct HandleDeleter {
    void operator()(void* handle) const;
  };
  using Handle = std::unique_ptr<void, HandleDeleter>;
  Handle acquire();
  void release(Handle handle);

  HttpSettings settings_;
  mutable std::mutex mutex_;
  std::condition_variable available_;
  std::vector<Handle> idle_;
  unsigned in_flight_ = 0;
  size_t created_ = 0;
};

}  // namespace weightstream::s3
