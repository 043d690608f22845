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
#include "weightstream/audit.hpp"
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

/// The audit's fields of one layout (LayoutAudit), as --json prints them.
nlohmann::json audit_json(const LayoutAudit& audit) {
  return {{"layout", audit.layout},
          {"hooks", audit.hooks},
          {"compared", audit.comparison.compared},
          {"mismatched", audit.comparison.mismatched},
          {"mismatches", audit.comparison.mismatches},
          {"address_changes", audit.address_changes},
          {"model_hook_runs_per_load", audit.hook_runs_per_load},
          {"model_hook_runs_per_load_min", audit.hook_runs_per_load_min},
          {"memory_growth_bytes", audit.memory_growth_bytes},
          {"clean", audit.clean}};
}

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
  WS_EXPECT(!flags.via.requested() && !source_is_checkpoint(source_kind(reload_uri)), ErrorCode::kInvalidArgument,
            "an audit from peers reloads from peers: --reload must be a peer:// URI too, and --via does not apply");
  PeerFlags peer = flags.peer;
  peer.token_stdin = flags.via.token_stdin;
  peer.fallback.clear();  // an audit names what failed, it does not fall back
  EngineLayoutOptions layout_options;
  layout_options.layout = layout_options_from_flags(flags.layout);
  layout_options.device = device;
  SourceLayout loaded = open_flag_source(flags.uri, peer, options)->load_new(layout_options);
  ModelLayout& layout = loaded.layout;
  const PeerPullReport cold = loaded.load.pull;
  LayoutWatch watch(layout, /*hook_runs_before=*/0);  // built by load_new, which cold-loaded it
  watch.loaded();
  std::unique_ptr<Source> reload = open_flag_source(reload_uri, peer, options);
  double reload_seconds = 0;
  uint64_t reload_bytes = 0;
  for (int64_t repeat = 0; repeat < flags.repeat; ++repeat) {
    PeerPullReport report = reload->load(layout, LoadMode::kReload).pull;
    reload->close();  // each reload connects again, as a new puller would
    reload_seconds += report.seconds;
    reload_bytes += report.bytes_from_peers;
    watch.loaded();
  }
  SourceLayout fresh = open_flag_source(reload_uri, peer, options)->load_new(layout_options);
  nlohmann::json result = {{"uri", flags.uri},        {"reload_uri", reload_uri},
                           {"device", device.name()}, {"repeat", flags.repeat},
                           {"reload_bytes", reload_bytes}, {"reload_seconds", reload_seconds},
                           {"bytes_from_peers", cold.bytes_from_peers}};
  result.update(audit_json(watch.report(fresh.layout)));
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
      auto start = std::chrono::steady_clock::now();
      reload_bytes += reload_in_batches(modules[m].layout, reload_checkpoint(modules[m]), plans[m], flags.batches,
                                        audit_order_from_name(flags.order), random, options.stream);
      reload_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
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
    nlohmann::json audit = audit_json(watches[m].report(fresh[m].layout));
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

/// What the --via updates of an audit moved, summed over its repeats.
struct ViaTotals {
  double update_seconds = 0;  // receiver's start to finish
  nlohmann::json update_seconds_each = nlohmann::json::array();
  UpdatePhases update_phases;  // where those seconds went
  uint64_t sparse_tensors = 0, dense_tensors = 0, checked_tensors = 0;  // --delta: how the tensors went
};

/// The audit's reloads as buckets from one `weightstream send` process, one update after
/// another over one connection (--via, issue 8); `totals` sums what they moved.
AuditReloads via_reloads(const AuditFlags& flags, const std::string& reload_uri, const Device& device,
                         MetricsEndpoint* metrics, ViaTotals& totals) {
  return [&flags, reload_uri, device, metrics, &totals](ModelLayout& layout, int64_t repeat,
                                                        const std::function<void(uint64_t, double)>& reloaded) {
    receive_updates_via(layout, reload_uri, flags.via, device, flags.stream, repeat,
                        [&](const ViaUpdate& update) {
                          totals.update_seconds += update.report.seconds;
                          totals.update_seconds_each.push_back(update.report.seconds);
                          for (const auto& [name, phase] : kUpdatePhases) {
                            totals.update_phases.*phase += update.report.phases.*phase;
                          }
                          totals.sparse_tensors += update.report.sparse_tensors;
                          totals.dense_tensors += update.report.dense_tensors;
                          totals.checked_tensors += update.report.checked_tensors;
                          reloaded(update.report.bytes, update.seconds);
                        },
                        metrics, flags.via.delta ? flags.uri : std::string());
  };
}

/// --via's fields of the audit's JSON: the transport, the updates' seconds and phases, and
/// with --delta how the tensors went.
void add_via_json(nlohmann::json& result, const ViaFlags& flags, const ViaTotals& via, uint64_t reload_bytes) {
  result["via"] = flags.via;
  result["bucket_size"] = flags.bucket_size;
  result["update_seconds"] = via.update_seconds;
  result["update_seconds_each"] = via.update_seconds_each;
  result["update_gbps"] =
      via.update_seconds > 0 ? static_cast<double>(reload_bytes) / via.update_seconds / 1e9 : 0.0;
  nlohmann::json phases = nlohmann::json::object();
  for (const auto& [name, phase] : kUpdatePhases) phases[name] = via.update_phases.*phase;
  result["update_phases"] = phases;
  if (flags.delta) {
    result["sparse_tensors"] = via.sparse_tensors;
    result["dense_tensors"] = via.dense_tensors;
    result["checked_tensors"] = via.checked_tensors;
  }
}

/// The same as lines after the audit's.
void print_via(const ViaFlags& flags, const ViaTotals& via, uint64_t reload_bytes) {
  std::printf("update via %s: %.3f s, %.2f GB/s\n", flags.via.c_str(), via.update_seconds,
              via.update_seconds > 0 ? static_cast<double>(reload_bytes) / via.update_seconds / 1e9 : 0.0);
  if (flags.delta) {
    std::printf("delta: %llu tensors as changed elements, %llu whole, %s moved; %llu checked after it\n",
                static_cast<unsigned long long>(via.sparse_tensors), static_cast<unsigned long long>(via.dense_tensors),
                format_size(reload_bytes).c_str(), static_cast<unsigned long long>(via.checked_tensors));
  }
}

/// The audit of a checkpoint's layout (the library's audit_reloads), reloaded from --reload
/// in batches or through --via, printed.
void run_checkpoint_audit(const AuditFlags& flags) {
  // Before the cold load, so that a scrape sees the receiver's command from its start.
  std::unique_ptr<MetricsEndpoint> metrics = start_metrics(flags.via.metrics);
  Options options = resolve_options(flags.stream);
  Device device = parse_device(flags.device);
  std::string reload_uri = flags.reload_uri.empty() ? flags.uri : flags.reload_uri;
  Checkpoint first = Checkpoint::open(flags.uri, options);
  Checkpoint second = Checkpoint::open(reload_uri, options);
  AuditOptions audit;
  audit.layout.layout = layout_options_from_flags(flags.layout);
  audit.layout.device = device;
  audit.batches = flags.batches;
  audit.order = audit_order_from_name(flags.order);
  audit.repeat = flags.repeat;
  audit.seed = flags.seed;
  audit.stream = options.stream;
  Publication cold_series;
  audit.on_cold = [&](const LayoutLoad& cold) {
    cold_series = publish_load(metrics.get(), checkpoint_load_record(first, cold.stream), flags.via.metrics);
  };
  ViaTotals via;
  if (flags.via.requested()) audit.reloads = via_reloads(flags, reload_uri, device, metrics.get(), via);
  AuditReport report;
  {
    ProgressLine line(progress_enabled(flags.stream, options) && !flags.json);
    audit.progress = [&line](uint64_t done, uint64_t total) { line.update(done, total); };
    report = audit_reloads(first, second, audit);
  }
  nlohmann::json result = {{"uri", first.uri()},
                           {"reload_uri", second.uri()},
                           {"device", device.name()},
                           {"batches", flags.batches},
                           {"order", flags.order},
                           {"repeat", flags.repeat},
                           {"reload_bytes", report.reload_bytes},
                           {"reload_seconds", report.reload_seconds}};
  result.update(audit_json(report.audit));
  if (flags.via.requested()) add_via_json(result, flags.via, via, report.reload_bytes);
  if (flags.json) {
    print_json(result);
  } else {
    print_audit_line(report.audit.layout, result);
    if (flags.via.requested()) print_via(flags.via, via, report.reload_bytes);
  }
  if (!report.audit.clean) throw CLI::RuntimeError(3);
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
    if (!flags->uri.empty() && !source_is_checkpoint(source_kind(flags->uri))) {  // peers (issue 31)
      run_peer_audit(*flags);
      return;
    }
    if (flags->draft.requested()) {  // source resolution and drafts
      run_draft_audit(*flags);
      return;
    }
    if (flags->uri.empty()) throw CLI::RequiredError("uri");
    run_checkpoint_audit(*flags);
  });
}

}  // namespace weightstream::cli
