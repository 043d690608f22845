// Retried: 5xx, 429, 408 (each client decides for its status codes), transport failures
// (reset, refused, stall, timeout) and bodies whose length or range is not the one asked
// for. Not retried: TLS verification failures, malformed URLs, an aborted transfer.
// https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/
// https://docs.aws.amazon.com/sdkref/latest/guide/feature-retry-behavior.html
#include "storage/retry_policy.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

#include "base/text.hpp"

namespace weightstream::storage {
namespace {

using Clock = std::chrono::steady_clock;
using detail::seconds_since;

// Backoff ceiling: no single sleep exceeds this, however many attempts.
constexpr double kMaxBackoffSeconds = 10;
// Two unanswered attempts in a row: the endpoint is taken for dead (S3Options).
constexpr unsigned kSilentAttemptsToGiveUp = 2;

double jittered_backoff(double base, unsigned attempt) {
  thread_local std::mt19937_64 random{std::random_device{}()};
  double ceiling = std::min(kMaxBackoffSeconds, base * std::ldexp(1.0, static_cast<int>(std::min(attempt, 30u)) - 1));
  return std::uniform_real_distribution<double>(0, ceiling)(random);
}

bool retryable_transport(int code) {
  switch (static_cast<CURLcode>(code)) {
    case CURLE_UNSUPPORTED_PROTOCOL:
    case CURLE_URL_MALFORMAT:
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_SSL_CERTPROBLEM:
    case CURLE_SSL_ISSUER_ERROR:
    case CURLE_ABORTED_BY_CALLBACK:
      return false;
    default:
      return true;
  }
}

}  // namespace

std::string describe_range(uint64_t offset, uint64_t size) {
  return std::to_string(offset) + "+" + std::to_string(size) + " bytes";
}

HttpSettings transfer_settings(const S3Options& options) {
  return HttpSettings{options.verify_tls,
                      options.ca_bundle,
                      options.timeout_seconds,
                      options.connect_timeout_seconds,
                      options.first_byte_timeout_seconds,
                      std::max(1u, options.max_connections)};
}

RetryPolicy retry_policy(const S3Options& options, std::string endpoint) {
  return RetryPolicy{std::max(1u, options.max_attempts), options.deadline_seconds, options.retry_base_seconds,
                     std::move(endpoint)};
}

void with_retries(const RetryPolicy& policy, const std::string& operation,
                  const std::function<std::optional<AttemptFailure>(double)>& attempt,
                  std::atomic<uint64_t>& retries, const std::function<std::string(std::string)>& redact) {
  const unsigned max_attempts = std::max(1u, policy.max_attempts);
  const auto start = Clock::now();
  const double deadline = policy.deadline_seconds;
  AttemptFailure last;
  unsigned attempts = 0;
  unsigned silent_in_a_row = 0;
  bool deadline_passed = false;
  std::vector<std::pair<std::string, unsigned>> kinds;  // in order of first occurrence
  while (attempts < max_attempts) {
    const double remaining = deadline - seconds_since(start);
    if (remaining <= 0) {
      deadline_passed = true;
      break;
    }
    ++attempts;
    auto failure = attempt(remaining);
    if (!failure) return;
    last = std::move(*failure);
    std::string kind = last.kind;
    if (kind.empty()) kind = last.cause.substr(0, last.cause.find(" (request id"));
    auto counted = std::find_if(kinds.begin(), kinds.end(), [&](const auto& entry) { return entry.first == kind; });
    if (counted == kinds.end()) kinds.emplace_back(kind, 1);
    else ++counted->second;
    silent_in_a_row = last.silent ? silent_in_a_row + 1 : 0;
    if (!last.retryable || attempts == max_attempts) break;
    if (silent_in_a_row >= kSilentAttemptsToGiveUp) break;
    ++retries;
    const double delay = jittered_backoff(policy.retry_base_seconds, attempts);
    if (seconds_since(start) + delay >= deadline) {
      deadline_passed = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(delay));
  }
  std::string message = operation + ": " + (last.cause.empty() ? std::string("no attempt made") : last.cause) +
                        ", after " + std::to_string(attempts) + (attempts == 1 ? " attempt" : " attempts");
  if (attempts > 1) {
    // Every distinct cause, with how often it occurred: the last one alone can mislead.
    message += " (";
    for (size_t i = 0; i < kinds.size(); ++i) {
      message += (i ? "; " : "") + kinds[i].first + ": " + std::to_string(kinds[i].second) +
                 (kinds[i].second == 1 ? " time" : " times");
    }
    message += ")";
  }
  ErrorCode code = last.code;
  if (last.silent && silent_in_a_row >= kSilentAttemptsToGiveUp && attempts < max_attempts) {
    // Say what was measured: a server too slow for the timeouts looks the same as one that is down.
    message += "; the endpoint " + policy.endpoint + " answered none of the last " + std::to_string(silent_in_a_row) +
               " attempts within the timeouts above, so it was not tried again (a server slower than that needs "
               "longer WEIGHTSTREAM_S3_CONNECT_TIMEOUT / WEIGHTSTREAM_S3_FIRST_BYTE_TIMEOUT)";
  }
  if (deadline_passed) {
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%g", deadline);
    message += std::string(" (deadline of ") + seconds + " s passed, WEIGHTSTREAM_S3_DEADLINE)";
    code = ErrorCode::kTimeout;
  }
  if (!last.advice.empty()) message += "; " + last.advice;
  WS_FAIL(code, redact(std::move(message)));
}

AttemptFailure transport_failure(const HttpResponse& response, std::string_view ca_variable) {
  AttemptFailure failure;
  failure.retryable = response.timed_out || retryable_transport(response.transport_error);
  using Timeout = HttpResponse::Timeout;
  switch (response.timeout) {
    case Timeout::kConnect:
      failure.kind = "connect timeout (WEIGHTSTREAM_S3_CONNECT_TIMEOUT)";
      failure.silent = true;
      break;
    case Timeout::kFirstByte:
      failure.kind = "first-byte timeout (WEIGHTSTREAM_S3_FIRST_BYTE_TIMEOUT)";
      failure.silent = true;
      break;
    case Timeout::kStall:
      failure.kind = "stall timeout (WEIGHTSTREAM_S3_TIMEOUT)";
      break;
    case Timeout::kAttemptCap:
      failure.kind = "timed out";
      break;
    case Timeout::kNone:
      failure.kind = "curl error " + std::to_string(response.transport_error);
      break;
  }
  if (response.timed_out) {
    failure.code = ErrorCode::kTimeout;
    failure.cause = failure.kind + ": " + response.transport_message;
  } else {
    failure.cause = "transfer failed (curl error " + std::to_string(response.transport_error) + ": " +
                    response.transport_message + ")";
  }
  if (response.transport_error == CURLE_PEER_FAILED_VERIFICATION ||
      response.transport_error == CURLE_SSL_CACERT_BADFILE) {
    failure.advice = "check the endpoint's TLS certificate and the CA bundle (" + std::string(ca_variable) + ")";
  }
  return failure;
}

RangeCheck check_range_response(const HttpResponse& response, uint64_t offset, uint64_t size, bool whole_request,
                                const std::string& id_note) {
  RangeCheck check;
  if (response.overflow) {
    if (response.status == 200 && !whole_request) {
      check.failure = AttemptFailure{"the server ignored the Range header (HTTP 200 with the whole object)", false,
                                     ErrorCode::kNetwork};
    } else {
      check.failure = AttemptFailure{"over-long body: more than the " + std::to_string(size) + " bytes asked for", true};
    }
    return check;
  }
  if (whole_request || response.status == 200) {
    if (response.status != 200 || (!whole_request && offset != 0)) {
      check.failure = AttemptFailure{"unexpected HTTP " + std::to_string(response.status) + id_note, true};
      return check;
    }
    check.total = size;
  } else {
    if (response.status != 206) {
      check.failure = AttemptFailure{"unexpected HTTP " + std::to_string(response.status) + id_note, true};
      return check;
    }
    auto range = parse_content_range(response.header("content-range"));
    // A range that runs past the end comes back cut short (RFC 9110 14.1.2): not a
    // fault to retry but a read past the end of the object.
    if (range && range->first == offset && range->total && *range->total < offset + size) {
      check.failure =
          AttemptFailure{"past the end of the " + std::to_string(*range->total) + "-byte object", false, ErrorCode::kIo};
      return check;
    }
    if (!range || range->first != offset || range->last != offset + size - 1) {
      check.failure = AttemptFailure{"Content-Range '" + response.header("content-range").substr(0, 80) +
                                         "' does not match the range asked for" + id_note,
                                     true};
      return check;
    }
    check.total = range->total.value_or(offset + size);
  }
  if (auto length = response.header("content-length"); !length.empty() && parse_u64(length) != size) {
    check.failure = AttemptFailure{
        "Content-Length " + length.substr(0, 40) + " does not match the " + std::to_string(size) + " bytes asked for" +
            id_note,
        true};
    return check;
  }
  if (response.body_bytes != size) {
    check.failure = AttemptFailure{
        "short body: " + std::to_string(response.body_bytes) + " of " + std::to_string(size) + " bytes" + id_note, true};
  }
  return check;
}

}  // namespace weightstream::storage
