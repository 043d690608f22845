#pragma once
/// @file model.hpp
/// The model layer: an engine's parameters (`Parameter`, grouped by layer in a
/// `ModelLayout`), the `LoadSession` that applies named tensors to them (cold load, reload,
/// update), per-layer processing, model hooks that run once per load, and the bit-exact
/// audit. The supported architectures and their mapping tables are in architectures.hpp;
/// synthetic checkpoints in synth.hpp. Uses only the format and device layers: a session
/// consumes named tensors, whatever produced them.

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "weightstream/architectures.hpp"
#include "weightstream/device.hpp"
#include "weightstream/format.hpp"
#include "weightstream/stats.hpp"

namespace weightstream {

/// Where this rank sits among tensor-parallel and expert-parallel ranks.
struct Parallelism {
  int64_t tp_size = 1;  ///< tensor-parallel ranks
  int64_t tp_rank = 0;  ///< this rank, in [0, tp_size)
  int64_t ep_size = 1;  ///< expert-parallel ranks; above 1, routed experts are divided whole among them
  int64_t ep_rank = 0;  ///< this rank, in [0, ep_size)
};

/// Per-layer processing a parameter gets once its layer is complete.
enum class Processing {
  kNone,
  /// Online FP8 (OCP E4M3, max 448) quantization with one float32 scale per parameter:
  /// the parameter holds E4M3 codes, its scale parameter amax / 448.
  kFp8PerTensor,
};

/// Where one checkpoint tensor's slice lands in a parameter. The slice is the rectangle
/// [row_begin, row_begin + rows) x [column_begin, column_begin + columns) of the tensor's
/// two-dimensional view, written compactly (row-major) from element `element_offset` on.
struct ParameterPart {
  std::string tensor;          ///< checkpoint tensor name
  std::string id;              ///< part id within the parameter ("q", "k", "v", "0", "1"); empty when whole
  std::vector<int64_t> shape;  ///< full checkpoint shape, as every rank sees it
  int64_t row_begin = 0;
  int64_t rows = 0;
  int64_t column_begin = 0;
  int64_t columns = 0;
  uint64_t element_offset = 0;  ///< first element of the parameter that the slice fills
  std::string rule;             ///< the mapping rule it came from, for messages ("q_proj -> qkv_proj[q], kv_heads")
  /// Rows of the tensor's 2-D view (shape[0], 1 for a scalar).
  int64_t tensor_rows() const noexcept;
  /// Columns of the tensor's 2-D view (product of shape[1:]).
  int64_t tensor_columns() const noexcept;
  /// True when the slice is one contiguous run of the tensor's bytes (all columns).
  bool contiguous() const noexcept { return column_begin == 0 && columns == tensor_columns(); }
  /// Elements in the slice.
  uint64_t elements() const noexcept { return static_cast<uint64_t>(rows) * static_cast<uint64_t>(columns); }
};

/// Which module of a checkpoint a layer belongs to.
enum class LayerKind { kGlobal, kDecoder, kMtp };

/// One parameter of an engine: its kernel-format dtype and shape on this rank, its
/// layer, the checkpoint tensors that fill it, and its storage.
struct Parameter {
  std::string name;
  Dtype dtype = Dtype::kBF16;  ///< as stored (kernel format)
  std::vector<int64_t> shape;  ///< on this rank
  int64_t layer = -1;          ///< layer index; -1 for global parameters
  /// The tensors that fill it; empty for a derived parameter (a scale written by
  /// processing, a tied lm_head written by a hook), which completeness checks skip.
  std::vector<ParameterPart> parts;
  Processing processing = Processing::kNone;
  /// The dtype parts are written in before processing (checkpoint format); equal to
  /// `dtype` when the parameter is not processed.
  Dtype load_dtype = Dtype::kBF16;
  std::string scale;  ///< name of the scale parameter that processing writes, or empty
  /// For an FP8 block-scaled weight (held as the checkpoint ships it): the parameter holding
  /// its F32 block scales (X.weight_scale_inv, one part per part of this one, in the same
  /// order) and the [rows, columns] of a block. A BF16, F16 or F32 piece written into it is
  /// quantized block by block as such checkpoints are: scale = amax / 448, code =
  /// E4M3(value / scale), the scales landing in their parameter.
  std::string block_scale;
  std::array<int64_t, 2> scale_block{0, 0};
  /// Storage (host or device), set by ModelLayout::allocate or ModelLayout::bind; never
  /// moves after the first load.
  std::byte* data = nullptr;
  Device device;
  /// Byte ranges [first, second) of the storage that no part fills (vocabulary padding);
  /// zeroed at the start of every cold load.
  std::vector<std::pair<uint64_t, uint64_t>> padding;

  /// Elements on this rank.
  uint64_t elements() const noexcept;
  /// Bytes on this rank, in `dtype`.
  uint64_t bytes() const noexcept;
};

/// A buffer derived from parameters by a model hook (a fused K/V buffer), for the audit.
struct DerivedBuffer {
  std::string name;
  const std::byte* data = nullptr;
  Device device;
  uint64_t bytes = 0;
};

/// How long the bytes of a TensorView handed to LoadSession::load() stay valid and unchanged.
enum class SourceLifetime {
  kCall,    ///< until load() returns (the default); the session waits for its copies first
  kSettle,  ///< until the next settle() or finish() returns: copies are only issued, so the
            ///< caller's next batch overlaps them
  kLoad,    ///< until finish() returns: a piece held back for its layer is kept by reference
  kKeepalive,  ///< while `keepalive` lives, changed by no one (bytes lent by a Storage), and
               ///< holding it takes nothing a load waits for: a piece held back for its layer
               ///< keeps the keepalive instead of a copy
};

/// The elements of a tensor that changed since the version a layout holds (a delta update):
/// their indices in the tensor's row-major order, strictly ascending, and their new values in
/// the tensor's dtype (`indices.size()` elements, packed), on the host.
struct ChangedElements {
  std::vector<uint64_t> indices;
  std::vector<std::byte> values;
};

/// A named tensor, or one piece of it, handed to a session. The bytes may be on the host
/// or on a device.
struct TensorView {
  std::string_view name;
  Dtype dtype = Dtype::kBF16;
  std::span<const int64_t> shape;
  const std::byte* data = nullptr;
  Device device;
  uint64_t offset = 0;  ///< where `data` starts within the tensor's bytes
  uint64_t bytes = 0;   ///< bytes at `data` (packed: of the tensor, from the first run to the last)
  /// A packed column window (a stream's TensorPiece::packed): when nonzero, `data` holds runs
  /// of `packed_run` bytes that lie `packed_stride` bytes apart in the tensor from `offset`
  /// (the part's columns of each of its rows, packed_stride one row), back to back, and
  /// `bytes` counts the tensor's bytes from the first run's start to the last run's end.
  uint64_t packed_run = 0;
  uint64_t packed_stride = 0;
  SourceLifetime lifetime = SourceLifetime::kCall;
  /// When set, keeps `data` valid while it lives (a staging buffer's lease): the session
  /// keeps it until its copies of these bytes have landed and returns without waiting.
  std::shared_ptr<const void> keepalive;
  /// Set: the view delivers the whole tensor (offset 0, `bytes` its size, `data` unused) as
  /// these changed elements over the values its parameters hold; every other element keeps
  /// its value. Checkpoint format only, into parameters that hold the tensor's dtype as it is
  /// (no conversion, no processing) on the host.
  std::shared_ptr<const ChangedElements> changes;
};

class ModelLayout;

/// A model-level hook, registered by the engine on a layout: runs exactly once at the end
/// of every LoadSession::finish(), after all per-layer processing, never during load().
/// Derived buffers it owns are allocated in attach() and refilled in place by run().
class ModelHook {
 public:
  virtual ~ModelHook() = default;
  /// Name used in messages and counters.
  virtual std::string name() const = 0;
  /// False when running twice would leave stale or wrong derived state: a reload or update
  /// of the layout then fails at LoadSession::begin(), before any weight is touched.
  virtual bool rerunnable() const { return true; }
  /// Called once when added to `layout`: checks the parameters it needs and allocates
  /// derived buffers on the layout's device. Throws Error(kModel).
  virtual void attach(ModelLayout& layout) {}
  /// Derives state from the loaded parameters, in place.
  virtual void run(ModelLayout& layout) = 0;
  /// The buffers it owns, for the audit (addresses must be stable).
  virtual std::vector<DerivedBuffer> derived_buffers() const { return {}; }
};

/// A hook that copies the embedding into a tied lm_head parameter (both vocab-sharded
/// alike), for models with tie_word_embeddings.
std::unique_ptr<ModelHook> make_tied_lm_head_hook(std::string embedding = "model.embed_tokens.weight",
                                                  std::string lm_head = "lm_head.weight");

/// A hook that gathers every layer's K and V rows (the parts `part_ids` of the parameter
/// named by `qkv_pattern`, with {layer}) into one buffer laid out [layer][parts in order],
/// the kind of fused buffer an engine keeps for a kernel. For MLA, pass the latent part
/// ("model.layers.{layer}.self_attn.fused_qkv_a_proj.weight", {"kv_a"}). Throws
/// Error(kModel) at attach when no layer has such parts.
std::unique_ptr<ModelHook> make_fused_kv_hook(std::string qkv_pattern = "model.layers.{layer}.self_attn.qkv_proj.weight",
                                              std::vector<std::string> part_ids = {"k", "v"});

/// A hook from a function.
std::unique_ptr<ModelHook> make_model_hook(std::string name, std::function<void(ModelLayout&)> run,
                                           bool rerunnable = true);

/// Where a checkpoint tensor goes in a layout.
struct TensorRoute {
  enum class Kind {
    kParameter,  ///< fills `targets`
    kIgnored,    ///< named by an ignore rule
    kSkipped,    ///< belongs to another rank (an expert) or another module; never read
    kUnmatched,  ///< no parameter and no ignore rule: an error
  };
  Kind kind = Kind::kUnmatched;
  /// (parameter index, part index) pairs that the tensor fills.
  std::vector<std::pair<size_t, size_t>> targets;
  std::string reason;  ///< for kIgnored and kSkipped: the rule or owner
};

/// The parameters of a model on one rank, grouped by layer, with their storage and hooks.
/// Built from a config by build_model_layout, or parameter by parameter for any model.
/// Move-only: it owns the storage it allocates.
class ModelLayout {
 public:
  ModelLayout();
  ~ModelLayout();
  ModelLayout(ModelLayout&&) noexcept;
  ModelLayout& operator=(ModelLayout&&) noexcept;
  ModelLayout(const ModelLayout&) = delete;
  ModelLayout& operator=(const ModelLayout&) = delete;

  /// A description for messages, e.g. "llama tp 2 rank 1".
  const std::string& description() const noexcept { return description_; }
  void set_description(std::string text) { description_ = std::move(text); }

  /// Adds a parameter. Throws Error(kModel) on a duplicate name, an empty name, or a part
  /// whose slice does not fit its tensor or its parameter.
  size_t add_parameter(Parameter parameter);
  /// Declares what kind of layer `layer` is (decoder by default).
  void set_layer_kind(int64_t layer, LayerKind kind);
  /// What kind of layer `layer` is; kGlobal for -1.
  LayerKind layer_kind(int64_t layer) const noexcept;
  /// Adds an ignore rule (glob with '*').
  void add_ignore_rule(std::string pattern);
  /// Declares a checkpoint tensor that this layout never reads (`reason` names the owner).
  void add_skipped_tensor(std::string name, std::string reason);

  /// The parameters, in the order added.
  const std::vector<Parameter>& parameters() const noexcept { return parameters_; }
  /// Index of a parameter by name, or nullopt.
  std::optional<size_t> find(std::string_view name) const;
  /// A parameter by name. Throws Error(kNotFound) naming it.
  const Parameter& parameter(std::string_view name) const;
  /// Indices of the parameters of `layer`, in order.
  std::vector<size_t> layer_parameters(int64_t layer) const;
  /// Layer indices present, ascending (-1 first when there are global parameters).
  std::vector<int64_t> layers() const;
  /// Where a checkpoint tensor goes.
  TensorRoute route(std::string_view tensor) const;
  /// Every checkpoint tensor name that some part wants.
  std::vector<std::string> wanted_tensors() const;

  /// What a new arena holds before a load writes it.
  enum class ArenaContents {
    kZeroed,     ///< zeros: a parameter a load leaves unwritten reads as zero
    kUnwritten,  ///< whatever the device had (skips zeroing a GPU arena, which a timed load
                 ///< would pay for): only for a load that writes every parameter whole or throws
  };
  /// Allocates storage for every parameter that has none (not bound, not yet allocated) on
  /// `device`: one arena, each parameter at a 256-byte boundary, zeroed unless `contents`
  /// says otherwise (host memory always comes zeroed). The addresses never change
  /// afterwards. Throws Error(kDevice) when storage already lives on another device (a
  /// bind, an earlier allocate or set_device), or when the allocation fails.
  void allocate(const Device& device, ArenaContents contents = ArenaContents::kZeroed);
  /// What a new arena must hold for a cold load into it: kUnwritten where every parameter
  /// without storage has parts (a cold load writes each part whole, zeroes the padding
  /// between them, or throws naming what is missing), else kZeroed (a parameter no part
  /// fills must read as zero).
  ArenaContents cold_load_contents() const;
  /// Declares the device the layout's storage lives on before any exists: binds must then
  /// be on it, and allocate() must use it. Throws Error(kDevice) when storage already lives
  /// on another device.
  void set_device(const Device& device);
  /// Binds engine-owned memory (an engine's own parameter tensor) to parameter `name`:
  /// loads, reloads and updates write into it in place; the layout never frees, moves or
  /// reallocates it, and the caller keeps it alive as long as the layout. Checked before
  /// anything changes; each check throws Error(kModel) naming the parameter, what was
  /// expected and what was given: dtype, shape, size (`tensor.bytes` equal to
  /// Parameter::bytes(), `tensor.offset` 0), device (the layout's, once set_device,
  /// allocate or an earlier bind fixed it), alignment (the address a multiple of the dtype's
  /// element size), no overlap with memory bound to another parameter, and the parameter
  /// not yet bound or allocated and the layout never loaded (storage never moves).
  /// `tensor.name` is ignored. A TensorView is contiguous row-major by construction.
  /// Throws Error(kNotFound) when the layout has no such parameter.
  void bind(std::string_view name, const TensorView& tensor);
  /// Binds each tensor to the parameter named by its `name`, as bind(name, tensor) does;
  /// every tensor is checked (and two naming one parameter refused) before any is bound.
  void bind(std::span<const TensorView> tensors);
  /// Names of the parameters bound to engine memory by bind(), in layout order.
  std::vector<std::string> bound_names() const;
  /// Names of the other parameters, in layout order: those whose storage the layout
  /// allocates (or has allocated), and those sharing another layout's (share_storage).
  std::vector<std::string> unbound_names() const;
  /// True when parameter `index` is bound to engine memory.
  bool bound(size_t index) const noexcept { return index < bound_.size() && bound_[index]; }
  /// Makes parameter `name` a reference to `owner`'s storage (a draft's embedding or head
  /// that is the target's, bound by reference): its checkpoint tensors become skipped with
  /// `reason`, loads no longer fill it or check it for completeness, and its data points
  /// at owner.data (the owner's layout must outlive this one). Throws Error(kModel) when
  /// dtype or shape differ, the owner has no storage, or this layout has been loaded.
  void share_storage(std::string_view name, const Parameter& owner, const std::string& reason);
  /// Removes parameter `name` from the layout: the engine fills it by other means (an
  /// engine's own loader), so the layout never allocates, fills or checks it. Its checkpoint
  /// tensors that fill no other parameter become skipped with `reason`. Only before any
  /// storage is bound or allocated, a hook added or a load run (indices stay stable after).
  /// Throws Error(kNotFound) when there is no such parameter, Error(kModel) when too late.
  void remove_parameter(std::string_view name, const std::string& reason);
  /// Holds parameter `name` in `dtype`, a float dtype other than the one the mapping rules
  /// gave it (an engine that keeps a BF16 checkpoint's MoE router in F32): its parts are
  /// converted as they are written, as for a rule that names its own dtype. Only a float
  /// parameter that is neither processed nor FP8 block-scaled (nor a block scale), before
  /// any storage is bound or allocated, a hook added or a load run. Throws Error(kNotFound)
  /// when there is no such parameter, Error(kModel) for any other case.
  void hold_as(std::string_view name, Dtype dtype);
  /// The device the layout's storage lives on: set by set_device, allocate or the first
  /// bind (CPU before any of them).
  const Device& device() const noexcept { return device_; }
  /// Bytes of storage this layout and its hooks own.
  uint64_t allocated_bytes() const noexcept;

  /// Registers a model hook; calls its attach(). Hooks run in registration order.
  void add_hook(std::unique_ptr<ModelHook> hook);
  const std::vector<std::unique_ptr<ModelHook>>& hooks() const noexcept { return hooks_; }

  /// Loads finished on this layout so far (cold, reload and update).
  uint64_t loads_finished() const noexcept { return loads_finished_; }
  /// Model hook runs so far, all hooks together.
  uint64_t model_hook_runs() const noexcept { return model_hook_runs_; }

  /// A mutable parameter, for hooks and processing (its storage must not be replaced).
  Parameter& mutable_parameter(size_t index) { return parameters_[index]; }
  /// Allocates a buffer on the layout's device owned by the layout (for hooks' derived
  /// state), zeroed; it lives as long as the layout.
  std::byte* allocate_derived(uint64_t bytes);

 private:
  friend class LoadSession;
  /// Throws Error(kModel), `what` (what cannot be done, to which parameter) and why, once
  /// storage was bound or allocated, a hook added or a load run.
  void expect_untouched(const std::string& what) const;
  /// Declares `parameters` again, in their order, in place of the layout's own.
  void redeclare(std::vector<Parameter> parameters);
  std::string description_;
  struct NameIndex;  // parameter index by name (hashed, string_view lookups)
  std::vector<Parameter> parameters_;
  std::unique_ptr<NameIndex> by_name_;
  std::multimap<std::string, std::pair<size_t, size_t>, std::less<>> by_tensor_;
  std::map<std::string, std::string, std::less<>> skipped_;
  std::vector<std::string> ignore_rules_;
  std::map<int64_t, LayerKind> layer_kinds_;
  std::vector<Buffer> storage_;
  std::vector<std::unique_ptr<ModelHook>> hooks_;
  std::vector<bool> bound_;  ///< per parameter: storage bound by bind() (engine memory)
  Device device_;
  bool device_fixed_ = false;  ///< device_ set by set_device, allocate or a bind
  uint64_t loads_finished_ = 0;
  uint64_t model_hook_runs_ = 0;
};

/// Which module of a checkpoint a layout covers. The target holds layers 0 to
/// num_hidden_layers - 1 only, as vLLM's target models do; the MTP layers are the draft's,
/// a layout of its own ("all" in the CLI and Python is the two layouts, two modules).
enum class LayoutModules {
  kTarget,  ///< without MTP layers (their tensors are skipped and never read)
  kDraft,   ///< only the MTP layers (the target's tensors are skipped)
};

/// Options of build_model_layout.
struct LayoutOptions {
  Parallelism parallel;
  /// Parameter dtype; default: the config's torch_dtype (bfloat16 when absent).
  std::optional<Dtype> dtype;
  /// Per-layer processing of linear weights.
  Processing quantize = Processing::kNone;
  LayoutModules modules = LayoutModules::kTarget;
  /// The most checkpoint tensors the config may map (an upper bound counted from its layers,
  /// experts and rules before anything is built); 0: kMaxLayoutTensors. Set it from the
  /// checkpoint a layout is built for, so an absurd config.json fails in bounded memory.
  uint64_t max_tensors = 0;
};

/// More checkpoint tensors than any model weightstream accepts maps (DeepSeek-V3 has about
/// 92,000; a config asking for more is refused before a layout is built).
constexpr uint64_t kMaxLayoutTensors = uint64_t{1} << 22;

/// A bound on the tensors a layout may map for a checkpoint of `tensors` tensors: rules that
/// fuse or replicate read a tensor more than once, and the bound counts every layer's rules
/// of every kind, so it is generous.
constexpr uint64_t layout_tensor_bound(uint64_t tensors) { return 4 * tensors + 1024; }

/// Builds the layout of a config of a supported architecture (architectures()) for one rank
/// from its mapping table: fused qkv_proj and gate_up_proj (fused_qkv_a_proj for MLA),
/// stacked experts w13/w2 of this rank, vocabulary padding, K/V head replication.
/// For an FP8 block-quantized checkpoint (fp8_block_quantized) each quantized linear
/// weight is held as vLLM's Fp8LinearMethod holds it: X.weight F8_E4M3 (this rank's rows or
/// columns) and X.weight_scale_inv F32 (this rank's scale blocks; fused parameters
/// concatenate their parts' block-rows in part order, experts stack them as
/// w13_weight_scale_inv / w2_weight_scale_inv); a split that does not fall on a block
/// boundary is refused, naming the parameter, the part and the block size. Embeddings,
/// norms, routers, lm_head and modules_to_not_convert stay unquantized.
/// Qwen3-Next's MTP layers keep their checkpoint names (mtp.layers.{i}.*, parameters fused
/// as in decoder layers). Throws Error(kModel) naming the model_type, the rule and the
/// dimension that does not divide among the ranks; for qwen3_next with tp_size above 1
/// while Gated DeltaNet layers are in the layout.
ModelLayout build_model_layout(const ModelConfig& config, const LayoutOptions& options = {});

/// Decoder layers that `tensor_names` hold for `config`'s architecture: the distinct
/// {layer} indices of names that start like one of its mapping rules' {layer} patterns
/// (model.layers.{layer}.*); MTP layers count too.
/// Throws Error(kModel) naming the model_type when it is not supported.
int64_t checkpoint_layer_count(const ModelConfig& config, std::span<const std::string_view> tensor_names);

/// Checks, before a layout is built, that a checkpoint holding `tensor_names` has at least
/// the config's num_hidden_layers layers, as a cold load needs every one of them.
/// build_model_layout's memory grows with the layer count (65536 layers take gigabytes),
/// and config.json is untrusted: a config asking for more layers than the checkpoint has
/// is refused here, in bounded memory. A checkpoint that holds the layers but lacks some
/// of their tensors passes; plan_layout_load and the session name what is missing.
/// `config_object` names the config in messages. Throws Error(kModel), e.g.
/// "m/config.json: num_hidden_layers = 65536, but the checkpoint holds 1 layer (tensors
/// model.layers.{layer}.*): a cold load needs all 65536".
void check_checkpoint_layers(const ModelConfig& config, std::string_view config_object,
                             std::span<const std::string_view> tensor_names);

/// Kinds of load a session runs.
enum class LoadMode {
  kCold,    ///< first load: every parameter must be filled by finish()
  kReload,  ///< a new checkpoint over loaded storage: layers left out keep their values
  kUpdate,  ///< a partial update (pushed buckets): layers left out keep their values
};

/// "cold", "reload", "update".
std::string_view load_mode_name(LoadMode mode) noexcept;

/// What names a batch uses.
enum class TensorFormat {
  kCheckpoint,  ///< checkpoint tensors: mapped, sharded, converted and processed
  kEngine,      ///< parameter names and kernel-format bytes, copied in place as they are
};

/// When a session writes the parts of a layer.
enum class LayerCommit {
  /// Each part as it arrives, and sources may read straight into the parameters
  /// (direct_destination): the fastest, and the default of a cold load, where nothing is live
  /// yet. What it still allows on a reload or update: a load that fails midway (a truncated
  /// or unreadable shard, a sender that dies) leaves the layers it was writing with a mix of
  /// old and new values, and a parameter it was reading into half-written. Bytes pulled from
  /// peers are checked against their digests before the session sees them in every mode, so
  /// a corrupted peer's bytes never land in a live parameter.
  kAsArrived,
  /// A layer only once every one of its tensors has arrived: pieces of an unfinished layer
  /// are held (copied, or referenced when their lifetime is kLoad), and a load that fails
  /// midway leaves every unfinished layer with its old values (layers completed before the
  /// failure hold the new ones). The default of a reload or update.
  kWholeLayer,
};

/// The commit of a load whose caller names none: kAsArrived for a cold load (nothing is
/// live, and a failed cold load is discarded whole), kWholeLayer for a reload or update,
/// whose parameters serve while they are overwritten.
LayerCommit default_layer_commit(LoadMode mode) noexcept;

/// Counters of one load (reset by begin()).
struct LoadCounters {
  uint64_t tensors_applied = 0;    ///< tensors whose every needed byte was written
  uint64_t bytes_applied = 0;      ///< tensor bytes written into parameters or staging
  uint64_t tensors_skipped = 0;    ///< ignored or other ranks' tensors handed in
  uint64_t parameters_completed = 0;
  uint64_t layer_processing_runs = 0;  ///< layers processed (quantized)
  uint64_t model_hook_runs = 0;
  uint64_t held_bytes_copied = 0;  ///< bytes held back for their layer (whole-layer commits) and
                                   ///< copied, since their source could change before the layer is whole
  uint64_t held_bytes_on_device = 0;  ///< of those, bytes from the host held in the GPU's memory
                                      ///< (the rest in host memory)
};

/// The counters of `counters` by name, as the fields above are named.
std::vector<StatField> stat_fields(const LoadCounters& counters);

/// One load of a layout: begin(mode), load(batch) any number of times, finish(). Parts of
/// one parameter may arrive in any order, in any batches; each is written as it arrives.
/// Thread-safe: load() may be called from several threads.
class LoadSession {
 public:
  explicit LoadSession(ModelLayout& layout);
  ~LoadSession();
  LoadSession(const LoadSession&) = delete;
  LoadSession& operator=(const LoadSession&) = delete;

  /// Starts a load. `commit` defaults to default_layer_commit(mode): whole layers for a
  /// reload or update, as they arrive for a cold load. Throws Error(kModel), before touching
  /// any weight, when the layout has a parameter without storage, a reload or update comes
  /// before any load, or the layout has loaded before and a hook cannot run twice. A cold
  /// load zeroes padding.
  void begin(LoadMode mode, TensorFormat format = TensorFormat::kCheckpoint,
             std::optional<LayerCommit> commit = std::nullopt);
  /// Applies a batch. Every tensor is checked (known name, dtype, shape, bounds, not
  /// delivered twice) before any byte of the batch is written; errors name the tensor, the
  /// parameter, the part, the layer and the rule. A layer whose last part has landed is
  /// processed (cold and reload). Copies onto a GPU are asynchronous: the call waits for
  /// them only for views of lifetime kCall without a keepalive. Once a batch has failed,
  /// later load() and finish() calls of this load throw, naming the first error; begin()
  /// abandons such a load and starts a new one.
  void load(std::span<const TensorView> batch);
  void load(const TensorView& tensor) { load(std::span<const TensorView>(&tensor, 1)); }
  /// Checks a batch as load() would, writing and counting nothing; throws load()'s errors
  /// (without failing the load). A source that lands a batch's bytes in the parameters
  /// (direct_destination) checks it first, so that a bad batch fails before its first byte.
  void check(std::span<const TensorView> batch) const;
  /// Where bytes [offset, offset + bytes) of checkpoint tensor `tensor` belong, when a
  /// source may read them straight into parameter storage (host storage, or GPU storage
  /// too when the source writes GPU memory itself, `gpu_source`: a CUDA-aware UCX; a tensor
  /// that fills one part of one unprocessed parameter, in its dtype, whole rows; commit
  /// kAsArrived); nullptr otherwise. The source still hands the piece to load(), with
  /// `data` pointing there (and the layout's device): it is checked and counted, and not copied.
  std::byte* direct_destination(std::string_view tensor, Dtype dtype, std::span<const int64_t> shape,
                                uint64_t offset, uint64_t bytes, bool gpu_source = false) const;
  /// Waits until every copy issued so far has landed (finish() does too, before model
  /// hooks run). Throws Error(kDevice).
  void settle();
  /// Ends the load: pieces still held are written, completeness is checked (cold: every
  /// parameter, naming every missing one by layer), processing of layers still pending
  /// runs, then each model hook exactly once.
  void finish();

  /// The layout the session writes into.
  const ModelLayout& layout() const noexcept { return layout_; }
  /// The mode of the current or last load.
  LoadMode mode() const noexcept { return mode_; }
  /// The commit of the current or last load.
  LayerCommit commit() const noexcept { return commit_; }
  /// Counters of the current or last load.
  LoadCounters counters() const;
  /// Layers whose every part arrived in this load, ascending.
  std::vector<int64_t> completed_layers() const;
  /// Layers of which this load has written (or holds, LayerCommit::kWholeLayer) any byte,
  /// complete or not, ascending.
  std::vector<int64_t> touched_layers() const;

 private:
  struct State;
  ModelLayout& layout_;
  LoadMode mode_ = LoadMode::kCold;
  LayerCommit commit_ = LayerCommit::kAsArrived;
  std::unique_ptr<State> state_;
};

/// "layer 3", "MTP layer 61", "global".
std::string layer_label(const ModelLayout& layout, int64_t layer);

/// Result of comparing two layouts' parameters and derived buffers bit for bit.
struct LayoutComparison {
  uint64_t compared = 0;    ///< parameters and derived buffers compared
  uint64_t mismatched = 0;  ///< those whose bytes differ, or that one side lacks
  std::vector<std::string> mismatches;  ///< names of the first mismatches (at most 20)
};

/// Compares every parameter and derived buffer of `a` with the same-named one of `b`.
LayoutComparison compare_layouts(const ModelLayout& a, const ModelLayout& b);

/// Addresses of every parameter and derived buffer, by name (for the audit).
std::map<std::string, const std::byte*> storage_addresses(const ModelLayout& layout);

/// Host copy of a parameter's bytes (kernel format).
std::vector<std::byte> parameter_bytes(const Parameter& parameter);

/// FP8 E4M3 (OCP "E4M3FN": no infinities, max 448) of a float, rounded to nearest even,
/// saturating at +-448.
uint8_t float_to_e4m3(float value) noexcept;
/// The float value of an E4M3 code.
float e4m3_to_float(uint8_t code) noexcept;
/// Quantizes a [rows x columns] tensor of BF16, F16 or F32 `values` (host) into FP8 block-scaled
/// form, block by block of `block` [rows, columns], by the rule FP8 block-scaled checkpoints are
/// made with and LoadSession quantizes with (scale = amax / 448, code = E4M3(value / scale)):
/// `codes` [rows x columns] E4M3, `scales` [ceil(rows / block rows) x ceil(columns / block
/// columns)] F32, both compact. Throws Error(kModel) for another dtype, an empty block or spans
/// of other sizes.
void quantize_fp8_blocks(std::span<const std::byte> values, Dtype dtype, uint64_t rows, uint64_t columns,
                         std::array<int64_t, 2> block, std::span<std::byte> codes, std::span<float> scales);
/// Converts `elements` values between BF16, F16 and F32 on the host. Throws Error(kModel)
/// for any other pair of distinct dtypes.
void convert_elements(std::byte* destination, Dtype destination_dtype, const std::byte* source, Dtype source_dtype,
                      uint64_t elements);

}  // namespace weightstream
