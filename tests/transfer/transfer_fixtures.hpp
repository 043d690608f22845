#pragma once
// Shared by the transfer layer's tests: an error's code and text as one string, and the
// receiver and sender options every update test starts from (one shared token, 10 s).
#include <chrono>
#include <functional>
#include <string>

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

}  // namespace weightstream::testing
