#pragma once
// The one HTTP/1.1 client of the object-store backends (s3://, gs://, az://), over libcurl
// (internal to the storage layer). Easy handles are pooled and reused, so their connections
// stay open across requests (libcurl keeps a connection cache per easy handle); a limiter
// bounds requests in flight. This layer only moves bytes: retries live in retry_policy.hpp,
// signing and each service's semantics in its client (S3Client, GcsClient).

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <optional>
#include <utility>

namespace weightstream::storage {

/// One name/value pair (a header or a query parameter).
using Field = std::pair<std::string, std::string>;

/// RFC 3986 percent-encoding: unreserved characters (A-Z a-z 0-9 - . _ ~) stay, every
/// other byte becomes %XY (uppercase hex). '/' stays only when `keep_slash`. What SigV4
/// signs and what GCS's JSON API wants in an object name ('/' encoded too).
std::string uri_encode(std::string_view text, bool keep_slash);

/// "name=value&..." with every name and value percent-encoded, in the order given.
std::string query_string(const std::vector<Field>& query);

/// `url` with any userinfo ("user:password@") replaced by "<redacted>@", for messages.
std::string redact_userinfo(std::string_view url);

/// `text` with every occurrence of each non-empty secret replaced by "<redacted>".
std::string mask_secrets(std::string text, std::initializer_list<std::string_view> secrets);

/// A whole number of decimal digits below 2^64; nullopt for anything else.
std::optional<uint64_t> parse_u64(std::string_view text);

/// Parses a Content-Range value "bytes FIRST-LAST/TOTAL"; nullopt when malformed.
struct ContentRange {
  uint64_t first = 0;
  uint64_t last = 0;
  std::optional<uint64_t> total;  ///< absent for "*"
};
std::optional<ContentRange> parse_content_range(std::string_view value);

/// Connection settings shared by every request of one client (from the transfer fields of
/// S3Options, which every object store shares: see transfer_settings in retry_policy.hpp).
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
  std::string method = "GET";  ///< GET, HEAD, PUT or POST
  std::string url;
  /// Headers sent as given (Host among them when the caller signs it).
  std::vector<Field> headers;
  /// A 2xx body is written across these segments, one after another, when
  /// `into_destination`; one byte more than they hold aborts the transfer (an over-long body).
  std::span<const std::span<std::byte>> destination;
  bool into_destination = false;
  /// Body of a PUT or POST.
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

}  // namespace weightstream::storage
