// update_bench: pushed-update throughput against baselines measured in the same run.
//
//   update_bench [--bytes 1GiB] [--tensors 1000] [--bucket 64MiB] [--device cpu|cuda:N]
//                [--sender-device cuda:M] [--transports shm,tcp] [--repeat 3]
//                [--sender-memory arena|tensors] [--share on|off] [--share-minimum 256MiB]
//
// The receiver (this process) holds an engine-format layout of `tensors` BF16 parameters
// of `bytes` in all on `device`; a sender process (this binary again, --role sender)
// creates the same tensors (on the same device) and pushes them through each transport.
// The sender's tensors live in one arena (a trainer's flat parameter buffer; over CUDA IPC
// the receiver reads them in place, unless --share off) or in one allocation each
// (--sender-memory tensors: smaller than --share-minimum, they are copied through the
// buckets; at or above it each allocation is shared, opened once per connection).
// The sender connects once and pushes `repeat` updates over that connection; each update
// is timed by the receiver from START to the end of finish() (the connection's set-up is
// shown apart). Baselines, same bytes, same run: on the CPU, one memcpy and a loopback TCP socket copy;
// on a GPU, one device-to-device copy of the whole model and one copy per tensor. Prints a
// Markdown table (median of the repeats) and checks the received bytes.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "weightstream/device.hpp"
#include "device/shared/copies.hpp"
#include "weightstream/error.hpp"
#include "weightstream/model.hpp"
#include "weightstream/options.hpp"
#include "weightstream/transfer.hpp"

extern char** environ;

namespace ws = weightstream;
using Clock = std::chrono::steady_clock;

namespace {

struct Settings {
  uint64_t bytes = 1ull << 30;
  uint64_t tensors = 1000;
  uint64_t bucket = 64ull << 20;
  std::string device = "cpu";
  std::string sender_device;  // the sender's device; empty: the receiver's
  std::string transports = "shm,tcp";
  int repeat = 3;
  std::string sender_memory = "arena";  // or "tensors": one allocation each
  std::string share = "on";
  uint64_t share_minimum = ws::kDefaultShareMinimumBytes;
  // sender role
  std::string role = "receiver";
  std::string address;
  std::string transport;
};

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

/// Element counts of the tensors: equal sizes (a multiple of 128 elements), the last one
/// taking the remainder.
std::vector<int64_t> tensor_elements(const Settings& settings) {
  uint64_t elements = settings.bytes / 2;
  uint64_t each = std::max<uint64_t>(elements / settings.tensors / 128 * 128, 128);
  std::vector<int64_t> result(settings.tensors, static_cast<int64_t>(each));
  result.back() = static_cast<int64_t>(elements - each * (settings.tensors - 1));
  return result;
}

/// The bytes every run sends: one arena of all tensors, a fixed pattern.
void fill_pattern(std::byte* data, uint64_t bytes) {
  for (uint64_t i = 0; i < bytes; i += 8) {
    uint64_t value = (i * 0x9E3779B97F4A7C15ull) ^ 0xA5A5A5A5ull;
    std::memcpy(data + i, &value, std::min<uint64_t>(8, bytes - i));
  }
}

ws::Buffer pattern_on(const ws::Device& device, uint64_t bytes) {
  ws::Buffer host(ws::Device{}, bytes);
  fill_pattern(host.data(), bytes);
  if (!device.is_cuda()) return host;
  ws::Buffer on_device(device, bytes);
  ws::copy_bytes(on_device.data(), device, host.data(), ws::Device{}, bytes);
  return on_device;
}

int run_sender(const Settings& settings) {
  ws::Device device = ws::parse_device(settings.device);
  auto elements = tensor_elements(settings);
  uint64_t total = 0;
  for (int64_t count : elements) total += static_cast<uint64_t>(count) * 2;
  ws::Buffer source = pattern_on(device, total);
  std::vector<std::string> names;
  for (size_t i = 0; i < elements.size(); ++i) names.push_back("p" + std::to_string(i));
  // One allocation per tensor: the same bytes, copied out of the arena.
  std::vector<ws::Buffer> singles;
  std::vector<const std::byte*> data;
  for (uint64_t i = 0, offset = 0; i < elements.size(); ++i) {
    uint64_t bytes = static_cast<uint64_t>(elements[i]) * 2;
    if (settings.sender_memory == "tensors") {
      singles.emplace_back(device, bytes);
      ws::copy_bytes(singles.back().data(), device, source.data() + offset, device, bytes);
      data.push_back(singles.back().data());
    } else {
      data.push_back(source.data() + offset);
    }
    offset += bytes;
  }
  ws::wait_for_copies(device);
  std::string token;
  std::getline(std::cin, token);
  // One connection, `repeat` updates: a trainer connects once and pushes again and again.
  ws::SenderOptions options;
  options.transport = ws::parse_transport(settings.transport);
  options.bucket_bytes = settings.bucket;
  options.token = token;
  options.device = device;
  options.share_allocations = settings.share == "on";
  options.share_minimum_bytes = settings.share_minimum;
  ws::UpdateSender sender(settings.address, options);
  std::vector<double> sending, finishing;  // the sender's own time: its send() calls, its finish()
  std::vector<ws::DeclaredTensor> manifest;
  for (size_t i = 0; i < elements.size(); ++i) manifest.push_back({names[i], ws::Dtype::kBF16, {elements[i]}});
  for (int run = 0; run < settings.repeat; ++run) {
    auto begun = Clock::now();
    sender.start(ws::TensorFormat::kEngine, manifest);
    for (size_t i = 0; i < elements.size(); ++i) {
      std::vector<int64_t> shape = {elements[i]};
      uint64_t bytes = static_cast<uint64_t>(elements[i]) * 2;
      sender.send(ws::TensorView{names[i], ws::Dtype::kBF16, shape, data[i], device, 0, bytes});
    }
    sending.push_back(seconds_since(begun) * 1e3);
    begun = Clock::now();
    sender.finish();
    finishing.push_back(seconds_since(begun) * 1e3);
  }
  std::sort(sending.begin(), sending.end());
  std::sort(finishing.begin(), finishing.end());
  std::fprintf(stderr, "- sender's ms (medians): start() and send() calls %.2f, finish() %.2f\n",
               sending[sending.size() / 2], finishing[finishing.size() / 2]);
  return 0;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

/// Loopback TCP copy of `bytes` from `source` into `destination` (4 MiB writes).
double socket_copy(const std::byte* source, std::byte* destination, uint64_t bytes) {
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  socklen_t length = sizeof(address);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
  ::listen(listener, 1);
  auto start = Clock::now();
  std::thread writer([&] {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
    for (uint64_t done = 0; done < bytes;) {
      ssize_t sent = ::send(fd, source + done, std::min<uint64_t>(4 << 20, bytes - done), MSG_NOSIGNAL);
      if (sent <= 0) break;
      done += static_cast<uint64_t>(sent);
    }
    ::close(fd);
  });
  int fd = ::accept(listener, nullptr, nullptr);
  for (uint64_t done = 0; done < bytes;) {
    ssize_t got = ::recv(fd, destination + done, bytes - done, 0);
    if (got <= 0) break;
    done += static_cast<uint64_t>(got);
  }
  double seconds = seconds_since(start);
  writer.join();
  ::close(fd);
  ::close(listener);
  return seconds;
}

struct Row {
  std::string what;
  double seconds = 0;
};

/// The median of each phase of the receiver's updates, in milliseconds, as one line.
std::string phase_text(const std::vector<ws::UpdatePhases>& runs) {
  auto ms = [&](double ws::UpdatePhases::*phase) {
    std::vector<double> values;
    for (const ws::UpdatePhases& run : runs) values.push_back(run.*phase * 1e3);
    std::sort(values.begin(), values.end());
    return values[values.size() / 2];
  };
  std::string text;
  char value[32];
  for (const auto& [name, phase] : ws::kUpdatePhases) {
    std::snprintf(value, sizeof(value), " %.2f", ms(phase));
    text += (text.empty() ? "" : ", ") + std::string(name) + value;
  }
  return text;
}

int run_receiver(const Settings& settings, const char* self) {
  ws::Device device = ws::parse_device(settings.device);
  auto elements = tensor_elements(settings);
  ws::ModelLayout layout;
  layout.set_description("update_bench " + std::to_string(settings.tensors) + " tensors");
  uint64_t total = 0;
  for (size_t i = 0; i < elements.size(); ++i) {
    ws::Parameter parameter;
    parameter.name = "p" + std::to_string(i);
    parameter.dtype = ws::Dtype::kBF16;
    parameter.load_dtype = ws::Dtype::kBF16;
    parameter.shape = {elements[i]};
    parameter.layer = static_cast<int64_t>(i / 10);  // ten tensors a layer
    total += parameter.bytes();
    layout.add_parameter(std::move(parameter));
  }
  layout.allocate(device);
  {
    // The first load must be cold: zeros in engine format, so every page is touched.
    ws::Buffer zeros(device, std::min<uint64_t>(total, 1ull << 30));
    if (!device.is_cuda()) std::memset(zeros.data(), 0, zeros.size());
    ws::LoadSession session(layout);
    session.begin(ws::LoadMode::kCold, ws::TensorFormat::kEngine);
    for (const ws::Parameter& parameter : layout.parameters()) {
      for (uint64_t offset = 0; offset < parameter.bytes(); offset += zeros.size()) {
        uint64_t length = std::min<uint64_t>(zeros.size(), parameter.bytes() - offset);
        session.load(ws::TensorView{parameter.name, parameter.dtype, parameter.shape, zeros.data(), device, offset, length});
      }
    }
    session.finish();
  }

  std::vector<Row> rows;
  std::vector<std::string> phase_lines;  // per transport: where the receiver's time went
  {
    // Baselines over the same bytes.
    ws::Buffer source = pattern_on(device, total);
    ws::Buffer destination(device, total);
    std::vector<double> whole, per_tensor, batched, gathered, socket;
    std::optional<ws::CopyQueue> queue;
    if (device.is_cuda()) queue.emplace(device);
    for (int run = 0; run < settings.repeat; ++run) {
      auto start = Clock::now();
      if (device.is_cuda()) {
        ws::copy_bytes(destination.data(), device, source.data(), device, total);
        ws::wait_for_copies(device);  // a device-to-device cudaMemcpy returns before it is done
      } else {
        std::memcpy(destination.data(), source.data(), total);
      }
      whole.push_back(seconds_since(start));
      if (device.is_cuda()) {
        start = Clock::now();
        uint64_t offset = 0;
        std::vector<ws::CopyRange> ranges;
        for (const ws::Parameter& parameter : layout.parameters()) {
          ws::copy_bytes(parameter.data, device, source.data() + offset, device, parameter.bytes());
          ranges.push_back({parameter.data, source.data() + offset, parameter.bytes()});
          offset += parameter.bytes();
        }
        ws::wait_for_copies(device);
        per_tensor.push_back(seconds_since(start));
        start = Clock::now();
        ws::copy_batch(device, ranges);
        batched.push_back(seconds_since(start));
        // The receiver's own copy: one gather kernel over the per-tensor ranges.
        start = Clock::now();
        queue->gather(ranges);
        queue->wait();
        gathered.push_back(seconds_since(start));
      } else {
        socket.push_back(socket_copy(source.data(), destination.data(), total));
      }
    }
    rows.push_back({device.is_cuda() ? "device-to-device copy, one buffer" : "memcpy, one buffer", median(whole)});
    if (device.is_cuda()) {
      rows.push_back({"device-to-device copy per tensor (cudaMemcpy each)", median(per_tensor)});
      rows.push_back({"device-to-device copy per tensor, one batch (copy_batch)", median(batched)});
      rows.push_back({"device-to-device copy per tensor, one gather kernel (CopyQueue)", median(gathered)});
    }
    else rows.push_back({"loopback TCP socket copy (4 MiB writes)", median(socket)});
  }
  const double baseline = rows.front().seconds;

  std::string transports = settings.transports + ",";
  for (size_t comma; (comma = transports.find(',')) != std::string::npos; transports.erase(0, comma + 1)) {
    std::string name = transports.substr(0, comma);
    if (name.empty()) continue;
    ws::ReceiverOptions options;
    options.transport = ws::parse_transport(name);
    options.token = "bench-token";
    options.device = device;
    options.max_bucket_bytes = settings.bucket;
    ws::UpdateReceiver receiver(layout, options);
    std::vector<std::string> arguments = {self, "--role", "sender", "--address", receiver.address(), "--transport",
                                          name, "--bytes", std::to_string(settings.bytes), "--tensors",
                                          std::to_string(settings.tensors), "--bucket", std::to_string(settings.bucket),
                                          "--device", settings.sender_device.empty() ? settings.device : settings.sender_device,
                                          "--repeat", std::to_string(settings.repeat), "--sender-memory",
                                          settings.sender_memory, "--share", settings.share, "--share-minimum",
                                          std::to_string(settings.share_minimum)};
    std::vector<char*> argv;
    for (auto& argument : arguments) argv.push_back(argument.data());
    argv.push_back(nullptr);
    int token_pipe[2];
    if (::pipe(token_pipe) != 0) return 1;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, token_pipe[0], STDIN_FILENO);
    posix_spawn_file_actions_addclose(&actions, token_pipe[1]);
    pid_t child;
    if (::posix_spawn(&child, self, &actions, nullptr, argv.data(), environ) != 0) return 1;
    ::close(token_pipe[0]);
    (void)!::write(token_pipe[1], "bench-token\n", 12);
    ::close(token_pipe[1]);
    std::vector<double> runs;
    std::vector<ws::UpdatePhases> phases;
    uint64_t buckets = 0, shared = 0, regions = 0;
    double connect = 0;
    for (int run = 0; run < settings.repeat; ++run) {
      ws::UpdateReport report = receiver.receive(std::chrono::minutes(5));
      runs.push_back(report.seconds);
      phases.push_back(report.phases);
      buckets = report.buckets;
      shared = report.shared_bytes;
      regions = report.regions;
      connect += report.connect_seconds;  // the first update's only: one connection
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    // Check what landed: the pattern, parameter after parameter.
    ws::Buffer expected(ws::Device{}, total);
    fill_pattern(expected.data(), total);
    uint64_t offset = 0, wrong = 0;
    for (const ws::Parameter& parameter : layout.parameters()) {
      if (ws::parameter_bytes(parameter) !=
                        std::vector<std::byte>(expected.data() + offset, expected.data() + offset + parameter.bytes())) {
        ++wrong;
      }
      offset += parameter.bytes();
    }
    std::string how;
    if (options.transport == ws::TransportKind::kCudaIpc) {
      how = settings.sender_memory == "arena"
                ? (settings.share == "on" ? ", sender arena shared in place" : ", sender arena, sharing off")
                : ", one sender allocation per tensor";
    }
    char connect_text[64];
    std::snprintf(connect_text, sizeof(connect_text), ", %.0f%% in place in %llu regions; connect once %.1f ms",
                  100.0 * static_cast<double>(shared) / static_cast<double>(total),
                  static_cast<unsigned long long>(regions), connect * 1e3);
    how += connect_text;
    rows.push_back({"update via " + name + " (" + std::to_string(buckets) + " buckets" + how +
                        (wrong ? ", " + std::to_string(wrong) + " PARAMETERS WRONG" : "") + ")",
                    median(runs)});
    // The first update of a connection opens the sender's regions; the later ones reuse them.
    phase_lines.push_back("update via " + name + ", receiver's ms, first update: " + phase_text({phases.front()}));
    if (phases.size() > 1) {
      phase_lines.push_back("update via " + name + ", receiver's ms, later updates (medians): " +
                            phase_text({phases.begin() + 1, phases.end()}));
    }
  }

  std::printf("update_bench: %.2f GiB BF16 as %llu tensors, %s, buckets of %llu MiB, median of %d\n\n",
              static_cast<double>(total) / (1ull << 30), static_cast<unsigned long long>(settings.tensors),
              device.name().c_str(), static_cast<unsigned long long>(settings.bucket >> 20), settings.repeat);
  std::printf("| what | seconds | GB/s | vs %s |\n| --- | ---: | ---: | ---: |\n", rows.front().what.c_str());
  for (const Row& row : rows) {
    std::printf("| %s | %.4f | %.2f | %.0f%% |\n", row.what.c_str(), row.seconds,
                static_cast<double>(total) / row.seconds / 1e9, 100.0 * baseline / row.seconds);
  }
  std::printf("\n");
  for (const std::string& line : phase_lines) std::printf("- %s\n", line.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--bytes") settings.bytes = ws::parse_size(value, "--bytes");
    else if (flag == "--tensors") settings.tensors = std::stoull(value);
    else if (flag == "--bucket") settings.bucket = ws::parse_size(value, "--bucket");
    else if (flag == "--device") settings.device = value;
    else if (flag == "--sender-device") settings.sender_device = value;
    else if (flag == "--transports") settings.transports = value;
    else if (flag == "--repeat") settings.repeat = std::max(1, std::stoi(value));
    else if (flag == "--role") settings.role = value;
    else if (flag == "--address") settings.address = value;
    else if (flag == "--transport") settings.transport = value;
    else if (flag == "--sender-memory" && (value == "arena" || value == "tensors")) settings.sender_memory = value;
    else if (flag == "--share" && (value == "on" || value == "off")) settings.share = value;
    else if (flag == "--share-minimum") settings.share_minimum = ws::parse_size(value, "--share-minimum");
    else {
      std::fprintf(stderr, "update_bench: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  try {
    if (settings.role == "sender") return run_sender(settings);
    return run_receiver(settings, "/proc/self/exe");
  } catch (const ws::Error& error) {
    std::fprintf(stderr, "update_bench (%s): error: %s\n", settings.role.c_str(), error.what());
    return 1;
  }
}
