// weightstream audit URI [--tp-size T --tp-rank R] [--reload URI2] [--batches N]
//                        [--order file|shuffled|reversed] [--repeat K] [--json]
// Cold-loads URI, reloads from URI2 K times in N batches (neighbouring tensors, such as
// q, k and v of one layer, in different batches), then compares every parameter and
// derived buffer bit for bit with a fresh cold load of URI2.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>

#include "cli/layout_flags.hpp"
#include "cli/update_via.hpp"

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

}  // namespace

void add_audit_command(CLI::App& app) {
  auto flags = std::make_shared<AuditFlags>();
  auto* command = app.add_subcommand(
      "audit", "Cold load, reload in batches, and compare every parameter and derived buffer with a fresh load");
  command->add_option("uri", flags->uri, "Checkpoint with config.json: a directory, file:// or s3://")->required();
  command->add_option("--reload", flags->reload_uri, "Checkpoint to reload from (default: URI)");
  command->add_option("--device", flags->device, "Where parameters live: cpu or cuda:N (default cpu)");
  add_layout_flags(*command, flags->layout);
  command->add_option("--batches", flags->batches, "Load calls per reload (default 3)")->check(CLI::Range(1, 1 << 20));
  command->add_option("--order", flags->order, "Order of tensors across batches: file, shuffled or reversed")
      ->check(CLI::IsMember({"file", "shuffled", "reversed"}));
  command->add_option("--repeat", flags->repeat, "Reloads (default 1)")->check(CLI::Range(1, 1 << 20));
  command->add_option("--seed", flags->seed, "Seed of the shuffled order (default 0)");
  command->add_flag("--json", flags->json,
                    "Print JSON: compared, mismatched, address_changes, model_hook_runs_per_load, memory_growth_bytes");
  add_stream_flags(*command, flags->stream);
  // ---- --via (issue 8, transfer layer): flags and the hidden sender it spawns ----------
  add_via_flags(*command, flags->via);
  add_send_command(app);
  // ---- end of the --via block ------------------------------------------------------------
  command->callback([flags] {
    Options options = resolve_options(flags->stream);
    Device device = parse_device(flags->device);
    std::string reload_uri = flags->reload_uri.empty() ? flags->uri : flags->reload_uri;
    Checkpoint first = Checkpoint::open(flags->uri, options);
    Checkpoint second = Checkpoint::open(reload_uri, options);

    ModelLayout layout = checkpoint_layout(first, flags->layout, device);
    uint64_t hook_runs = layout.model_hook_runs();
    uint64_t hooks_min = UINT64_MAX, hooks_max = 0;
    auto count_hooks = [&] {
      uint64_t runs = layout.model_hook_runs() - hook_runs;
      hook_runs = layout.model_hook_runs();
      // Per load, each registered hook runs once: normalize by the number of hooks.
      uint64_t per_hook = layout.hooks().empty() ? runs : runs / layout.hooks().size();
      if (!layout.hooks().empty() && runs % layout.hooks().size() != 0) per_hook = runs;
      hooks_min = std::min(hooks_min, per_hook);
      hooks_max = std::max(hooks_max, per_hook);
    };
    load_layout(layout, first, LoadMode::kCold, options.stream);
    count_hooks();
    auto addresses = storage_addresses(layout);
    uint64_t allocated = layout.allocated_bytes();

    LoadPlan plan = plan_layout_load(layout, second);
    std::mt19937_64 random(flags->seed);
    double reload_seconds = 0;
    uint64_t reload_bytes = 0;
    double update_seconds = 0;  // --via: receiver's start to finish, summed over repeats
    for (int64_t repeat = 0; repeat < flags->repeat; ++repeat) {
      // ---- --via (issue 8): the reload arrives as buckets from a `weightstream send` process
      if (flags->via.requested()) {
        ViaUpdate update = receive_update_via(layout, reload_uri, flags->via, device, flags->stream);
        reload_seconds += update.seconds;
        update_seconds += update.report.seconds;
        reload_bytes += update.report.bytes;
        count_hooks();
        continue;
      }
      // ---- end of the --via block ----------------------------------------------------------
      auto start = std::chrono::steady_clock::now();
      LoadSession session(layout);
      session.begin(LoadMode::kReload);
      for (const auto& indices : batch_indices(plan.reads.size(), flags->batches, flags->order, random)) {
        if (indices.empty()) continue;
        reload_bytes += stream_into_session(second, plan.subset(indices), session, options.stream).bytes;
      }
      session.finish();
      reload_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      count_hooks();
    }

    uint64_t address_changes = 0;
    for (const auto& [name, address] : storage_addresses(layout)) {
      auto it = addresses.find(name);
      if (it == addresses.end() || it->second != address) ++address_changes;
    }
    int64_t memory_growth = static_cast<int64_t>(layout.allocated_bytes()) - static_cast<int64_t>(allocated);

    ModelLayout fresh = checkpoint_layout(second, flags->layout, device);
    load_layout(fresh, second, LoadMode::kCold, options.stream);
    LayoutComparison comparison = compare_layouts(layout, fresh);

    uint64_t hooks_per_load = hooks_max;
    bool clean = comparison.mismatched == 0 && address_changes == 0 && memory_growth == 0 &&
                 (layout.hooks().empty() || (hooks_min == 1 && hooks_max == 1));
    nlohmann::json result = {{"uri", first.uri()},
                             {"reload_uri", second.uri()},
                             {"layout", layout.description()},
                             {"device", device.name()},
                             {"batches", flags->batches},
                             {"order", flags->order},
                             {"repeat", flags->repeat},
                             {"hooks", layout.hooks().size()},
                             {"compared", comparison.compared},
                             {"mismatched", comparison.mismatched},
                             {"mismatches", comparison.mismatches},
                             {"address_changes", address_changes},
                             {"model_hook_runs_per_load", hooks_per_load},
                             {"model_hook_runs_per_load_min", hooks_min},
                             {"memory_growth_bytes", memory_growth},
                             {"reload_bytes", reload_bytes},
                             {"reload_seconds", reload_seconds},
                             {"clean", clean}};
    // ---- --via (issue 8) ----
    if (flags->via.requested()) {
      result["via"] = flags->via.via;
      result["bucket_size"] = flags->via.bucket_size;
      result["update_seconds"] = update_seconds;
      result["update_gbps"] = update_seconds > 0 ? static_cast<double>(reload_bytes) / update_seconds / 1e9 : 0.0;
    }
    // ---- end of the --via block ----
    if (flags->json) {
      print_json(result);
    } else {
      std::printf("%s: compared %llu, mismatched %llu, address changes %llu, model hook runs per load %llu, "
                  "memory growth %lld bytes: %s\n",
                  layout.description().c_str(), static_cast<unsigned long long>(comparison.compared),
                  static_cast<unsigned long long>(comparison.mismatched),
                  static_cast<unsigned long long>(address_changes), static_cast<unsigned long long>(hooks_per_load),
                  static_cast<long long>(memory_growth), clean ? "clean" : "NOT CLEAN");
      if (flags->via.requested()) {  // ---- --via (issue 8) ----
        std::printf("update via %s: %.3f s, %.2f GB/s\n", flags->via.via.c_str(), update_seconds,
                    update_seconds > 0 ? static_cast<double>(reload_bytes) / update_seconds / 1e9 : 0.0);
      }
    }
    if (!clean) throw CLI::RuntimeError(3);
  });
}

}  // namespace weightstream::cli
