#include "cli/command.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>
#include <variant>

#include "weightstream/error.hpp"

namespace weightstream::cli {

const Options& environment_options() {
  static const Options options = options_from_environment(process_environment());
  return options;
}

void add_stream_flags(CLI::App& command, StreamFlags& flags) {
  command.add_option("--concurrency", flags.concurrency, "Reads in flight (default 16; WEIGHTSTREAM_CONCURRENCY)")
      ->check(CLI::Range(1, 1024));
  command.add_option("--memory-limit", flags.memory_limit,
                     "Staging memory cap, e.g. 256MiB (default 1GiB; WEIGHTSTREAM_MEMORY_LIMIT)");
  command.add_option("--chunk-size", flags.chunk_size, "Largest single read (default 16MiB; WEIGHTSTREAM_CHUNK_SIZE)");
  command.add_option("--io", flags.io,
                     "Local read method: auto (a host load takes tensors in place, other reads pread), pread, direct "
                     "(O_DIRECT), uring or mmap (default auto; WEIGHTSTREAM_LOCAL_IO)");
  command.add_option("--gpu-path", flags.gpu_path,
                     "How bytes reach a CUDA device: auto, staged (pinned buffers), mapped (registered mmap of "
                     "local files) or both at once on disjoint tensors (default auto; WEIGHTSTREAM_GPU_PATH)");
  command.add_option("--mapped-share", flags.mapped_share,
                     "With --gpu-path both: the fraction of the bytes mapped, the rest staged (default 0.4; "
                     "WEIGHTSTREAM_MAPPED_SHARE)");
  command.add_option("--prefetchers", flags.prefetchers,
                     "Threads mapping the pages of reads ahead of the readers when files are read through a "
                     "mapping (default 3 where the readers leave the cores free, else 0; WEIGHTSTREAM_PREFETCHERS)")
      ->check(CLI::Range(0, 1024));
  auto* progress = command.add_flag("--progress", flags.progress,
                                    "Print progress on stderr even when it is not a terminal, one line every few "
                                    "seconds (WEIGHTSTREAM_PROGRESS=1)");
  command.add_flag("--no-progress", flags.no_progress, "Never print progress")->excludes(progress);
}

Options resolve_options(const StreamFlags& flags) {
  Options options = environment_options();
  auto& stream = options.stream;
  if (flags.concurrency) stream.concurrency = *flags.concurrency;
  if (!flags.memory_limit.empty()) stream.memory_limit = parse_size(flags.memory_limit, "--memory-limit");
  if (!flags.chunk_size.empty()) stream.chunk_bytes = parse_size(flags.chunk_size, "--chunk-size");
  if (!flags.io.empty()) stream.local_io = parse_local_io(flags.io, "--io");
  if (!flags.gpu_path.empty()) stream.gpu_path = parse_gpu_path(flags.gpu_path, "--gpu-path");
  if (!flags.mapped_share.empty()) stream.mapped_share = parse_share(flags.mapped_share, "--mapped-share");
  if (flags.prefetchers) stream.prefetchers = flags.prefetchers;
  check_stream_options(stream, {"--concurrency", "--memory-limit", "--chunk-size"});
  return options;
}

bool progress_enabled(const StreamFlags& flags, const Options& options) {
  if (flags.no_progress) return false;
  return flags.progress || options.stream.progress || isatty(STDERR_FILENO);
}

namespace {
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

ProgressLine::ProgressLine(bool enabled, ProgressCallback observer)
    : observer_(std::move(observer)), enabled_(enabled), terminal_(enabled && isatty(STDERR_FILENO)) {}

void ProgressLine::update(uint64_t done, uint64_t total) {
  if (observer_) observer_(done, total);
  if (!enabled_) return;
  double now = now_seconds();
  if (start_ < 0) start_ = now;
  // A terminal redraws one line in place; a pipe or a log file gets a line every few seconds
  // (a \r frame ten times a second would pile up there as one endless line).
  const double interval = terminal_ ? 0.1 : 3.0;
  const bool finished = done >= total;
  if (finished) {
    if (finished_drawn_) return;
    finished_drawn_ = true;
  } else if (now - (last_draw_ < 0 ? start_ : last_draw_) < (drawn_ || !terminal_ ? interval : 0.0)) {
    return;
  }
  last_draw_ = now;
  double elapsed = now - start_;
  double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0;
  char eta[48];
  if (finished) std::snprintf(eta, sizeof(eta), "done in %.1f s", elapsed);
  else if (rate > 0) std::snprintf(eta, sizeof(eta), "ETA %.1f s", static_cast<double>(total - done) / rate);
  else std::snprintf(eta, sizeof(eta), "ETA --");  // nothing measured yet: no rate to predict from
  std::fprintf(stderr, "%s%s / %s  %.2f GB/s  %s%s", terminal_ ? "\r" : "", format_size(done).c_str(),
               format_size(total).c_str(), rate / 1e9, eta, terminal_ ? "   " : "\n");
  drawn_ = true;
}

ProgressLine::~ProgressLine() {
  if (drawn_ && terminal_) std::fputc('\n', stderr);
}

void print_json(const nlohmann::json& value) { std::cout << value.dump(2) << "\n"; }

nlohmann::json stats_json(const std::vector<StatField>& fields) {
  nlohmann::json object = nlohmann::json::object();
  for (const StatField& field : fields) {
    std::visit([&](auto value) { object[std::string(field.name)] = value; }, field.value);
  }
  return object;
}

std::string counted(uint64_t count, std::string_view noun) {
  return std::to_string(count) + " " + std::string(noun) + (count == 1 ? "" : "s");
}

namespace {

/// Columns of one code point (as wcwidth(3) counts them in a UTF-8 locale, for the ranges a
/// tensor name may hold), without depending on the process's locale.
size_t code_point_width(char32_t c) {
  if (c == 0) return 0;
  if ((c >= 0x0300 && c <= 0x036F) || (c >= 0x1AB0 && c <= 0x1AFF) || (c >= 0x1DC0 && c <= 0x1DFF) ||
      (c >= 0x20D0 && c <= 0x20FF) || (c >= 0xFE20 && c <= 0xFE2F) || c == 0x200B || c == 0x200C || c == 0x200D ||
      (c >= 0xFE00 && c <= 0xFE0F)) {
    return 0;  // combining marks, zero-width spaces and joiners, variation selectors
  }
  if ((c >= 0x1100 && c <= 0x115F) || (c >= 0x2E80 && c <= 0x303E) || (c >= 0x3041 && c <= 0x33FF) ||
      (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0xA000 && c <= 0xA4CF) ||
      (c >= 0xAC00 && c <= 0xD7A3) || (c >= 0xF900 && c <= 0xFAFF) || (c >= 0xFE30 && c <= 0xFE4F) ||
      (c >= 0xFF00 && c <= 0xFF60) || (c >= 0xFFE0 && c <= 0xFFE6) || (c >= 0x1F300 && c <= 0x1F64F) ||
      (c >= 0x1F900 && c <= 0x1F9FF) || (c >= 0x20000 && c <= 0x3FFFD)) {
    return 2;
  }
  return 1;
}

}  // namespace

size_t display_width(std::string_view text) {
  size_t width = 0;
  for (size_t i = 0; i < text.size();) {
    auto byte = static_cast<unsigned char>(text[i]);
    size_t length = byte < 0x80 ? 1 : (byte >> 5) == 0x6 ? 2 : (byte >> 4) == 0xE ? 3 : (byte >> 3) == 0x1E ? 4 : 1;
    if (i + length > text.size()) length = 1;  // a cut sequence: one column per byte
    char32_t c = length == 1 ? byte : static_cast<char32_t>(byte & (0x7F >> length));
    for (size_t k = 1; k < length; ++k) c = (c << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3F);
    width += code_point_width(c);
    i += length;
  }
  return width;
}

std::string pad_to(std::string_view text, size_t width) {
  std::string padded(text);
  size_t columns = display_width(text);
  if (columns < width) padded.append(width - columns, ' ');
  return padded;
}

const std::string& token_from_stdin() {
  static std::optional<std::string> token;
  if (!token) {
    std::string line;
    const bool got = static_cast<bool>(std::getline(std::cin, line));
    if (!line.empty() && line.back() == '\r') line.pop_back();
    WS_EXPECT(got, ErrorCode::kInvalidArgument,
              "--token-stdin: stdin ended before a line with the token (the token read from stdin is empty)");
    WS_EXPECT(!line.empty(), ErrorCode::kInvalidArgument,
              "--token-stdin: the token read from stdin is empty (an empty token never means \"no token\")");
    token = std::move(line);
  }
  return *token;
}

}  // namespace weightstream::cli
