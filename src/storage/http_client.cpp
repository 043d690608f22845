#include "storage/http_client.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "storage/shared/read_destination.hpp"
#include "weightstream/error.hpp"

namespace weightstream::storage {
namespace {

// curl_global_init is not thread-safe before libcurl 7.84; a function-local static runs it
// exactly once, before the first handle is made.
void ensure_curl_initialized() {
  static const CURLcode result = curl_global_init(CURL_GLOBAL_DEFAULT);
  WS_EXPECT(result == CURLE_OK, ErrorCode::kInternal,
            std::string("curl_global_init failed: ") + curl_easy_strerror(result));
}

struct SlistDeleter {
  void operator()(curl_slist* list) const { curl_slist_free_all(list); }
};
using Slist = std::unique_ptr<curl_slist, SlistDeleter>;

// State of one transfer, shared with libcurl's callbacks.
struct Transfer {
  const HttpRequest* request = nullptr;
  HttpResponse* response = nullptr;
  size_t upload_offset = 0;
  double stall_seconds = 30;
  double first_byte_seconds = 3;
  // Progress watch for stall and first-byte detection (see on_progress).
  curl_off_t last_bytes = -1;
  curl_off_t uploaded = 0;
  std::chrono::steady_clock::time_point last_progress = std::chrono::steady_clock::now();
  bool request_started = false;  // connected: the request is being sent (on_prerequest)
  std::chrono::steady_clock::time_point request_start;
  bool answered = false;  // a byte of the response (its status line) has arrived
  HttpResponse::Timeout timeout = HttpResponse::Timeout::kNone;
  // Where the next body byte goes: request->destination[segment], from segment_offset.
  uint64_t destination_bytes = 0;
  size_t segment = 0;
  size_t segment_offset = 0;

  bool body_to_destination() const {
    return request->into_destination && response->status >= 200 && response->status < 300;
  }
};

size_t on_header(char* data, size_t size, size_t count, void* user) {
  auto& transfer = *static_cast<Transfer*>(user);
  const size_t length = size * count;
  std::string_view line(data, length);
  while (!line.empty() && (line.back() == '\r' || line.back() == '\n')) line.remove_suffix(1);
  transfer.answered = true;
  if (line.starts_with("HTTP/")) {
    // A new status line (after a 100 Continue, say) starts a new set of headers.
    transfer.response->headers.clear();
    auto space = line.find(' ');
    transfer.response->status = space == std::string_view::npos ? 0 : std::atol(std::string(line.substr(space + 1, 3)).c_str());
    return length;
  }
  auto colon = line.find(':');
  if (colon == std::string_view::npos) return length;
  std::string name(line.substr(0, colon));
  for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::string_view value = line.substr(colon + 1);
  while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
  while (!value.empty() && (value.back() == ' ' || value.back() == '\t')) value.remove_suffix(1);
  transfer.response->headers.emplace_back(std::move(name), std::string(value));
  return length;
}

size_t on_body(char* data, size_t size, size_t count, void* user) {
  auto& transfer = *static_cast<Transfer*>(user);
  auto& response = *transfer.response;
  const size_t length = size * count;
  if (transfer.body_to_destination()) {
    if (response.body_bytes + length > transfer.destination_bytes) {
      // More bytes than the range asked for: stop now rather than write past the buffer.
      response.overflow = true;
      return 0;  // any count other than `length` aborts the transfer
    }
    for (size_t left = length; left > 0;) {
      std::span<std::byte> segment = transfer.request->destination[transfer.segment];
      const size_t take = std::min(left, segment.size() - transfer.segment_offset);
      std::memcpy(segment.data() + transfer.segment_offset, data + (length - left), take);
      left -= take;
      transfer.segment_offset += take;
      if (transfer.segment_offset == segment.size()) {
        ++transfer.segment;
        transfer.segment_offset = 0;
      }
    }
  } else {
    if (response.body.size() + length > transfer.request->max_body_bytes) {
      response.overflow = true;
      return 0;  // any count other than `length` aborts the transfer
    }
    response.body.append(data, length);
  }
  response.body_bytes += length;
  return length;
}

size_t on_upload(char* buffer, size_t size, size_t count, void* user) {
  auto& transfer = *static_cast<Transfer*>(user);
  auto upload = transfer.request->upload;
  size_t length = std::min(size * count, upload.size() - transfer.upload_offset);
  std::memcpy(buffer, upload.data() + transfer.upload_offset, length);
  transfer.upload_offset += length;
  return length;
}

// Called once the connection is made, just before the request goes out: the first-byte
// clock starts here, so a slow connect is the connect timeout's alone.
int on_prerequest(void* user, char*, char*, int, int) {
  auto& transfer = *static_cast<Transfer*>(user);
  transfer.request_started = true;
  transfer.request_start = std::chrono::steady_clock::now();
  return CURL_PREREQFUNC_OK;
}

// libcurl's own low-speed check averages over several seconds, so a body that arrives fast
// and then stops is noticed late. This watch fails the transfer once no byte has moved in
// either direction for stall_seconds, and, before any byte of the response, once the request
// has been sent whole and first_byte_seconds pass without an answer. libcurl calls it at
// least once a second, so either fires within a second of its time.
int on_progress(void* user, curl_off_t, curl_off_t downloaded, curl_off_t, curl_off_t uploaded) {
  auto& transfer = *static_cast<Transfer*>(user);
  const auto now = std::chrono::steady_clock::now();
  transfer.uploaded = uploaded;
  if (downloaded + uploaded != transfer.last_bytes) {
    transfer.last_bytes = downloaded + uploaded;
    transfer.last_progress = now;
    return 0;
  }
  if (!transfer.request_started) return 0;  // still connecting: CURLOPT_CONNECTTIMEOUT_MS
  const bool sent = static_cast<size_t>(uploaded) >= transfer.request->upload.size();
  if (!transfer.answered && sent) {
    const auto since = std::max(transfer.request_start, transfer.last_progress);
    if (std::chrono::duration<double>(now - since).count() > transfer.first_byte_seconds) {
      transfer.timeout = HttpResponse::Timeout::kFirstByte;
      return 1;
    }
    return 0;
  }
  if (std::chrono::duration<double>(now - transfer.last_progress).count() > transfer.stall_seconds) {
    transfer.timeout = HttpResponse::Timeout::kStall;
    return 1;
  }
  return 0;
}

std::string format_seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", seconds);
  return text;
}

// The request's header lines, in its order, and the empty Expect that stops libcurl's own.
Slist request_headers(const HttpRequest& request) {
  Slist headers;
  for (const auto& [name, value] : request.headers) {
    std::string line = name + ": " + value;
    curl_slist* appended = curl_slist_append(headers.get(), line.c_str());
    WS_EXPECT(appended != nullptr, ErrorCode::kInternal, "curl_slist_append failed");
    headers.release();
    headers.reset(appended);
  }
  // libcurl adds "Expect: 100-continue" to uploads; S3-compatible servers vary in honouring it.
  if (request.method == "PUT" || request.method == "POST") {
    curl_slist* appended = curl_slist_append(headers.get(), "Expect:");
    WS_EXPECT(appended != nullptr, ErrorCode::kInternal, "curl_slist_append failed");
    headers.release();
    headers.reset(appended);
  }
  return headers;
}

// Everything but the method: the URL, the callbacks into `transfer`, the timeouts and TLS.
void set_transfer_options(CURL* curl, const HttpRequest& request, const HttpSettings& settings, Transfer& transfer,
                          curl_slist* headers, char* error_text) {
  curl_easy_setopt(curl, CURLOPT_URL, request.url.c_str());
  curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, error_text);
  // Signals are unsafe with many threads (the resolver's timeout would use SIGALRM).
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(curl, CURLOPT_FOLLOWLOCATION, 0L);
  curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(curl, CURLOPT_HEADERDATA, &transfer);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &transfer);
  curl_easy_setopt(curl, CURLOPT_BUFFERSIZE, 512L * 1024);
  curl_easy_setopt(curl, CURLOPT_TCP_KEEPALIVE, 1L);
  // A stalled transfer fails in on_progress, which can say what had moved; libcurl's own
  // low-speed check (under 1 byte/s) is set 2 s later, only as a backstop. Either way the
  // caller retries it.
  const long stall = std::max(1L, static_cast<long>(std::lround(settings.stall_seconds))) + 2;
  curl_easy_setopt(curl, CURLOPT_NOPROGRESS, 0L);
  curl_easy_setopt(curl, CURLOPT_XFERINFOFUNCTION, on_progress);
  curl_easy_setopt(curl, CURLOPT_XFERINFODATA, &transfer);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(curl, CURLOPT_LOW_SPEED_TIME, stall);
  curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, std::max(1L, static_cast<long>(settings.connect_seconds * 1000)));
  curl_easy_setopt(curl, CURLOPT_PREREQFUNCTION, on_prerequest);
  curl_easy_setopt(curl, CURLOPT_PREREQDATA, &transfer);
  if (request.timeout_seconds > 0) {
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, std::max(1L, static_cast<long>(request.timeout_seconds * 1000)));
  }
  curl_easy_setopt(curl, CURLOPT_SSL_VERIFYPEER, settings.verify_tls ? 1L : 0L);
  curl_easy_setopt(curl, CURLOPT_SSL_VERIFYHOST, settings.verify_tls ? 2L : 0L);
  if (!settings.ca_bundle.empty()) curl_easy_setopt(curl, CURLOPT_CAINFO, settings.ca_bundle.c_str());
}

void set_method_options(CURL* curl, const HttpRequest& request, Transfer& transfer) {
  if (request.method == "HEAD") {
    curl_easy_setopt(curl, CURLOPT_NOBODY, 1L);
  } else if (request.method == "PUT") {
    curl_easy_setopt(curl, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(curl, CURLOPT_READFUNCTION, on_upload);
    curl_easy_setopt(curl, CURLOPT_READDATA, &transfer);
    curl_easy_setopt(curl, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(request.upload.size()));
  } else if (request.method == "POST") {
    // A form or a small upload, sent from the caller's memory (which outlives the transfer).
    curl_easy_setopt(curl, CURLOPT_POST, 1L);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, request.upload.data());
    curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(request.upload.size()));
  } else if (request.method != "GET") {
    curl_easy_setopt(curl, CURLOPT_CUSTOMREQUEST, request.method.c_str());
  }
}

// The transport error of a failed transfer, with the timeout that ended it in words.
void record_transport_failure(HttpResponse& response, CURLcode code, const char* error_text, const Transfer& transfer,
                              const HttpSettings& settings) {
  const HttpRequest& request = *transfer.request;
  response.transport_error = static_cast<int>(code);
  response.transport_message = error_text[0] ? error_text : curl_easy_strerror(code);
  response.timeout = transfer.timeout;
  if (response.timeout == HttpResponse::Timeout::kNone && code == CURLE_OPERATION_TIMEDOUT) {
    response.timeout = transfer.request_started ? HttpResponse::Timeout::kAttemptCap : HttpResponse::Timeout::kConnect;
  }
  response.timed_out = response.timeout != HttpResponse::Timeout::kNone;
  const std::string upload_total = std::to_string(request.upload.size());
  const std::string body_total = response.header("content-length");
  switch (response.timeout) {
    case HttpResponse::Timeout::kConnect:
      response.transport_message = "no connection within " + format_seconds(settings.connect_seconds) + " s";
      break;
    case HttpResponse::Timeout::kFirstByte:
      response.transport_message = "no response within " + format_seconds(settings.first_byte_seconds) +
                                   " s of sending the request" +
                                   (request.upload.empty() ? "" : " (its " + upload_total + "-byte body sent whole)");
      break;
    case HttpResponse::Timeout::kStall:
      // Say what had moved: the request body sent, the status, the body bytes received.
      response.transport_message = "no byte moved for " + format_seconds(settings.stall_seconds) + " s after ";
      if (!request.upload.empty() && static_cast<size_t>(transfer.uploaded) < request.upload.size()) {
        response.transport_message += std::to_string(transfer.uploaded) + " of " + upload_total +
                                      " request body bytes were sent";
      } else {
        response.transport_message += "HTTP " + std::to_string(response.status) + " and " +
                                      std::to_string(response.body_bytes) + " of " +
                                      (body_total.empty() ? std::string("?") : body_total.substr(0, 20)) +
                                      " body bytes arrived";
      }
      break;
    case HttpResponse::Timeout::kAttemptCap:
    case HttpResponse::Timeout::kNone:
      break;
  }
}

}  // namespace

std::string uri_encode(std::string_view text, bool keep_slash) {
  static constexpr char kDigits[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~' || (keep_slash && c == '/')) {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kDigits[c >> 4];
      out += kDigits[c & 15];
    }
  }
  return out;
}

std::string query_string(const std::vector<Field>& query) {
  std::string out;
  for (const auto& [name, value] : query) {
    if (!out.empty()) out += '&';
    out += uri_encode(name, false) + "=" + uri_encode(value, false);
  }
  return out;
}

std::string redact_userinfo(std::string_view url) {
  auto scheme_end = url.find("://");
  size_t authority_start = scheme_end == std::string_view::npos ? 0 : scheme_end + 3;
  size_t authority_end = url.find_first_of("/?#", authority_start);
  if (authority_end == std::string_view::npos) authority_end = url.size();
  auto at = url.substr(authority_start, authority_end - authority_start).rfind('@');
  if (at == std::string_view::npos) return std::string(url);
  return std::string(url.substr(0, authority_start)) + "<redacted>" + std::string(url.substr(authority_start + at));
}

std::string mask_secrets(std::string text, std::initializer_list<std::string_view> secrets) {
  for (std::string_view secret : secrets) {
    if (secret.empty()) continue;
    for (size_t at = 0; (at = text.find(secret, at)) != std::string::npos;) {
      text.replace(at, secret.size(), "<redacted>");
      at += std::string_view("<redacted>").size();
    }
  }
  return text;
}

std::optional<uint64_t> parse_u64(std::string_view text) {
  uint64_t value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

std::optional<ContentRange> parse_content_range(std::string_view value) {
  if (!value.starts_with("bytes ")) return std::nullopt;
  value.remove_prefix(6);
  auto dash = value.find('-');
  auto slash = value.find('/');
  if (dash == std::string_view::npos || slash == std::string_view::npos || dash > slash) return std::nullopt;
  auto first = parse_u64(value.substr(0, dash));
  auto last = parse_u64(value.substr(dash + 1, slash - dash - 1));
  if (!first || !last || *last < *first) return std::nullopt;
  ContentRange range{*first, *last, std::nullopt};
  auto total_text = value.substr(slash + 1);
  if (total_text != "*") {
    auto total = parse_u64(total_text);
    if (!total || *total <= *last) return std::nullopt;
    range.total = *total;
  }
  return range;
}

std::string HttpResponse::header(std::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (key == name) return value;
  }
  return {};
}

void HttpClient::HandleDeleter::operator()(void* handle) const { curl_easy_cleanup(static_cast<CURL*>(handle)); }

HttpClient::HttpClient(HttpSettings settings) : settings_(std::move(settings)) {
  if (settings_.max_connections == 0) settings_.max_connections = 1;
  ensure_curl_initialized();
}

HttpClient::~HttpClient() = default;

size_t HttpClient::handles_created() const {
  std::lock_guard lock(mutex_);
  return created_;
}

HttpClient::Handle HttpClient::acquire() {
  std::unique_lock lock(mutex_);
  available_.wait(lock, [&] { return in_flight_ < settings_.max_connections; });
  ++in_flight_;
  if (!idle_.empty()) {
    Handle handle = std::move(idle_.back());
    idle_.pop_back();
    return handle;
  }
  ++created_;
  lock.unlock();
  Handle handle(curl_easy_init());
  if (!handle) {
    release(nullptr);
    WS_FAIL(ErrorCode::kInternal, "curl_easy_init failed");
  }
  return handle;
}

void HttpClient::release(Handle handle) {
  {
    std::lock_guard lock(mutex_);
    --in_flight_;
    if (handle) idle_.push_back(std::move(handle));
  }
  available_.notify_one();
}

HttpResponse HttpClient::perform(const HttpRequest& request) {
  HttpResponse response;
  Handle owned = acquire();
  struct Returner {
    HttpClient* client;
    Handle* handle;
    ~Returner() { client->release(std::move(*handle)); }
  } returner{this, &owned};
  auto* curl = static_cast<CURL*>(owned.get());
  // A reset keeps the handle's connection cache: that is the reuse this pool exists for.
  curl_easy_reset(curl);

  Slist headers = request_headers(request);
  Transfer transfer{.request = &request, .response = &response};
  transfer.stall_seconds = settings_.stall_seconds;
  transfer.first_byte_seconds = settings_.first_byte_seconds;
  transfer.destination_bytes = segments_bytes(request.destination);
  char error_text[CURL_ERROR_SIZE] = {0};
  set_transfer_options(curl, request, settings_, transfer, headers.get(), error_text);
  set_method_options(curl, request, transfer);

  CURLcode code = curl_easy_perform(curl);
  long status = 0;
  curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
  if (status != 0) response.status = status;
  response.uploaded_bytes = static_cast<uint64_t>(std::max<curl_off_t>(0, transfer.uploaded));
  if (code != CURLE_OK) {
    record_transport_failure(response, code, error_text, transfer, settings_);
    // A failed transfer may leave its connection half-read; libcurl closes such connections
    // itself, so the handle stays reusable.
  }
  return response;
}

}  // namespace weightstream::storage
