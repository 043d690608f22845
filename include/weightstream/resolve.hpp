#pragma once
/// @file resolve.hpp
/// The resolve layer: where a model's weights come from, and the ordered chain of load
/// strategies that fetch them. A model (the target, or a speculative draft such as the MTP
/// layers DeepSeek-V3, GLM and Qwen3-Next ship inside the target's checkpoint) is described
/// as an engine describes it: `model` (a URI or a local directory that may hold only config
/// and tokenizer files), `model_weights` (a URI or nothing), and the checkpoint URI of
/// Options::model_uri (WEIGHTSTREAM_MODEL_URI, alias MX_MODEL_URI, or set by the caller).
/// Sources are tried in that order; the first that holds a safetensors tensor the module's
/// layout wants is chosen, and every one passed over keeps its reason, so that a failure is
/// one error that names them all.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "weightstream/load.hpp"
#include "weightstream/model.hpp"
#include "weightstream/options.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {

/// Which module of a model a load serves.
enum class ModuleRole {
  kTarget,  ///< the model itself, without its MTP layers
  kDraft,   ///< the speculative (MTP) draft module
};

/// "target" or "draft".
std::string_view module_role_name(ModuleRole role) noexcept;

/// How a model names its weights, as an engine's model config does.
struct ModelSource {
  std::string model;          ///< URI or local directory (possibly config and tokenizer files only); may be empty
  std::string model_weights;  ///< URI of the weights, or empty
};

/// The label of the checkpoint URI (Options::model_uri) among a module's candidates: where
/// it came from (Options::model_uri_origin: "WEIGHTSTREAM_MODEL_URI", "MX_MODEL_URI" or
/// "model_uri option"), or "WEIGHTSTREAM_MODEL_URI", the variable to set, when it is not set.
std::string checkpoint_uri_field(const Options& options);

/// One source considered for a module.
struct SourceCandidate {
  /// "model_weights", "model", or the checkpoint URI's label (checkpoint_uri_field)
  std::string field;
  std::string uri;     ///< empty when the field is not set
  /// Why it was passed over ("not set", "no *.safetensors files", "no tensor the draft
  /// wants", "cannot open: <error>"); empty for the chosen one.
  std::string reason;
  /// Shards that hold a wanted tensor, per the index (all shards when there is none); set
  /// for the chosen source.
  std::vector<std::string> shards;
  /// The chosen source's checkpoint when probing opened it (no index: only the shard
  /// headers tell which tensors it holds; or SourceProbe::kHeaders), handed to the load so
  /// that they are read once. Null otherwise.
  std::shared_ptr<const Checkpoint> checkpoint;
  /// "model /models/glm-snapshot: no *.safetensors files", "model_weights: not set".
  std::string text() const;
};

/// Where one module's weights come from: every candidate in order, up to the chosen one.
struct SourceResolution {
  ModuleRole role = ModuleRole::kTarget;
  std::string method;  ///< speculative method of a draft ("mtp"); empty for the target
  std::vector<SourceCandidate> candidates;  ///< in the order tried; the last is chosen when found()
  bool found() const noexcept { return !candidates.empty() && candidates.back().reason.empty(); }
  /// The chosen candidate. Throws Error(kNotFound) with error_text() when none was found.
  const SourceCandidate& chosen() const;
  /// "the target" or "the draft (mtp)".
  std::string module_text() const;
  /// "Cannot find any safetensors model weights for the draft (mtp): model_weights: not set;
  /// model /models/glm-snapshot: no *.safetensors files; WEIGHTSTREAM_MODEL_URI: not set".
  std::string error_text() const;
};

/// How resolution tells which shards of a source hold a module's tensors.
enum class SourceProbe {
  /// From the index when the source has one, reading no shard header (a draft-only load
  /// then opens only the draft's shards); from the headers otherwise.
  kIndex,
  /// From the shard headers: the source's checkpoint is opened once and kept in
  /// SourceCandidate::checkpoint, for a caller that opens every shard of it anyway (an
  /// engine's loader that streams it), so that its index and headers are read once.
  kHeaders,
};

/// Resolves one module's source: model_weights, then model, then options.model_uri. A
/// source is chosen when it holds at least one safetensors file (per its index when there
/// is one and `probe` is kIndex) with at least one tensor that `layout` wants. A source that
/// `earlier` resolutions (the model's other modules) already opened is not opened again.
/// Never throws for a source that cannot be opened: the failure becomes that candidate's
/// reason ("cannot open: <error>").
SourceResolution resolve_source(const ModelSource& source, ModuleRole role, const ModelLayout& layout,
                                const Options& options, std::string method = {},
                                const std::vector<SourceResolution>& earlier = {},
                                SourceProbe probe = SourceProbe::kIndex);

/// Throws one Error(kNotFound) that joins the error_text() of every resolution not found
/// (so a target and a draft that both fail are reported together); returns when all were found.
void expect_resolved(const std::vector<SourceResolution>& resolutions);

/// A model's config.json and where it was read.
struct ModelConfigSource {
  ModelConfig config;
  std::string uri;    ///< the source it came from
  std::string field;  ///< "model", "model_weights" or the checkpoint URI's label (checkpoint_uri_field)
};

/// Reads config.json from the first of model, model_weights and options.model_uri that has
/// one (a directory of config and tokenizer files is enough). Throws Error(kNotFound)
/// naming every place looked at and why none served.
ModelConfigSource find_model_config(const ModelSource& source, const Options& options);

/// The layout of one module of `config`: the target without MTP layers, or the draft's MTP
/// layers only (DeepSeek-V3: model.layers.{num_hidden_layers + i}.*, with enorm, hnorm,
/// eh_proj and shared_head; Qwen3-Next: mtp.fc, mtp.pre_fc_norm_embedding,
/// mtp.pre_fc_norm_hidden, mtp.layers.{i}.* and mtp.norm). `options.modules` is set from
/// `role`. Throws Error(kModel) for a draft of a config that declares no MTP layers. Storage
/// is not allocated: call allocate() or bind().
ModelLayout build_module_layout(const ModelConfig& config, ModuleRole role, LayoutOptions options = {});

/// Makes the draft's per-layer embedding and head (model.layers.{L}.embed_tokens.weight and
/// model.layers.{L}.shared_head.head.weight) references to the target's embedding and
/// lm_head storage, as engines do when the checkpoint's copies are identical: the draft
/// then never reads those tensors. A Qwen3-Next draft has no copies (it uses the target's
/// model.embed_tokens and lm_head): nothing to share. Call after the target's storage exists
/// and before the draft's allocate() (so no copy is allocated) and first load. Returns the
/// names shared. Throws Error(kModel) when shapes or dtypes differ or the target lacks the
/// parameter.
std::vector<std::string> share_target_embeddings(ModelLayout& draft, const ModelLayout& target);

/// One module handed to a load: its role, its layout (storage already allocated or bound:
/// a load never re-creates it and addresses never change), and where it resolved.
struct ModuleLoadRequest {
  ModuleRole role = ModuleRole::kTarget;
  ModelLayout* layout = nullptr;
  SourceResolution resolution;
};

/// What a strategy is asked to load: one or more modules from one source, in one stream.
struct LoadContext {
  std::string uri;  ///< the source every module resolved to
  std::vector<ModuleLoadRequest*> modules;
  LoadMode mode = LoadMode::kCold;
  Options options;
  ProgressCallback progress;
  /// Read only the shards that hold wanted tensors (per the index). Set when the load holds
  /// no target, so that a draft-only load never opens the target's shards.
  bool only_wanted_shards = false;
  /// `uri`'s checkpoint as resolution opened it (SourceCandidate::checkpoint), or null: the
  /// load then reads no shard header again, and uses its storage as opened.
  std::shared_ptr<const Checkpoint> checkpoint;
};

/// The outcome of one module's load.
struct ModuleLoad {
  ModuleRole role = ModuleRole::kTarget;
  std::string source;     ///< URI loaded from
  std::string field;      ///< the candidate it came from ("model_weights", ...)
  std::string strategy;   ///< the strategy that loaded it
  uint64_t tensors = 0;   ///< checkpoint tensors read for this module
  uint64_t bytes_read = 0;   ///< bytes read for this module's tensors
  uint64_t shards_read = 0;  ///< distinct shards holding them
  /// Shards whose headers this load read: 0 when it took the checkpoint resolution opened.
  uint64_t shards_opened = 0;
  LoadCounters counters;
};

/// The outcome of a strategy's load: its modules and the one stream that fed them.
struct StrategyLoad {
  std::string strategy;
  std::vector<ModuleLoad> modules;
  StreamStats stream;
};

/// Whether a strategy can serve a context, and if not, why.
struct StrategyAvailability {
  bool available = false;
  std::string reason;  ///< when not available, e.g. "s3://bucket/model is not a local path"
};

/// One way of loading weights: local files, object storage, and later a live peer that
/// already holds them. Strategies form a StrategyChain tried in order.
class LoadStrategy {
 public:
  virtual ~LoadStrategy() = default;
  /// Name in messages and reports: "local files", "object storage".
  virtual std::string name() const = 0;
  /// Whether it can serve `context` (cheap: no reads of weights).
  virtual StrategyAvailability available(const LoadContext& context) const = 0;
  /// Loads every module of `context`. A strategy checks everything it can before it writes
  /// a byte (plan, shapes, missing layers), so a failure leaves the parameters untouched;
  /// a failure after the first write throws an Error naming the parameters written.
  virtual StrategyLoad load(LoadContext& context) = 0;
};

/// Reads from local files (paths and file:// URIs).
std::unique_ptr<LoadStrategy> make_local_files_strategy();
/// Reads from S3-compatible object storage (s3://) and HTTP(S).
std::unique_ptr<LoadStrategy> make_object_storage_strategy();

/// Strategies tried in order: the first available one that succeeds loads the context.
class StrategyChain {
 public:
  /// Local files, then object storage.
  static StrategyChain standard();
  /// Appends a strategy (a live peer goes before the storage strategies: use insert_front).
  void add(std::unique_ptr<LoadStrategy> strategy);
  /// Puts a strategy first.
  void insert_front(std::unique_ptr<LoadStrategy> strategy);
  const std::vector<std::unique_ptr<LoadStrategy>>& strategies() const noexcept { return strategies_; }
  /// Tries each strategy in order. When none succeeds, throws one Error that names every
  /// module's sources with their reasons and every strategy with why it was unavailable
  /// or how it failed (never only the last cause).
  StrategyLoad load(LoadContext& context) const;

 private:
  std::vector<std::unique_ptr<LoadStrategy>> strategies_;
};

/// Loads each module from its resolved source: modules that resolved to the same source
/// share one stream (each tensor read once and routed to the module that wants it), and a
/// load without the target reads only the shards holding the draft's tensors. Every
/// resolution must be found (expect_resolved). In a cold load a layer missing from the
/// checkpoint is an error naming it, raised before any byte is written; reload and update
/// allow it (those layers keep their values).
std::vector<StrategyLoad> load_modules(std::vector<ModuleLoadRequest>& modules, LoadMode mode, const Options& options,
                                       const StrategyChain& chain = StrategyChain::standard(),
                                       const ProgressCallback& progress = {});

}  // namespace weightstream
