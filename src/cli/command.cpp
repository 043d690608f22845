#include "cli/command.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
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
  command.add_flag("--progress", flags.progress,
                   "Print progress on stderr even when it is not a terminal, one line every few seconds "
                   "(WEIGHTSTREAM_PROGRESS=1)");
  command.add_flag("--no-progress", flags.no_progress, "Never print progress");
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

ProgressLine::ProgressLine(bool enabled) : enabled_(enabled), terminal_(enabled && isatty(STDERR_FILENO)) {}

void ProgressLine::update(uint64_t done, uint64_t total) {
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

}  // namespace weightstream::cli
