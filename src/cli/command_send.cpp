// weightstream send URI --to ADDRESS --via shm|tcp|cuda-ipc|nccl [--bucket-size SIZE]
//                       [--format checkpoint|engine] [--token-stdin] [--device cuda:N]
// Streams every tensor of a checkpoint into an update receiver, the way a trainer
// would push its weights; `audit --via` spawns it. The token is read from stdin, never
// from the command line, where other users could read it in the process list.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <exception>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>

#include "cli/update_via.hpp"
#include "weightstream/error.hpp"
#include "weightstream/load.hpp"
#include "weightstream/stream.hpp"

extern char** environ;

namespace weightstream::cli {
namespace {

struct SendFlags {
  std::string uri;
  std::vector<std::string> to;  // one receiver, or several (tcp, nccl)
  std::string via = "tcp";
  std::string bucket_size = "256MiB";
  std::string format = "checkpoint";
  std::string device = "cpu";
  bool token_stdin = false;
  bool json = false;
  int64_t repeat = 1;
  std::string delta_from;  // --delta-from: the checkpoint the receiver holds (a delta update)
  StreamFlags stream;
};

/// The content digest of `checkpoint` from its tensors loaded in `loaded` (one pass over
/// memory, no second read).
std::string loaded_content_digest(const Checkpoint& checkpoint, const LoadedCheckpoint& loaded) {
  std::vector<TensorDigest> digests;
  digests.reserve(loaded.tensors.size());
  for (size_t i = 0; i < loaded.tensors.size(); ++i) {
    Hasher hasher(HashKind::kXxh64);
    hasher.update(std::span<const std::byte>(loaded.tensors[i].data, loaded.tensors[i].bytes));
    digests.push_back({checkpoint.tensors()[i].name, hasher.finish()});
  }
  return content_digest(checkpoint, digests);
}

bool is_float(Dtype dtype) { return dtype == Dtype::kBF16 || dtype == Dtype::kF16 || dtype == Dtype::kF32; }

/// One delta update of `next` from `base` (the checkpoint the receivers hold): both loaded
/// into host memory (mapped where they are local files), each tensor sent as its changed
/// elements, or whole where that is cheaper or the base lacks it in that dtype and shape. A
/// BF16, F16 or F32 weight that `base` holds as FP8 codes with F32 `_scale_inv` block scales
/// is quantized as FP8 block-scaled checkpoints are (128 x 128 blocks) and sent as the changes
/// of its codes and scales.
UpdateReport send_delta(UpdateSender& sender, const Checkpoint& next, const Checkpoint& base,
                        const StreamOptions& options) {
  LoadedCheckpoint base_tensors = load_checkpoint(base, Device{}, options);
  LoadedCheckpoint next_tensors = load_checkpoint(next, Device{}, options);
  const UpdateVersions versions{loaded_content_digest(base, base_tensors), loaded_content_digest(next, next_tensors)};
  std::unordered_map<std::string_view, size_t> base_index, next_index;
  for (size_t i = 0; i < base.tensors().size(); ++i) base_index.emplace(base.tensors()[i].name, i);
  for (size_t i = 0; i < next.tensors().size(); ++i) next_index.emplace(next.tensors()[i].name, i);
  auto base_tensor = [&](const std::string& name) -> const CheckpointTensor* {
    auto found = base_index.find(name);
    return found == base_index.end() ? nullptr : &base.tensors()[found->second];
  };
  auto view_of = [&](const CheckpointTensor& tensor, bool in_base) {
    const auto& index = in_base ? base_index : next_index;
    const LoadedTensor& loaded = (in_base ? base_tensors : next_tensors).tensors[index.at(tensor.name)];
    return TensorView{.name = tensor.name, .dtype = tensor.dtype, .shape = tensor.shape, .data = loaded.data,
                      .bytes = loaded.bytes};
  };
  // The FP8 block scales `base` holds for a floating-point weight of `next`, if it holds it so.
  auto quantized_base = [&](const CheckpointTensor& tensor) -> const CheckpointTensor* {
    const CheckpointTensor* codes = base_tensor(tensor.name);
    const CheckpointTensor* scales = base_tensor(tensor.name + "_scale_inv");
    const bool quantized = is_float(tensor.dtype) && codes && codes->dtype == Dtype::kF8E4M3 &&
                           codes->shape == tensor.shape && scales && scales->dtype == Dtype::kF32 &&
                           !next_index.contains(scales->name);
    return quantized ? scales : nullptr;
  };
  std::vector<DeclaredTensor> manifest;
  for (const CheckpointTensor& tensor : next.tensors()) {
    const CheckpointTensor* scales = quantized_base(tensor);
    manifest.push_back({tensor.name, scales ? Dtype::kF8E4M3 : tensor.dtype, tensor.shape});
    if (scales) manifest.push_back({scales->name, scales->dtype, scales->shape});
  }
  sender.start(TensorFormat::kCheckpoint, manifest, versions);
  // Tensors go in file order, compared a batch at a time so that small ones share the threads.
  constexpr uint64_t kBatchBytes = 64ull << 20;
  std::vector<TensorView> batch_bases, batch;
  uint64_t batch_bytes = 0;
  auto send_batch = [&] {
    sender.send_changes(batch_bases, batch);
    batch_bases.clear();
    batch.clear();
    batch_bytes = 0;
  };
  for (const CheckpointTensor& tensor : next.tensors()) {
    const TensorView view = view_of(tensor, false);
    if (const CheckpointTensor* scales = quantized_base(tensor)) {
      send_batch();
      sender.send_quantized_changes(view_of(*base_tensor(tensor.name), true), view_of(*scales, true), view);
      continue;
    }
    const CheckpointTensor* old = base_tensor(tensor.name);
    if (!old || old->dtype != tensor.dtype || old->shape != tensor.shape) {
      send_batch();
      sender.send(view);
      continue;
    }
    batch_bases.push_back(view_of(*old, true));
    batch.push_back(view);
    batch_bytes += view.bytes;
    if (batch_bytes >= kBatchBytes) send_batch();
  }
  send_batch();
  return sender.finish();
}

/// Hands streamed pieces to the sender in file order, as a trainer pushes a model layer
/// after layer: the receiver then holds back only the layer a bucket ends inside.
class SenderSink final : public TensorSink {
 public:
  SenderSink(UpdateSender& sender, const Checkpoint& checkpoint)
      : sender_(sender), checkpoint_(checkpoint), views_(checkpoint.storage().views_serve_reads()) {}
  ~SenderSink() override {
    {
      std::lock_guard lock(mutex_);
      closing_ = true;
      queue_.clear();  // a failed stream: what it left is not sent
    }
    changed_.notify_all();
  }
  bool wants_ordered_pieces() const override { return true; }
  bool wants_file_order() const override { return true; }
  bool takes_views() const override { return true; }  // copied into the bucket in consume()
  void consume(TensorPiece&& piece) override {
    std::unique_lock lock(mutex_);
    if (failure_) std::rethrow_exception(failure_);
    if (!views_) {
      send(piece);  // the piece's bytes are valid only during this call
      return;
    }
    // Where views serve reads, every piece is one (takes_views), unchanged while its
    // keepalive lives: one thread sends them all, in order, from where they lie, while the
    // readers map the next ones. (Sends from whichever reader delivered cost a quarter of
    // the rate across two hosts: the socket's and UCX's work hopped between threads.)
    if (!sending_.joinable()) sending_ = std::jthread([this] { send_queued(); });
    queue_.push_back(std::move(piece));
    changed_.notify_all();
  }
  /// Waits until every piece consumed so far has been handed to the sender; rethrows its error.
  void drain() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return (queue_.empty() && !busy_) || failure_; });
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  void send(const TensorPiece& piece) {
    const CheckpointTensor& tensor = checkpoint_.tensors()[piece.request];
    sender_.send(TensorView{.name = tensor.name,
                            .dtype = tensor.dtype,
                            .shape = tensor.shape,
                            .data = piece.bytes.data(),
                            .device = Device{},
                            .offset = piece.offset,
                            .bytes = piece.bytes.size(),
                            .lifetime = views_ ? SourceLifetime::kLoad : SourceLifetime::kCall,
                            .keepalive = views_ ? piece.keepalive : nullptr});
  }
  void send_queued() {
    std::unique_lock lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return !queue_.empty() || closing_; });
      if (queue_.empty()) return;
      TensorPiece piece = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      std::exception_ptr failure;
      try {
        send(piece);
      } catch (...) {
        failure = std::current_exception();
      }
      lock.lock();
      busy_ = false;
      if (failure && !failure_) failure_ = failure;
      if (failure_) queue_.clear();
      changed_.notify_all();
    }
  }

  UpdateSender& sender_;
  const Checkpoint& checkpoint_;
  const bool views_;  ///< pieces point into the checkpoint's mapping
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<TensorPiece> queue_;  ///< views waiting for the sending thread
  bool busy_ = false;              ///< the sending thread holds a piece
  bool closing_ = false;
  std::exception_ptr failure_;     ///< the sender's error: later pieces are refused
  std::jthread sending_;           ///< last: joined before the queue goes
};

/// "a, b and c".
std::string join_addresses(const std::vector<std::string>& addresses) {
  std::string text;
  for (size_t i = 0; i < addresses.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == addresses.size() ? " and " : ", ") + addresses[i];
  }
  return text;
}

std::string random_token() {
  std::random_device source;
  std::string token;
  const char* digits = "0123456789abcdef";
  for (int i = 0; i < 32; ++i) token += digits[source() % 16];
  return token;
}

/// Receives `count` updates, calling `on_update` after each; the first is timed from
/// `started`, each later one from the end of the one before.
void receive_each(UpdateReceiver& receiver, int64_t count, std::chrono::steady_clock::time_point started,
                  const std::function<void(const ViaUpdate&)>& on_update) {
  for (int64_t update = 0; update < count; ++update) {
    ViaUpdate result;
    result.report = receiver.receive(std::chrono::minutes(5));
    const auto ended = std::chrono::steady_clock::now();
    result.seconds = std::chrono::duration<double>(ended - started).count();
    started = ended;
    on_update(result);
  }
}

/// Starts `weightstream send` with `arguments` (this executable), its stdout discarded,
/// and writes `token` to its stdin. Returns its pid.
pid_t spawn_sender(std::vector<std::string> arguments, const std::string& token) {
  std::vector<char*> argv;
  for (std::string& argument : arguments) argv.push_back(argument.data());
  argv.push_back(nullptr);

  int token_pipe[2];
  WS_EXPECT(::pipe2(token_pipe, O_CLOEXEC) == 0, ErrorCode::kIo, "cannot create a pipe for the sender: " +
                                                                      std::string(std::strerror(errno)));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, token_pipe[0], STDIN_FILENO);
  // The sender's summary would land in the middle of the audit's report (its JSON too):
  // the audit reports the update itself. Its errors still reach stderr.
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  pid_t child = -1;
  int spawned = ::posix_spawn(&child, "/proc/self/exe", &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(token_pipe[0]);
  if (spawned != 0) {
    ::close(token_pipe[1]);
    WS_FAIL(ErrorCode::kIo, "cannot start the sender process (weightstream send): " + std::string(std::strerror(spawned)));
  }
  std::string line = token + "\n";
  (void)!::write(token_pipe[1], line.data(), line.size());
  ::close(token_pipe[1]);
  return child;
}

}  // namespace

void add_via_flags(CLI::App& command, ViaFlags& flags) {
  auto* via = command.add_option("--via", flags.via,
                                 "Run each reload as a pushed update from a separate sender process through this "
                                 "transport")
                  ->check(CLI::IsMember({"shm", "tcp", "cuda-ipc", "nccl", "ucx"}));
  command.add_option("--bucket-size", flags.bucket_size, "Bucket size of --via updates (default 256MiB)")->needs(via);
  command.add_option("--listen", flags.listen, "--via tcp, nccl, ucx: HOST:PORT the receiver listens on (default loopback)");
  command.add_flag("--await-sender", flags.await_sender,
                   "--via: spawn no sender; print the receiver's address on stderr and wait for one (another host)");
  auto* token_stdin = command.add_flag(
      "--token-stdin", flags.token_stdin,
      "--await-sender, peer:// sources: read the token from the first line of stdin (--await-sender requires it "
      "unless --open-without-token)");
  command.add_flag("--open-without-token", flags.open_without_token,
                   "--await-sender: accept any sender, with no token (warned about on stderr)")
      ->excludes(token_stdin);
  add_metrics_flags(command, flags.metrics)->needs(via);
  command.add_flag("--delta", flags.delta,
                   "--via: push the reload as a delta update from URI, only the elements that changed (docs/DELTA.md)")
      ->needs(via);
}

void add_send_command(CLI::App& app) {
  auto flags = std::make_shared<SendFlags>();
  auto* command = app.add_subcommand(
      "send", "Push every tensor of a checkpoint to a running update receiver in buckets, as a trainer would "
              "(audit --via spawns it)");
  command->add_option("uri", flags->uri, "Checkpoint to send")->required();
  command->add_option("--to", flags->to, "Receiver address: HOST:PORT or a Unix socket path; several, comma-separated or repeated, over tcp, nccl and ucx")
      ->required()
      ->delimiter(',');
  command->add_option("--via", flags->via, "Transport: shm, tcp, cuda-ipc, nccl or ucx (default tcp)")->check(CLI::IsMember({"shm", "tcp", "cuda-ipc", "nccl", "ucx"}));
  command->add_option("--bucket-size", flags->bucket_size, "Bucket size (default 256MiB)");
  command->add_option("--format", flags->format, "Tensor names as in the checkpoint, or engine names (default checkpoint)")
      ->check(CLI::IsMember({"checkpoint", "engine"}));
  command->add_option("--device", flags->device, "GPU of the bucket staging for cuda-ipc and nccl");
  command->add_flag("--token-stdin", flags->token_stdin, "Read the shared token from the first line of stdin");
  command->add_flag("--json", flags->json,
                    "Print the receiver's report as JSON: tensors, bytes, buckets, seconds, gbps, model_hook_runs "
                    "(of the last update; `updates` lists each one's seconds and gbps)");
  command->add_option("--repeat", flags->repeat,
                      "Updates to send, one after another over one connection, as a trainer pushes every step "
                      "(default 1)")
      ->check(CLI::Range(1, 1 << 20));
  command->add_option("--delta-from", flags->delta_from,
                      "Send only the elements that changed since this checkpoint, the one the receivers hold (a delta "
                      "update, refused by a receiver that holds another version; docs/DELTA.md)");
  add_stream_flags(*command, flags->stream);
  command->callback([flags] {
    const bool delta = !flags->delta_from.empty();
    WS_EXPECT(!delta || flags->repeat == 1, ErrorCode::kInvalidArgument,
              "--delta-from sends one update from the version the receivers hold; it does not combine with --repeat");
    WS_EXPECT(!delta || flags->format == "checkpoint", ErrorCode::kInvalidArgument,
              "--delta-from sends checkpoint-format tensors; it does not combine with --format engine");
    Options options = resolve_options(flags->stream);
    SenderOptions sender_options;
    sender_options.transport = parse_transport(flags->via);
    sender_options.bucket_bytes = parse_size(flags->bucket_size, "--bucket-size");
    sender_options.device = parse_device(flags->device);
    sender_options.ucx_path = options.ucx_path;
    if (flags->token_stdin) sender_options.token = token_from_stdin();
    Checkpoint checkpoint = Checkpoint::open(flags->uri, options);
    UpdateSender sender(flags->to, sender_options);
    const TensorFormat format = flags->format == "engine" ? TensorFormat::kEngine : TensorFormat::kCheckpoint;
    SenderSink sink(sender, checkpoint);
    auto requests = all_tensors(checkpoint);
    // Every tensor the checkpoint holds, declared before the first bucket: the receiver
    // checks the whole update against its model before a byte lands.
    std::vector<DeclaredTensor> manifest;
    manifest.reserve(checkpoint.tensors().size());
    for (const CheckpointTensor& tensor : checkpoint.tensors()) manifest.push_back({tensor.name, tensor.dtype, tensor.shape});
    const std::string to = join_addresses(flags->to);
    UpdateReport report;
    nlohmann::json updates = nlohmann::json::array();
    for (int64_t update = 0; update < flags->repeat; ++update) {
      if (delta) {
        report = send_delta(sender, checkpoint, Checkpoint::open(flags->delta_from, options), options.stream);
      } else {
        sender.start(format, manifest);
        stream_tensors(checkpoint, requests, sink, options.stream);
        sink.drain();
        report = sender.finish();  // the receiver's report, echoed back
      }
      updates.push_back({{"seconds", report.seconds}, {"gbps", report.gbps()}});
      if (!flags->json) {
        std::printf("sent %llu tensors, %s in %llu bucket%s to %s via %s; applied in %.3f s (%.2f GB/s)\n",
                    static_cast<unsigned long long>(report.tensors), format_size(report.bytes).c_str(),
                    static_cast<unsigned long long>(report.buckets), report.buckets == 1 ? "" : "s", to.c_str(),
                    flags->via.c_str(), report.seconds, report.gbps());
        if (delta) {
          std::printf("delta from %s: %llu tensors as changed elements, %llu whole; %llu checked after it\n",
                      flags->delta_from.c_str(), static_cast<unsigned long long>(report.sparse_tensors),
                      static_cast<unsigned long long>(report.dense_tensors),
                      static_cast<unsigned long long>(report.checked_tensors));
        }
      }
    }
    if (flags->json) {
      print_json({{"uri", checkpoint.uri()},
                  {"to", flags->to},
                  {"via", flags->via},
                  {"format", flags->format},
                  {"buckets", report.buckets},
                  {"tensors", report.tensors},
                  {"bytes", report.bytes},
                  {"placed_bytes", report.placed_bytes},
                  {"seconds", report.seconds},
                  {"gbps", report.gbps()},
                  {"model_hook_runs", report.counters.model_hook_runs},
                  {"paths", sender.paths()},
                  {"updates", updates},
                  {"delta_from", delta ? nlohmann::json(flags->delta_from) : nlohmann::json()},
                  {"sparse_tensors", report.sparse_tensors},
                  {"dense_tensors", report.dense_tensors},
                  {"checked_tensors", report.checked_tensors}});
    }
  });
}

namespace {

/// The command line of the `weightstream send` child that pushes `reload_uri` to the
/// receiver at `address`, with the token on its stdin.
std::vector<std::string> sender_arguments(const std::string& reload_uri, const std::string& address,
                                          const ViaFlags& flags, const Device& sender_device,
                                          const StreamFlags& stream, int64_t count, const std::string& delta_base_uri) {
  std::vector<std::string> arguments = {"weightstream", "send", reload_uri, "--to", address, "--via",
                                        flags.via, "--bucket-size", flags.bucket_size, "--token-stdin",
                                        "--no-progress", "--device", sender_device.name(), "--repeat",
                                        std::to_string(count)};
  if (stream.concurrency) arguments.insert(arguments.end(), {"--concurrency", std::to_string(*stream.concurrency)});
  if (!stream.memory_limit.empty()) arguments.insert(arguments.end(), {"--memory-limit", stream.memory_limit});
  if (!stream.chunk_size.empty()) arguments.insert(arguments.end(), {"--chunk-size", stream.chunk_size});
  if (!stream.io.empty()) arguments.insert(arguments.end(), {"--io", stream.io});
  if (!delta_base_uri.empty()) arguments.insert(arguments.end(), {"--delta-from", delta_base_uri});
  return arguments;
}

}  // namespace

void receive_updates_via(ModelLayout& layout, const std::string& reload_uri, const ViaFlags& flags, const Device& device,
                         const StreamFlags& stream, int64_t count, const std::function<void(const ViaUpdate&)>& on_update,
                         MetricsEndpoint* metrics, const std::string& delta_base_uri) {
  WS_EXPECT(delta_base_uri.empty() || count == 1, ErrorCode::kInvalidArgument,
            "--delta pushes one update from the loaded version; it does not combine with --repeat");
  // The version the layout holds, which a delta must name: a read of the loaded checkpoint.
  std::string version;
  if (!delta_base_uri.empty()) {
    const Options resolved = resolve_options(stream);
    version = checkpoint_content_digest(Checkpoint::open(delta_base_uri, resolved), resolved.stream);
  }
  UpdateMetrics applied(flags.via);
  Publication applied_series = publish(metrics, [&applied] { return applied.series(); });
  const auto record_then_report = [&](const ViaUpdate& update) {
    applied.completed(update.report);
    on_update(update);
  };
  ReceiverOptions options;
  options.transport = parse_transport(flags.via);
  options.token = random_token();
  options.device = device;
  // What the sender would refuse is refused here, before a process is started for it.
  const uint64_t bucket_bytes = parse_size(flags.bucket_size, "--bucket-size");
  WS_EXPECT(bucket_bytes >= kMinBucketBytes, ErrorCode::kInvalidArgument,
            "--bucket-size " + flags.bucket_size + " (" + std::to_string(bucket_bytes) +
                " bytes) is too small: at least 4KiB");
  options.max_bucket_bytes = std::max<uint64_t>(options.max_bucket_bytes, bucket_bytes);
  options.listen = flags.listen;
  if (flags.await_sender) {
    // A sender on another host: the token comes from stdin (never the command line).
    WS_EXPECT(flags.token_stdin || flags.open_without_token, ErrorCode::kInvalidArgument,
              "--await-sender needs --token-stdin (the token the sender must prove), or --open-without-token to "
              "accept any sender");
    options.token = flags.open_without_token ? std::string() : token_from_stdin();
    options.open_without_token = flags.open_without_token;
    UpdateReceiver receiver(layout, options);
    Publication receiver_series = publish(metrics, [&] { return update_receiver_series(receiver.stats(), flags.via); });
    receiver.set_version(version);
    std::fprintf(stderr, "weightstream: update receiver (%s) awaiting a sender at %s\n", flags.via.c_str(),
                 receiver.address().c_str());
    std::fflush(stderr);
    receive_each(receiver, count, std::chrono::steady_clock::now(), record_then_report);
    return;
  }
  UpdateReceiver receiver(layout, options);
  Publication receiver_series = publish(metrics, [&] { return update_receiver_series(receiver.stats(), flags.via); });

  receiver.set_version(version);
  // NCCL refuses two ranks on one GPU: the sender stages on the next one.
  Device sender_device = device;
  if (options.transport == TransportKind::kNccl && device.is_cuda() && cuda_device_count() > 1) {
    sender_device.index = (device.index + 1) % cuda_device_count();
  }
  const auto started = std::chrono::steady_clock::now();
  const pid_t child = spawn_sender(
      sender_arguments(reload_uri, receiver.address(), flags, sender_device, stream, count, delta_base_uri),
      options.token);

  // A sender that fails ends at once (a refused argument, an unreadable checkpoint): the
  // watcher sees it end and cancels the receiver, which would otherwise wait its whole
  // accept timeout. It waits without reaping (WNOWAIT), so the pid stays this child's until
  // the reap below, and a kill() can never reach another process.
  std::thread watcher([&receiver, child] {
    siginfo_t info{};
    while (::waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT) != 0 && errno == EINTR) {
    }
    if (info.si_code != CLD_EXITED || info.si_status != 0) receiver.cancel();
  });
  auto reap = [&] {
    watcher.join();
    int status = 0;
    while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
    }
    return status;
  };
  try {
    receive_each(receiver, count, started, record_then_report);
  } catch (const Error& error) {
    ::kill(child, SIGTERM);
    int status = reap();
    std::string how = WIFEXITED(status) ? "exited with status " + std::to_string(WEXITSTATUS(status))
                                        : "was stopped by signal " + std::to_string(WTERMSIG(status));
    if (error.code() == ErrorCode::kCancelled) {
      WS_FAIL(ErrorCode::kCancelled,
              "the sender process (weightstream send) " + how + " before its update started (its error is on the "
              "line above)");
    }
    WS_FAIL(error.code(), std::string(error.what()) + " (the sender process " + how + ")");
  } catch (...) {
    ::kill(child, SIGTERM);
    reap();  // joins the watcher too: a joinable std::thread must not be destroyed
    throw;
  }
  int status = reap();
  WS_EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, ErrorCode::kInternal,
            "the update was applied but the sender process failed afterwards (status " + std::to_string(status) + ")");
}

}  // namespace weightstream::cli
