#pragma once
/// @file audit.hpp
/// The audit of reloads: a layout is cold-loaded, reloaded K times in batches (neighbouring
/// tensors, such as q, k and v of one layer, in different batches), then compared bit for bit
/// with a fresh cold load of the reload's checkpoint, while its storage addresses, the memory
/// it owns and its model hook runs per load are watched. `weightstream audit` prints it.

#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "weightstream/load.hpp"

namespace weightstream {

/// The order of a reload's tensors across its batches.
enum class AuditOrder {
  kFile,      ///< checkpoint file order
  kShuffled,  ///< shuffled with the audit's seed
  kReversed,  ///< file order reversed
};

/// "file", "shuffled", "reversed" as AuditOrder. Throws Error(kInvalidArgument) naming the
/// others for another name.
AuditOrder audit_order_from_name(std::string_view name);

/// Batches of `reads` plan indices: the reads in `order`, dealt round-robin into `batches`.
std::vector<std::vector<size_t>> audit_batches(size_t reads, int64_t batches, AuditOrder order,
                                               std::mt19937_64& random);

/// One reload of `layout` from `checkpoint` (whose plan is `plan`) in one session of `batches`
/// load calls, in `order`. Returns the bytes streamed.
uint64_t reload_in_batches(ModelLayout& layout, const Checkpoint& checkpoint, const LoadPlan& plan, int64_t batches,
                           AuditOrder order, std::mt19937_64& random, const StreamOptions& options,
                           const ProgressCallback& progress = {});

/// What the audit found on one layout.
struct LayoutAudit {
  std::string layout;             ///< its description
  uint64_t hooks = 0;             ///< model hooks registered
  LayoutComparison comparison;    ///< against the fresh load
  uint64_t address_changes = 0;   ///< parameters and derived buffers whose address changed after the cold load
  uint64_t hook_runs_per_load = 0;      ///< the most runs of each hook in one load
  uint64_t hook_runs_per_load_min = 0;  ///< the fewest
  int64_t memory_growth_bytes = 0;      ///< memory the layout owns beyond what it owned after the cold load
  /// Nothing mismatched, moved or grew, and each hook ran exactly once per load.
  bool clean = false;
};

/// What the audit watches on one layout across its loads: model hook runs per load, and,
/// from the cold load on, the storage addresses and the memory the layout owns.
class LayoutWatch {
 public:
  /// Before the cold load, or after it with `hook_runs_before` the runs before it (0 for a
  /// layout built for it).
  explicit LayoutWatch(const ModelLayout& layout);
  LayoutWatch(const ModelLayout& layout, uint64_t hook_runs_before);

  /// After each load, the cold load first.
  void loaded();

  /// The audit against `fresh`, a fresh cold load of the reload's checkpoint.
  LayoutAudit report(const ModelLayout& fresh) const;

 private:
  const ModelLayout* layout_;
  uint64_t hook_runs_ = 0;
  uint64_t hooks_min_ = UINT64_MAX;
  uint64_t hooks_max_ = 0;
  uint64_t loads_ = 0;
  std::map<std::string, const std::byte*> addresses_;
  uint64_t allocated_ = 0;
};

/// A reload made some other way than from the checkpoint in batches (`weightstream audit
/// --via` pushes it from a sender): it reloads the layout `repeat` times and calls
/// `reloaded(bytes, seconds)` after each.
using AuditReloads = std::function<void(ModelLayout& layout, int64_t repeat,
                                        const std::function<void(uint64_t bytes, double seconds)>& reloaded)>;

/// What audit_reloads does.
struct AuditOptions {
  EngineLayoutOptions layout;  ///< the audited rank and its device (hooks included)
  int64_t batches = 3;         ///< load calls per reload
  AuditOrder order = AuditOrder::kFile;
  int64_t repeat = 1;          ///< reloads
  uint64_t seed = 0;           ///< of the shuffled order
  StreamOptions stream;
  /// Replaces the batched reloads from the second checkpoint; empty: those.
  AuditReloads reloads;
  /// After the cold load (a caller publishes its metrics), before the reloads.
  std::function<void(const LayoutLoad& cold)> on_cold;
  /// Over every load of the audit: the cold load, the reloads and the fresh load.
  ProgressCallback progress;
};

/// The audit of reloads of one layout.
struct AuditReport {
  LayoutAudit audit;
  uint64_t reload_bytes = 0;
  double reload_seconds = 0;
  StreamStats cold;  ///< the cold load's stream
};

/// The audit of `first`'s layout (options.layout) reloaded from `second`: cold load of
/// `first`, options.repeat reloads from `second` in options.batches batches (or
/// options.reloads), then a comparison with a fresh cold load of `second` into a layout of
/// `second` held as `first`'s model (its dtype and quantization: an F16 reload of a BF16
/// model is converted on both sides, and a reload that lacks layers the model has shows them
/// mismatched). Throws what the loads throw.
AuditReport audit_reloads(const Checkpoint& first, const Checkpoint& second, const AuditOptions& options);

}  // namespace weightstream
