// The only place in weightstream that reads environment variables.
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <functional>

#include "weightstream/error.hpp"
#include "weightstream/options.hpp"

extern char** environ;

namespace weightstream {
namespace {

const std::string* find(const Environment& environment, std::string_view name) {
  auto it = environment.find(name);
  return it == environment.end() ? nullptr : &it->second;
}

std::string first_of(const Environment& environment, std::initializer_list<std::string_view> names) {
  for (auto name : names) {
    if (const auto* value = find(environment, name); value && !value->empty()) return *value;
  }
  return {};
}

uint64_t parse_unsigned(std::string_view name, std::string_view text, uint64_t minimum, uint64_t maximum) {
  uint64_t value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  WS_EXPECT(error == std::errc() && end == text.data() + text.size() && value >= minimum && value <= maximum,
            ErrorCode::kConfig,
            std::string(name) + "='" + std::string(text) + "': expected a whole number from " +
                std::to_string(minimum) + " to " + std::to_string(maximum));
  return value;
}

bool parse_flag(std::string_view name, std::string_view text) {
  if (text == "1" || text == "true" || text == "yes" || text == "on") return true;
  if (text == "0" || text == "false" || text == "no" || text == "off") return false;
  WS_FAIL(ErrorCode::kConfig, std::string(name) + "='" + std::string(text) +
                                  "': expected 1, true, yes or on, or 0, false, no or off");
}

/// Runs one of the public parsers on a variable's value; its error becomes a config error.
template <typename Parse>
auto parse_variable(Parse parse) {
  try {
    return parse();
  } catch (const Error& error) {
    throw Error(ErrorCode::kConfig, error.what());
  }
}

uint64_t parse_size_variable(std::string_view name, std::string_view text) {
  return parse_variable([&] { return parse_size(text, name); });
}

double parse_seconds(std::string_view name, std::string_view text) {
  return parse_variable([&] { return parse_duration(text, name); });
}

std::string quoted(std::string_view what, std::string_view text) {
  return std::string(what) + "='" + std::string(text) + "'";
}

/// One WEIGHTSTREAM_* variable: its name and how its value lands in Options. The table
/// drives the parse, the check for unknown names and the list in that error's message.
struct Variable {
  std::string_view name;
  std::function<void(Options&, std::string_view name, const std::string& value)> apply;
};

template <typename Parse>
auto stream_field(auto StreamOptions::* field, Parse parse) {
  return [field, parse](Options& options, std::string_view name, const std::string& value) {
    options.stream.*field = parse(name, value);
  };
}

template <typename Parse>
auto s3_field(auto S3Options::* field, Parse parse) {
  return [field, parse](Options& options, std::string_view name, const std::string& value) {
    options.s3.*field = parse(name, value);
  };
}

auto whole_number(uint64_t minimum, uint64_t maximum) {
  return [minimum, maximum](std::string_view name, std::string_view text) {
    return static_cast<unsigned>(parse_unsigned(name, text, minimum, maximum));
  };
}

S3Addressing parse_addressing(std::string_view name, std::string_view text) {
  if (text == "auto") return S3Addressing::kAuto;
  if (text == "path") return S3Addressing::kPath;
  if (text == "virtual") return S3Addressing::kVirtual;
  WS_FAIL(ErrorCode::kConfig, quoted(name, text) + ": expected auto, path or virtual");
}

// In parse order: the staging variables come first, as check_stream_options names them.
const Variable kVariables[] = {
    {"WEIGHTSTREAM_CONCURRENCY", stream_field(&StreamOptions::concurrency, whole_number(1, 1024))},
    {"WEIGHTSTREAM_MEMORY_LIMIT", stream_field(&StreamOptions::memory_limit, parse_size_variable)},
    {"WEIGHTSTREAM_CHUNK_SIZE", stream_field(&StreamOptions::chunk_bytes, parse_size_variable)},
    {"WEIGHTSTREAM_LOCAL_IO", stream_field(&StreamOptions::local_io, [](std::string_view name, std::string_view text) {
       return parse_variable([&] { return parse_local_io(text, name); });
     })},
    {"WEIGHTSTREAM_GPU_PATH", stream_field(&StreamOptions::gpu_path, [](std::string_view name, std::string_view text) {
       return parse_variable([&] { return parse_gpu_path(text, name); });
     })},
    {"WEIGHTSTREAM_MAPPED_SHARE", stream_field(&StreamOptions::mapped_share, [](std::string_view name, std::string_view text) {
       return parse_variable([&] { return parse_share(text, name); });
     })},
    {"WEIGHTSTREAM_PREFETCHERS", stream_field(&StreamOptions::prefetchers, whole_number(0, 1024))},
    {"WEIGHTSTREAM_PROGRESS", stream_field(&StreamOptions::progress, parse_flag)},
    {"WEIGHTSTREAM_S3_ADDRESSING", s3_field(&S3Options::addressing, parse_addressing)},
    {"WEIGHTSTREAM_S3_UNSIGNED", s3_field(&S3Options::unsigned_requests, parse_flag)},
    {"WEIGHTSTREAM_S3_CONNECTIONS", s3_field(&S3Options::max_connections, whole_number(1, 1024))},
    {"WEIGHTSTREAM_S3_REQUEST_SIZE", s3_field(&S3Options::request_bytes, parse_size_variable)},
    {"WEIGHTSTREAM_S3_MAX_ATTEMPTS", s3_field(&S3Options::max_attempts, whole_number(1, 100))},
    {"WEIGHTSTREAM_S3_DEADLINE", s3_field(&S3Options::deadline_seconds, parse_seconds)},
    {"WEIGHTSTREAM_S3_TIMEOUT", s3_field(&S3Options::timeout_seconds, parse_seconds)},
    {"WEIGHTSTREAM_S3_RETRY_BASE", s3_field(&S3Options::retry_base_seconds, parse_seconds)},
    {"WEIGHTSTREAM_S3_CONNECT_TIMEOUT", s3_field(&S3Options::connect_timeout_seconds, parse_seconds)},
    {"WEIGHTSTREAM_S3_FIRST_BYTE_TIMEOUT", s3_field(&S3Options::first_byte_timeout_seconds, parse_seconds)},
    {"WEIGHTSTREAM_GCS_ANONYMOUS", [](Options& options, std::string_view name, const std::string& value) {
       options.gcs.anonymous = parse_flag(name, value);
     }},
    {"WEIGHTSTREAM_AZURE_ANONYMOUS", [](Options& options, std::string_view name, const std::string& value) {
       options.azure.anonymous = parse_flag(name, value);
     }},
    {"WEIGHTSTREAM_PEER_TOKEN", [](Options& options, std::string_view, const std::string& value) {
       options.peer_token = value;
     }},
    {"WEIGHTSTREAM_TEST_PULL_STOP_AFTER", [](Options& options, std::string_view name, const std::string& value) {
       options.test_pull_stop_after = parse_size_variable(name, value);
     }},
    {"WEIGHTSTREAM_UCX_PATH", [](Options& options, std::string_view name, const std::string& value) {
       options.ucx_path = parse_variable([&] { return parse_ucx_path(value, name); });
     }},
    // Read below with its alias MX_MODEL_URI.
    {"WEIGHTSTREAM_MODEL_URI", [](Options&, std::string_view, const std::string&) {}},
};

const Variable* find_variable(std::string_view name) {
  for (const Variable& variable : kVariables) {
    if (variable.name == name) return &variable;
  }
  return nullptr;
}

std::string known_variables() {
  std::string text;
  for (const Variable& variable : kVariables) text += (text.empty() ? "" : ", ") + std::string(variable.name);
  return text;
}

}  // namespace

Environment process_environment() {
  Environment environment;
  for (char** entry = environ; entry && *entry; ++entry) {
    std::string_view text(*entry);
    auto equals = text.find('=');
    if (equals == std::string_view::npos) continue;
    environment.emplace(std::string(text.substr(0, equals)), std::string(text.substr(equals + 1)));
  }
  return environment;
}

std::string temporary_directory(const Environment& environment) {
  std::string directory = first_of(environment, {"TMPDIR"});
  return directory.empty() ? "/tmp" : directory;
}

Options options_from_environment(const Environment& environment) {
  Options options;
  options.temporary_directory = temporary_directory(environment);
  for (const auto& [name, value] : environment) {
    if (name.starts_with("WEIGHTSTREAM_")) {
      WS_EXPECT(find_variable(name) != nullptr, ErrorCode::kConfig,
                "unknown environment variable " + name + " (known: " + known_variables() + ")");
    }
  }
  for (const Variable& variable : kVariables) {
    if (const auto* value = find(environment, variable.name)) variable.apply(options, variable.name, *value);
  }
  parse_variable([&] {
    check_stream_options(options.stream,
                         {"WEIGHTSTREAM_CONCURRENCY", "WEIGHTSTREAM_MEMORY_LIMIT", "WEIGHTSTREAM_CHUNK_SIZE"});
    return 0;
  });

  auto& s3 = options.s3;
  s3.endpoint = first_of(environment, {"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"});
  s3.region = first_of(environment, {"AWS_REGION", "AWS_DEFAULT_REGION"});
  s3.access_key_id = first_of(environment, {"AWS_ACCESS_KEY_ID"});
  s3.secret_access_key = first_of(environment, {"AWS_SECRET_ACCESS_KEY"});
  s3.session_token = first_of(environment, {"AWS_SESSION_TOKEN"});
  s3.credentials_file = first_of(environment, {"AWS_SHARED_CREDENTIALS_FILE"});
  if (s3.credentials_file.empty()) {
    if (auto home = first_of(environment, {"HOME"}); !home.empty()) s3.credentials_file = home + "/.aws/credentials";
  }
  s3.profile = first_of(environment, {"AWS_PROFILE"});
  if (s3.profile.empty()) s3.profile = "default";
  s3.ca_bundle = first_of(environment, {"AWS_CA_BUNDLE"});

  // Google's variables, as its client libraries read them.
  auto& gcs = options.gcs;
  gcs.emulator_host = first_of(environment, {"STORAGE_EMULATOR_HOST"});
  gcs.credentials_file = first_of(environment, {"GOOGLE_APPLICATION_CREDENTIALS"});
  if (auto host = first_of(environment, {"GCE_METADATA_HOST"}); !host.empty()) gcs.metadata_host = host;

  // Azure's variables, as its CLI and azure-identity read them.
  auto& azure = options.azure;
  azure.connection_string = first_of(environment, {"AZURE_STORAGE_CONNECTION_STRING"});
  azure.account = first_of(environment, {"AZURE_STORAGE_ACCOUNT"});
  azure.account_key = first_of(environment, {"AZURE_STORAGE_KEY"});
  azure.sas_token = first_of(environment, {"AZURE_STORAGE_SAS_TOKEN"});
  azure.identity_endpoint = first_of(environment, {"IDENTITY_ENDPOINT"});
  azure.identity_header = first_of(environment, {"IDENTITY_HEADER"});
  if (auto host = first_of(environment, {"AZURE_POD_IDENTITY_AUTHORITY_HOST"}); !host.empty()) azure.imds_host = host;
  azure.client_id = first_of(environment, {"AZURE_CLIENT_ID"});

  const auto* primary = find(environment, "WEIGHTSTREAM_MODEL_URI");
  const auto* alias = find(environment, "MX_MODEL_URI");
  if (primary && alias && !primary->empty() && !alias->empty()) {
    WS_EXPECT(*primary == *alias, ErrorCode::kConfig,
              "WEIGHTSTREAM_MODEL_URI='" + *primary + "' and its alias MX_MODEL_URI='" + *alias +
                  "' disagree: set one of them");
  }
  if (primary && !primary->empty()) {
    options.model_uri = *primary;
    options.model_uri_origin = "WEIGHTSTREAM_MODEL_URI";
  } else if (alias && !alias->empty()) {
    options.model_uri = *alias;
    options.model_uri_origin = "MX_MODEL_URI";
  }
  return options;
}

uint64_t parse_size(std::string_view text, std::string_view what) {
  auto invalid = [&](std::string_view why) {
    return std::string(what) + "='" + std::string(text) + "': " + std::string(why) +
           " (examples: 4096, 64MiB, 2GiB, 1.5GB)";
  };
  size_t split = 0;
  while (split < text.size() && (std::isdigit(static_cast<unsigned char>(text[split])) || text[split] == '.')) ++split;
  WS_EXPECT(split > 0, ErrorCode::kInvalidArgument, invalid("expected a number"));
  double number = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + split, number);
  WS_EXPECT(error == std::errc() && end == text.data() + split, ErrorCode::kInvalidArgument, invalid("expected a number"));
  std::string unit;
  for (char c : text.substr(split)) unit += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double scale = 0;
  if (unit.empty() || unit == "b") scale = 1;
  else if (unit == "k" || unit == "kib") scale = 1024.0;
  else if (unit == "m" || unit == "mib") scale = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib") scale = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib") scale = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb") scale = 1e3;
  else if (unit == "mb") scale = 1e6;
  else if (unit == "gb") scale = 1e9;
  else if (unit == "tb") scale = 1e12;
  else WS_FAIL(ErrorCode::kInvalidArgument, invalid("unknown unit '" + std::string(text.substr(split)) + "'"));
  double bytes = number * scale;
  WS_EXPECT(bytes < 1.8e19, ErrorCode::kInvalidArgument, invalid("too large"));
  WS_EXPECT(bytes == std::floor(bytes), ErrorCode::kInvalidArgument, invalid("not a whole number of bytes"));
  return static_cast<uint64_t>(bytes);
}

double parse_duration(std::string_view text, std::string_view what) {
  auto invalid = [&] {
    return quoted(what, text) + ": expected a positive duration such as 500ms, 1s, 2m or 1.5 (seconds)";
  };
  size_t split = 0;
  while (split < text.size() && (std::isdigit(static_cast<unsigned char>(text[split])) || text[split] == '.')) ++split;
  double number = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + split, number);
  WS_EXPECT(split > 0 && error == std::errc() && end == text.data() + split, ErrorCode::kInvalidArgument, invalid());
  std::string_view unit = text.substr(split);
  double scale = 0;
  if (unit.empty() || unit == "s") scale = 1;
  else if (unit == "ms") scale = 1e-3;
  else if (unit == "m" || unit == "min") scale = 60;
  else if (unit == "h") scale = 3600;
  WS_EXPECT(scale > 0, ErrorCode::kInvalidArgument, invalid());
  double seconds = number * scale;
  WS_EXPECT(seconds > 0 && std::isfinite(seconds), ErrorCode::kInvalidArgument, invalid());
  return seconds;
}

LocalIo parse_local_io(std::string_view text, std::string_view what) {
  if (text == "auto") return LocalIo::kAuto;
  if (text == "pread") return LocalIo::kPread;
  if (text == "direct") return LocalIo::kDirect;
  if (text == "uring") return LocalIo::kUring;
  if (text == "mmap") return LocalIo::kMmap;
  WS_FAIL(ErrorCode::kInvalidArgument, quoted(what, text) + ": expected auto, pread, direct, uring or mmap");
}

std::string_view local_io_name(LocalIo io) noexcept {
  switch (io) {
    case LocalIo::kAuto: return "auto";
    case LocalIo::kPread: return "pread";
    case LocalIo::kDirect: return "direct";
    case LocalIo::kUring: return "uring";
    case LocalIo::kMmap: return "mmap";
  }
  return "pread";
}

GpuPath parse_gpu_path(std::string_view text, std::string_view what) {
  if (text == "auto") return GpuPath::kAuto;
  if (text == "staged") return GpuPath::kStaged;
  if (text == "mapped") return GpuPath::kMapped;
  if (text == "both") return GpuPath::kBoth;
  WS_FAIL(ErrorCode::kInvalidArgument, quoted(what, text) + ": expected auto, staged, mapped or both");
}

UcxPath parse_ucx_path(std::string_view text, std::string_view what) {
  if (text == "auto") return UcxPath::kAuto;
  if (text == "rma") return UcxPath::kRma;
  if (text == "rendezvous") return UcxPath::kRendezvous;
  WS_FAIL(ErrorCode::kInvalidArgument, quoted(what, text) + ": expected auto, rma or rendezvous");
}

std::string_view ucx_path_name(UcxPath path) noexcept {
  switch (path) {
    case UcxPath::kRma:
      return "rma";
    case UcxPath::kRendezvous:
      return "rendezvous";
    case UcxPath::kAuto:
      break;
  }
  return "auto";
}

double parse_share(std::string_view text, std::string_view what) {
  double value = -1;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  WS_EXPECT(error == std::errc() && end == text.data() + text.size() && value >= 0 && value <= 1,
            ErrorCode::kInvalidArgument, quoted(what, text) + ": expected a fraction from 0 to 1, such as 0.4");
  return value;
}

std::string_view gpu_path_name(GpuPath path) noexcept {
  switch (path) {
    case GpuPath::kAuto: return "auto";
    case GpuPath::kStaged: return "staged";
    case GpuPath::kMapped: return "mapped";
    case GpuPath::kBoth: return "both";
  }
  return "auto";
}

void check_stream_options(const StreamOptions& options, const StreamOptionNames& names) {
  WS_EXPECT(options.concurrency >= 1, ErrorCode::kInvalidArgument,
            std::string(names.concurrency) + " must be at least 1");
  // The staging pool's smallest buffer is one page: a lower limit could not be honoured.
  WS_EXPECT(options.memory_limit >= kMinStagingBytes, ErrorCode::kInvalidArgument,
            std::string(names.memory_limit) + " " + std::to_string(options.memory_limit) +
                " bytes is too small: at least 4KiB (one page-sized staging buffer)");
  WS_EXPECT(options.chunk_bytes >= kMinStagingBytes, ErrorCode::kInvalidArgument,
            std::string(names.chunk_bytes) + " " + std::to_string(options.chunk_bytes) +
                " bytes is too small: at least 4KiB");
}

std::string format_size(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  if (unit == 0) std::snprintf(text, sizeof(text), "%llu B", static_cast<unsigned long long>(bytes));
  else std::snprintf(text, sizeof(text), "%.2f %s", value, units[unit]);
  return text;
}

}  // namespace weightstream
