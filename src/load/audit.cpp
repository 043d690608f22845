// The audit procedure of reloads (audit.hpp): the command prints it.
#include "weightstream/audit.hpp"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "weightstream/error.hpp"

namespace weightstream {

AuditOrder audit_order_from_name(std::string_view name) {
  if (name == "file") return AuditOrder::kFile;
  if (name == "shuffled") return AuditOrder::kShuffled;
  if (name == "reversed") return AuditOrder::kReversed;
  WS_FAIL(ErrorCode::kInvalidArgument, "audit order '" + std::string(name) + "' is not one of file, shuffled, reversed");
}

std::vector<std::vector<size_t>> audit_batches(size_t reads, int64_t batches, AuditOrder order,
                                               std::mt19937_64& random) {
  WS_EXPECT(batches >= 1, ErrorCode::kInvalidArgument, "an audit reloads in at least 1 batch");
  std::vector<size_t> indices(reads);
  std::iota(indices.begin(), indices.end(), 0);
  if (order == AuditOrder::kReversed) std::reverse(indices.begin(), indices.end());
  if (order == AuditOrder::kShuffled) std::shuffle(indices.begin(), indices.end(), random);
  std::vector<std::vector<size_t>> result(static_cast<size_t>(batches));
  for (size_t i = 0; i < indices.size(); ++i) result[i % result.size()].push_back(indices[i]);
  return result;
}

uint64_t reload_in_batches(ModelLayout& layout, const Checkpoint& checkpoint, const LoadPlan& plan, int64_t batches,
                           AuditOrder order, std::mt19937_64& random, const StreamOptions& options,
                           const ProgressCallback& progress) {
  uint64_t bytes = 0;
  uint64_t done = 0;  // of the plan's bytes, batches before this one
  LoadSession session(layout);
  session.begin(LoadMode::kReload);
  for (const auto& indices : audit_batches(plan.reads.size(), batches, order, random)) {
    if (indices.empty()) continue;
    LoadPlan batch = plan.subset(indices);
    ProgressCallback part;
    if (progress) {
      part = [&progress, done, total = plan.bytes_to_read](uint64_t batch_done, uint64_t) {
        progress(done + batch_done, total);
      };
    }
    bytes += stream_into_session(checkpoint, batch, session, options, part).bytes;
    done += batch.bytes_to_read;
  }
  session.finish();
  return bytes;
}

LayoutWatch::LayoutWatch(const ModelLayout& layout) : LayoutWatch(layout, layout.model_hook_runs()) {}

LayoutWatch::LayoutWatch(const ModelLayout& layout, uint64_t hook_runs_before)
    : layout_(&layout), hook_runs_(hook_runs_before) {}

void LayoutWatch::loaded() {
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

LayoutAudit LayoutWatch::report(const ModelLayout& fresh) const {
  LayoutAudit audit;
  audit.layout = layout_->description();
  audit.hooks = layout_->hooks().size();
  for (const auto& [name, address] : storage_addresses(*layout_)) {
    auto it = addresses_.find(name);
    if (it == addresses_.end() || it->second != address) ++audit.address_changes;
  }
  audit.memory_growth_bytes = static_cast<int64_t>(layout_->allocated_bytes()) - static_cast<int64_t>(allocated_);
  audit.comparison = compare_layouts(*layout_, fresh);
  audit.hook_runs_per_load = hooks_max_;
  audit.hook_runs_per_load_min = hooks_min_;
  audit.clean = audit.comparison.mismatched == 0 && audit.address_changes == 0 && audit.memory_growth_bytes == 0 &&
                (layout_->hooks().empty() || (hooks_min_ == 1 && hooks_max_ == 1));
  return audit;
}

namespace {

/// One progress over the audit's loads (the cold load, each reload, the fresh load), each of
/// which reports its own bytes.
class AuditProgress {
 public:
  AuditProgress(const ProgressCallback& progress, uint64_t total) : progress_(progress), total_(std::max<uint64_t>(1, total)) {}
  /// The callback of the next load.
  ProgressCallback part() {
    if (!progress_) return {};
    return [this, base = done_](uint64_t done, uint64_t) { progress_(std::min(base + done, total_ - 1), total_); };
  }
  /// After that load: it read `bytes`.
  void finished(uint64_t bytes) { done_ += bytes; }
  /// After the last load.
  void done() {
    if (progress_) progress_(total_, total_);
  }

 private:
  const ProgressCallback& progress_;
  uint64_t total_;
  uint64_t done_ = 0;
};

}  // namespace

AuditReport audit_reloads(const Checkpoint& first, const Checkpoint& second, const AuditOptions& options) {
  ModelLayout layout = engine_layout(first, options.layout);
  LayoutWatch watch(layout);
  LoadPlan plan = plan_layout_load(layout, second);
  const uint64_t cold_bytes = plan_layout_load(layout, first).bytes_to_read;
  AuditProgress progress(options.progress,
                         cold_bytes + (static_cast<uint64_t>(options.repeat) + 1) * plan.bytes_to_read);
  AuditReport report;
  const LayoutLoad cold = load_layout(layout, first, LoadMode::kCold, options.stream, progress.part());
  report.cold = cold.stream;
  if (options.on_cold) options.on_cold(cold);
  progress.finished(cold_bytes);
  watch.loaded();
  auto reloaded = [&](uint64_t bytes, double seconds) {
    report.reload_bytes += bytes;
    report.reload_seconds += seconds;
    progress.finished(plan.bytes_to_read);
    watch.loaded();
  };
  if (options.reloads) {
    options.reloads(layout, options.repeat, reloaded);
  } else {
    std::mt19937_64 random(options.seed);
    for (int64_t repeat = 0; repeat < options.repeat; ++repeat) {
      auto start = std::chrono::steady_clock::now();
      uint64_t bytes = reload_in_batches(layout, second, plan, options.batches, options.order, random, options.stream,
                                         progress.part());
      reloaded(bytes, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  EngineLayoutOptions fresh_options = options.layout;
  fresh_options.held_as = checkpoint_layout_config(first);
  ModelLayout fresh = engine_layout(second, fresh_options);
  load_layout(fresh, second, LoadMode::kCold, options.stream, progress.part());
  progress.done();
  report.audit = watch.report(fresh);
  return report;
}

}  // namespace weightstream
