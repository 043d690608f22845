// weightstream audit URI [--tp-size T --tp-rank R] [--reload URI2] [--batches N]
//                        [--order file|shuffled|reversed] [--repeat K] [--json]
// weightstream audit [URI] --speculative mtp [--model M] [--model-weights W] [--draft-only] ...
// Cold-loads URI, reloads from URI2 K times in N batches (neighbouring tensors, such as
// q, k and v of one layer, in different batches), then compares every parameter and
// derived buffer bit for bit with a fresh cold load of URI2. With the draft flags the
// target and its MTP draft are resolved and cold-loaded as `load` does (one stream), each
// module is reloaded in batches from its source (or URI2), and each is audited.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <numeric>
#include <optional>
#include <random>

#include "cli/draft_flags.hpp"
#include "cli/layout_flags.hpp"
#include "cli/peer_flags.hpp"
#include "cli/update_via.hpp"
#include "weightstream/error.hpp"

namespace weightstream::cli {
namespace {

struct AuditFlags {
  std::string uri;
  std::string reload_uri;
  std::string device = "cpu";
  LayoutFlags layout;
  int64_t batches = 3;
  std::string order = "file";
  int64_t repeat = 1;
  uint64_t seed = 0;
  bool json = false;
  StreamFlags stream;
  ViaFlags via;  // --via: the reload pushed from a sender process (issue 8)
  DraftFlags draft;  // --speculative mtp, --model, ...: the target and its draft (issue 5)
  PeerFlags peer;    // peer:// sources (issue 31)
};

/// Batches of plan indices: the plan's reads in `order`, dealt round-robin.
std::vector<std::vector<size_t>> batch_indices(size_t reads, int64_t batches, const std::string& order,
                                               std::mt19937_64& random) {
  std::vector<size_t> indices(reads);
  std::iota(indices.begin(), indices.end(), 0);
  if (order == "reversed") std::reverse(indices.begin(), indices.end());
  if (order == "shuffled") std::shuffle(indices.begin(), indices.end(), random);
  std::vector<std::vector<size_t>> result(static_cast<size_t>(batches));
  for (size_t i = 0; i < indices.size(); ++i) result[i % result.size()].push_back(indices[i]);
  return result;
}

/// One progress line over the audit's loads (the cold load, each reload, the fresh load),
/// each of which reports its own bytes.
class AuditProgress {
 public:
  AuditProgress(bool enabled, uint64_t total) : total_(total) { line_.emplace(enabled); }
  /// The callback of the next load.
  ProgressCallback part() {
    return [this, base = done_](uint64_t done, uint64_t) {
      if (line_) line_->update(std::min(base + done, total_ - 1), total_);
    };
  }
  /// After that load: it read `bytes`.
  void finished(uint64_t bytes) { done_ += bytes; }
  /// After the last load, before the report is printed: the line ends.
  void done() {
    if (line_) line_->update(total_, total_);
    line_.reset();
  }

 private:
  std::optional<ProgressLine> line_;
  uint64_t total_;
  uint64_t done_ = 0;
};

/// One reload of `layout` from `checkpoint` in the flags' batches and order. Returns the
/// bytes streamed; adds the seconds it took to `seconds`.
uint64_t reload_in_batches(ModelLayout& layout, const Checkpoint& checkpoint, const LoadPlan& plan,
                           const AuditFlags& flags, const Options& options, std::mt19937_64& random, double& seconds,
                           AuditProgress* progress = nullptr) {
  auto start = std::chrono::steady_clock::now();
  uint64_t bytes = 0;
  LoadSession session(layout);
  session.begin(LoadMode::kReload);
  for (const auto& indices : batch_indices(plan.reads.size(), flags.batches, flags.order, random)) {
    if (indices.empty()) continue;
    LoadPlan batch = plan.subset(indices);
    bytes += stream_into_session(checkpoint, batch, session, options.stream, progress ? progress->part() : nullptr).bytes;
    if (progress) progress->finished(batch.bytes_to_read);
  }
  session.finish();
  seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return bytes;
}

/// What the audit watches on one layout across its loads: model hook runs per load, and,
/// from the cold load on, the storage addresses and the memory the layout owns.
class LayoutWatch {
 public:
  /// Before the cold load.
  explicit LayoutWatch(const ModelLayout& layout) : layout_(&layout), hook_runs_(layout.model_hook_runs()) {}

  /// After each load, the cold load first.
  void loaded() {
    uint64_t runs = layout_->model_hook_runs() - hook_runs_;
    hook_runs_ = layout_->model_hook_runs();
    // Per load, each registered hook runs once: normalize by the number of hooks.
    size_t hooks = layout_->hooks().size();
    uint64_t per_hook = hooks == 0 || runs % hooks != 0 ? runs : runs / hooks;
    hooks_min_ = std::min(hooks_min_, per_hook);
    hooks_max_ = std::max(hooks_max_, per_hook);
    if (loads_++ == 0) {
      addresses_ = storage_addresses(*layout_);
      allocated_ = layout_->allocated_bytes();
    }
  }

  /// The audit's fields, against `fresh`, a fresh cold load of the reload's checkpoint.
  nlohmann::json report(const ModelLayout& fresh) const {
    uint64_t address_changes = 0;
    for (const auto& [name, address] : storage_addresses(*layout_)) {
      auto it = addresses_.find(name);
      if (it == addresses_.end() || it->second != address) ++address_changes;
    }
    int64_t memory_growth = static_cast<int64_t>(layout_->allocated_bytes()) - static_cast<int64_t>(allocated_);
    LayoutComparison comparison = compare_layouts(*layout_, fresh);
    bool clean = comparison.mismatched == 0 && address_changes == 0 && memory_growth == 0 &&
                 (layout_->hooks().empty() || (hooks_min_ == 1 && hooks_max_ == 1));
    return {{"layout", layout_->description()},
            {"hooks", layout_->hooks().size()},
            {"compared", comparison.compared},
            {"mismatched", comparison.mismatched},
            {"mismatches", comparison.mismatches},
            {"address_changes", address_changes},
            {"model_hook_runs_per_load", hooks_max_},
            {"model_hook_runs_per_load_min", hooks_min_},
            {"memory_growth_bytes", memory_growth},
            {"clean", clean}};
  }

 private:
  const ModelLayout* layout_;
  uint64_t hook_runs_ = 0;
  uint64_t hooks_min_ = UINT64_MAX;
  uint64_t hooks_max_ = 0;
  uint64_t loads_ = 0;
  std::map<std::string, const std::byte*> addresses_;
  uint64_t allocated_ = 0;
};

/// "LAYOUT: compared N, mismatched M, address changes A, model hook runs per load H, memory
/// growth G bytes: clean".
void print_audit_line(const std::string& label, const nlohmann::json& audit) {
  std::printf("%s: compared %llu, mismatched %llu, address changes %llu, model hook runs per load %llu, "
              "memory growth %lld bytes: %s\n",
              label.c_str(), audit["compared"].get<unsigned long long>(),
              audit["mismatched"].get<unsigned long long>(), audit["address_changes"].get<unsigned long long>(),
              audit["model_hook_runs_per_load"].get<unsigned long long>(), audit["memory_growth_bytes"].get<long long>(),
              audit["clean"].get<bool>() ? "clean" : "NOT CLEAN");
}

/// The audit of a rank pulled from peers (issue 31): cold pull, K reloads pulled again in
/// place, then a comparison with a fresh cold pull of the reload's source.
void run_peer_audit(const AuditFlags& flags) {
  Options options = resolve_options(flags.stream);
  Device device = parse_device(flags.device);
  const std::string reload_uri = flags.reload_uri.empty() ? flags.uri : flags.reload_uri;
  WS_EXPECT(!flags.via.requested() && is_peer_uri(reload_uri), ErrorCode::kInvalidArgument,
            "an audit from peers reloads from peers: --reload must be a peer:// URI too, and --via does not apply");
  PeerFlags peer = flags.peer;
  peer.token_stdin = flags.via.token_stdin;
  peer.fallback.clear();  // an audit names what failed, it does not fall back
  PeerSource source = connect_peers(flags.uri, peer, options);
  ModelLayout layout = peer_layout(source, flags.layout, device);
  LayoutWatch watch(layout);
  PeerPullReport cold;
  {
    LoadSession session(layout);
    session.begin(LoadMode::kCold);
    cold = source.pull(session);
    session.finish();
  }
  watch.loaded();
  double reload_seconds = 0;
  uint64_t reload_bytes = 0;
  for (int64_t repeat = 0; repeat < flags.repeat; ++repeat) {
    PeerPullReport report = reload_from_peers(layout, reload_uri, peer);
    reload_seconds += report.seconds;
    reload_bytes += report.bytes_from_peers;
    watch.loaded();
  }
  PeerLoad fresh = load_from_peers(reload_uri, flags.layout, device, peer, options);
  nlohmann::json result = {{"uri", flags.uri},        {"reload_uri", reload_uri},
                           {"device", device.name()}, {"repeat", flags.repeat},
                           {"reload_bytes", reload_bytes}, {"reload_seconds", reload_seconds},
                           {"bytes_from_peers", cold.bytes_from_peers}};
  result.update(watch.report(fresh.layout));
  if (flags.json) {
    print_json(result);
  } else {
    print_audit_line(layout.description(), result);
  }
  if (!result["clean"].get<bool>()) throw CLI::RuntimeError(3);
}

/// The audit of a target and its MTP draft (or the draft alone): resolved and cold-loaded
/// as `load` does, then each module reloaded in batches and compared with a fresh cold load.
void run_draft_audit(const AuditFlags& flags) {
  DraftFlags draft = with_target_uri("audit", flags.uri, flags.draft);
  WS_EXPECT(!flags.via.requested(), ErrorCode::kInvalidArgument,
            "audit: --via pushes the reload into one layout; it does not combine with --speculative/--model");
  Options options = resolve_options(flags.stream);
  Device device = parse_device(flags.device);
  LayoutOptions layout_options = layout_options_from_flags(flags.layout);
  std::vector<ModuleSetup> modules = ready_modules(draft, options, layout_options, device);
  std::vector<LayoutWatch> watches;
  for (const ModuleSetup& module : modules) watches.emplace_back(module.layout);
  std::vector<ModuleLoadRequest> requests = load_requests(modules);
  std::vector<StrategyLoad> cold = load_modules(requests, LoadMode::kCold, options);
  for (LayoutWatch& watch : watches) watch.loaded();

  // Each module reloads from --reload, or from the source it resolved to; one open each.
  std::map<std::string, Checkpoint> checkpoints;
  auto reload_checkpoint = [&](const ModuleSetup& module) -> const Checkpoint& {
    std::string uri = flags.reload_uri.empty() ? module.resolution.chosen().uri : flags.reload_uri;
    auto it = checkpoints.find(uri);
    if (it == checkpoints.end()) it = checkpoints.emplace(uri, Checkpoint::open(uri, options)).first;
    return it->second;
  };
  std::vector<LoadPlan> plans;
  for (const ModuleSetup& module : modules) plans.push_back(plan_layout_load(module.layout, reload_checkpoint(module)));
  std::mt19937_64 random(flags.seed);
  double reload_seconds = 0;
  uint64_t reload_bytes = 0;
  for (int64_t repeat = 0; repeat < flags.repeat; ++repeat) {
    for (size_t m = 0; m < modules.size(); ++m) {
      reload_bytes += reload_in_batches(modules[m].layout, reload_checkpoint(modules[m]), plans[m], flags, options,
                                        random, reload_seconds);
      watches[m].loaded();
    }
  }

  // Fresh modules set up the same way, cold-loaded straight from the reload's checkpoint.
  std::vector<ModuleSetup> fresh;
  for (const ModuleSetup& module : modules) {
    ModuleSetup copy;
    copy.role = module.role;
    copy.config = module.config;
    copy.layout = build_module_layout(module.config.config, module.role, layout_options);
    fresh.push_back(std::move(copy));
  }
  allocate_modules(fresh, draft, device);
  nlohmann::json result = {{"device", device.name()},   {"batches", flags.batches},
                           {"order", flags.order},      {"repeat", flags.repeat},
                           {"reload_bytes", reload_bytes}, {"reload_seconds", reload_seconds}};
  uint64_t cold_bytes = 0;
  for (const StrategyLoad& load : cold) cold_bytes += load.stream.bytes_read;
  result["cold_bytes_read"] = cold_bytes;
  bool clean = true;
  for (size_t m = 0; m < modules.size(); ++m) {
    const Checkpoint& checkpoint = reload_checkpoint(modules[m]);
    load_layout(fresh[m].layout, checkpoint, LoadMode::kCold, options.stream);
    nlohmann::json audit = watches[m].report(fresh[m].layout);
    audit["source"] = modules[m].resolution.chosen().uri;
    audit["field"] = modules[m].resolution.chosen().field;
    audit["reload_uri"] = checkpoint.uri();
    clean = clean && audit["clean"].get<bool>();
    result[std::string(module_role_name(modules[m].role))] = audit;
  }
  result["clean"] = clean;
  if (flags.json) {
    print_json(result);
  } else {
    for (const ModuleSetup& module : modules) {
      const nlohmann::json& audit = result[std::string(module_role_name(module.role))];
      print_audit_line(module.resolution.module_text() + " (" + audit["layout"].get<std::string>() + ")", audit);
    }
  }
  if (!clean) throw CLI::RuntimeError(3);
}

}  // namespace

void add_audit_command(CLI::App& app) {
  auto flags = std::make_shared<AuditFlags>();
  auto* command = app.add_subcommand(
      "audit", "Cold load, reload in batches, and compare every parameter and derived buffer with a fresh load");
  // Required unless the draft path below is taken (its sources can name the checkpoint).
  command->add_option("uri", flags->uri, "Checkpoint with config.json: a directory, file://, s3://, gs:// or az://");
  command->add_option("--reload", flags->reload_uri, "Checkpoint to reload from (default: URI)");
  command->add_option("--device", flags->device, "Where parameters live: cpu or cuda:N (default cpu)");
  add_layout_flags(*command, flags->layout);
  command->add_option("--batches", flags->batches, "Load calls per reload (default 3)")->check(CLI::Range(1, 1 << 20));
  command->add_option("--order", flags->order, "Order of tensors across batches: file, shuffled or reversed")
      ->check(CLI::IsMember({"file", "shuffled", "reversed"}));
  command->add_option("--repeat", flags->repeat, "Reloads (default 1); with --via, updates from one sender over one connection")->check(CLI::Range(1, 1 << 20));
  command->add_option("--seed", flags->seed, "Seed of the shuffled order (default 0)");
  command->add_flag("--json", flags->json,
                    "Print JSON: compared, mismatched, address_changes, model_hook_runs_per_load, memory_growth_bytes");
  add_stream_flags(*command, flags->stream);
  // ---- --via (issue 8, transfer layer): flags and the hidden sender it spawns ----------
  add_via_flags(*command, flags->via);
  add_send_command(app);
  // ---- end of the --via block ------------------------------------------------------------
  // ---- source resolution and drafts (issue 5, resolve layer; see cli/draft_flags.hpp) ----
  add_draft_load_flags(*command, flags->draft);
  // ---- end of source resolution and drafts -------------------------------------------------
  add_peer_flags(*command, flags->peer, /*token_flag=*/false);  // peer:// (issue 31)
  command->callback([flags] {
    if (is_peer_uri(flags->uri)) {  // peer:// (issue 31)
      run_peer_audit(*flags);
      return;
    }
    if (flags->draft.requested()) {  // source resolution and drafts
      run_draft_audit(*flags);
      return;
    }
    if (flags->uri.empty()) throw CLI::RequiredError("uri");
    // Before the cold load, so that a scrape sees the receiver's command from its start.
    std::unique_ptr<MetricsEndpoint> metrics = start_metrics(flags->via.metrics);
    Options options = resolve_options(flags->stream);
    Device device = parse_device(flags->device);
    std::string reload_uri = flags->reload_uri.empty() ? flags->uri : flags->reload_uri;
    Checkpoint first = Checkpoint::open(flags->uri, options);
    Checkpoint second = Checkpoint::open(reload_uri, options);

    ModelLayout layout = checkpoint_layout(first, flags->layout, device);
    LayoutWatch watch(layout);
    LoadPlan plan = plan_layout_load(layout, second);
    // The cold load, the reloads and the fresh load of the reload's checkpoint, in one line.
    const uint64_t cold_bytes = plan_layout_load(layout, first).bytes_to_read;
    AuditProgress progress(progress_enabled(flags->stream, options) && !flags->json,
                           std::max<uint64_t>(1, cold_bytes + (static_cast<uint64_t>(flags->repeat) + 1) * plan.bytes_to_read));
    const LayoutLoad cold = load_layout(layout, first, LoadMode::kCold, options.stream, progress.part());
    Publication cold_series = publish_load(metrics.get(), checkpoint_load_record(first, cold.stream), flags->via.metrics);
    progress.finished(cold_bytes);
    watch.loaded();
    std::mt19937_64 random(flags->seed);
    double reload_seconds = 0;
    uint64_t reload_bytes = 0;
    double update_seconds = 0;  // --via: receiver's start to finish, summed over repeats
    nlohmann::json update_seconds_each = nlohmann::json::array();  // --via: each update's
    UpdatePhases update_phases;  // --via: where those seconds went, summed over repeats
    uint64_t sparse_tensors = 0, dense_tensors = 0, checked_tensors = 0;  // --via --delta: how the tensors went
    if (flags->via.requested()) {
      // ---- --via (issue 8): the reloads arrive as buckets from one `weightstream send`
      // process, one update after another over one connection
      receive_updates_via(layout, reload_uri, flags->via, device, flags->stream, flags->repeat,
                          [&](const ViaUpdate& update) {
                            reload_seconds += update.seconds;
                            update_seconds += update.report.seconds;
                            update_seconds_each.push_back(update.report.seconds);
                            for (const auto& [name, phase] : kUpdatePhases) {
                              update_phases.*phase += update.report.phases.*phase;
                            }
                            reload_bytes += update.report.bytes;
                            sparse_tensors += update.report.sparse_tensors;
                            dense_tensors += update.report.dense_tensors;
                            checked_tensors += update.report.checked_tensors;
                            progress.finished(plan.bytes_to_read);
                            watch.loaded();
                          },
                          metrics.get(), flags->via.delta ? flags->uri : std::string());
      // ---- end of the --via block ----------------------------------------------------------
    } else {
      for (int64_t repeat = 0; repeat < flags->repeat; ++repeat) {
        reload_bytes += reload_in_batches(layout, second, plan, *flags, options, random, reload_seconds, &progress);
        watch.loaded();
      }
    }

    // The reload's bytes as the audited model holds them: the reload checkpoint's layers in
    // the audited checkpoint's dtype and quantization, so an F16 reload of a BF16 model is
    // converted and a BF16 reload of an FP8 block-scaled model quantized on both sides, and a
    // reload that lacks layers the model has leaves those NOT CLEAN.
    const ModelConfig audited = checkpoint_layout_config(first);
    ModelLayout fresh = checkpoint_layout(second, flags->layout, device, &audited);
    load_layout(fresh, second, LoadMode::kCold, options.stream, progress.part());
    progress.done();
    nlohmann::json result = {{"uri", first.uri()},
                             {"reload_uri", second.uri()},
                             {"device", device.name()},
                             {"batches", flags->batches},
                             {"order", flags->order},
                             {"repeat", flags->repeat},
                             {"reload_bytes", reload_bytes},
                             {"reload_seconds", reload_seconds}};
    result.update(watch.report(fresh));
    // ---- --via (issue 8) ----
    if (flags->via.requested()) {
      result["via"] = flags->via.via;
      result["bucket_size"] = flags->via.bucket_size;
      result["update_seconds"] = update_seconds;
      result["update_seconds_each"] = update_seconds_each;
      result["update_gbps"] = update_seconds > 0 ? static_cast<double>(reload_bytes) / update_seconds / 1e9 : 0.0;
      nlohmann::json phases = nlohmann::json::object();
      for (const auto& [name, phase] : kUpdatePhases) phases[name] = update_phases.*phase;
      result["update_phases"] = phases;
      if (flags->via.delta) {
        result["sparse_tensors"] = sparse_tensors;
        result["dense_tensors"] = dense_tensors;
        result["checked_tensors"] = checked_tensors;
      }
    }
    // ---- end of the --via block ----
    if (flags->json) {
      print_json(result);
    } else {
      print_audit_line(layout.description(), result);
      if (flags->via.requested()) {  // ---- --via (issue 8) ----
        std::printf("update via %s: %.3f s, %.2f GB/s\n", flags->via.via.c_str(), update_seconds,
                    update_seconds > 0 ? static_cast<double>(reload_bytes) / update_seconds / 1e9 : 0.0);
        if (flags->via.delta) {
          std::printf("delta: %llu tensors as changed elements, %llu whole, %s moved; %llu checked after it\n",
                      static_cast<unsigned long long>(sparse_tensors), static_cast<unsigned long long>(dense_tensors),
                      format_size(reload_bytes).c_str(), static_cast<unsigned long long>(checked_tensors));
        }
      }
    }
    if (!result["clean"].get<bool>()) throw CLI::RuntimeError(3);
  });
}

}  // namespace weightstream::cli
