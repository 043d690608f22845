#pragma once
// The one retry policy of the object-store backends (s3://, gs://, az://), internal to the storage
// layer: exponential backoff with "full jitter" (sleep uniformly in [0, min(cap, base *
// 2^attempt)]) after AWS's guidance, which Google's client libraries follow too
// (https://cloud.google.com/storage/docs/retry-strategy), a deadline across attempts, and
// an endpoint that answers nothing given up on after two silent attempts. Also what every
// client judges the same way: transport failures and the body of a ranged GET.

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "storage/http_client.hpp"
#include "weightstream/error.hpp"
#include "weightstream/options.hpp"

namespace weightstream::storage {

/// Why one attempt failed, and whether another may succeed.
struct AttemptFailure {
  AttemptFailure() = default;
  AttemptFailure(std::string cause_text, bool may_retry, ErrorCode error_code = ErrorCode::kNetwork)
      : cause(std::move(cause_text)), retryable(may_retry), code(error_code) {}
  std::string cause;  ///< "HTTP 503 SlowDown (request id 7F3A…)", "connection reset (…)"
  bool retryable = true;
  ErrorCode code = ErrorCode::kNetwork;
  std::string advice;  ///< what to check, for errors that are not retried
  /// The kind of cause, without what differs per attempt (request id, byte counts), e.g.
  /// "HTTP 503 SlowDown": the final error counts attempts by it. Empty: `cause` up to
  /// any " (request id".
  std::string kind;
  /// No answer at all (connect or first-byte timeout): a request ends after two of these
  /// in a row rather than waiting out every attempt on a dead endpoint.
  bool silent = false;
};

/// How often and how long a request is tried.
struct RetryPolicy {
  unsigned max_attempts = 5;        ///< first attempt included; 0 counts as 1
  double deadline_seconds = 300;    ///< across all attempts of one request
  double retry_base_seconds = 0.1;  ///< first backoff ceiling; doubles per attempt, capped at 10 s
  /// "http://host:port" of the endpoint, named when it stops answering.
  std::string endpoint;
};

/// The transfer fields of S3Options (WEIGHTSTREAM_S3_CONNECTIONS, _TIMEOUT, ...) as the
/// HTTP client's settings; every object store reads with them.
HttpSettings transfer_settings(const S3Options& options);
/// The retry fields of S3Options (WEIGHTSTREAM_S3_MAX_ATTEMPTS, _DEADLINE, _RETRY_BASE).
RetryPolicy retry_policy(const S3Options& options, std::string endpoint);

/// Runs `attempt` (given the seconds left before the deadline) until it succeeds, fails
/// for good, runs out of attempts or passes the deadline; then throws one Error that
/// starts with `operation` ("cannot read 0+4096 bytes of s3://b/k"), counts every attempt's
/// cause, and has passed through `redact` (which masks the caller's secrets). Each retry
/// adds one to `retries`.
void with_retries(const RetryPolicy& policy, const std::string& operation,
                  const std::function<std::optional<AttemptFailure>(double)>& attempt,
                  std::atomic<uint64_t>& retries, const std::function<std::string(std::string)>& redact);

/// The failure of an attempt whose transport failed (response.transport_error != 0): its
/// timeout or curl error, whether a retry may help, and TLS advice naming `ca_variable`.
AttemptFailure transport_failure(const HttpResponse& response, std::string_view ca_variable);

/// Judges the 2xx answer (complete, or cut off as over-long) to a GET of bytes
/// [offset, offset + size): 206 with the Content-Range asked for, a matching Content-Length
/// and exactly `size` body bytes; a 200 only for a range from 0 or a `whole_request` (a GET
/// sent without a Range header). `id_note` (" (request id …)") is added to the causes. Returns the
/// object's total size, or the failure.
struct RangeCheck {
  std::optional<AttemptFailure> failure;
  uint64_t total = 0;
};
RangeCheck check_range_response(const HttpResponse& response, uint64_t offset, uint64_t size, bool whole_request,
                                const std::string& id_note);

/// "4096+1048576 bytes", how messages name a range.
std::string describe_range(uint64_t offset, uint64_t size);

}  // namespace weightstream::storage
