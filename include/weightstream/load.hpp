#pragma once
/// @file load.hpp
/// Loading a checkpoint into a ModelLayout: the plan of which byte ranges each rank reads
/// (a contiguous row slice is read as its own range, a column slice as a run of each of its
/// rows, sections as a range each; only a tensor whose parts share rows is read whole), and
/// the one path that streams those ranges into a LoadSession,
/// which writes them through its device path. The plain "every tensor into memory" load is
/// the same path with the identity layout (one parameter per checkpoint tensor).

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <span>
#include <string>
#include <vector>

#include "weightstream/model.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {

/// Bytes of one checkpoint tensor that a layout reads, and where they go: the rows of a part
/// (one range), a column window of a part's rows (one run per row), or the whole tensor.
struct PlannedTensor {
  size_t tensor = 0;   ///< index into Checkpoint::tensors()
  ByteRange range;     ///< bytes of the tensor read (length never 0); with runs > 1, the first run
  bool slice = false;  ///< true when this rank reads less than the whole tensor
  std::vector<std::pair<size_t, size_t>> targets;  ///< (parameter, part) indices it fills
  uint64_t runs = 1;    ///< runs of range.length bytes (a part's columns of each of its rows)
  uint64_t stride = 0;  ///< bytes from one run's start to the next (a row's bytes); with runs > 1
  /// The stream request for these bytes.
  TensorRequest request() const;
};

/// A checkpoint tensor the layout does not read, and why.
struct UnusedTensor {
  size_t tensor = 0;   ///< index into Checkpoint::tensors()
  std::string reason;  ///< the ignore rule, or the rank or module that owns it
};

/// What a layout reads from a checkpoint.
struct LoadPlan {
  std::vector<PlannedTensor> reads;     ///< in checkpoint file order (a sectioned tensor's sections in a row)
  std::vector<UnusedTensor> unused;   ///< ignored or owned elsewhere; never read
  std::vector<std::string> missing;   ///< tensors the layout wants that the checkpoint lacks
  uint64_t bytes_to_read = 0;         ///< the bytes of the reads' runs (storage may read small gaps with them)
  /// The stream requests, parallel to `reads`.
  std::vector<TensorRequest> requests() const;
  /// A plan of the reads at `indices` only (for loading in batches).
  LoadPlan subset(std::span<const size_t> indices) const;
};

/// Plans the reads of `layout` from `checkpoint`. Throws Error(kModel) naming every
/// checkpoint tensor that matches no parameter and no ignore rule (with its shard), and
/// every tensor whose shape cannot fill its parameter, before any byte is read.
LoadPlan plan_layout_load(const ModelLayout& layout, const Checkpoint& checkpoint);

/// Streams the plan's reads into `session` (which must have begun), piece by piece as the
/// reader pool completes them, by the source stream_tensors_for_device() picks for the
/// layout's device (pinned staging or mapped windows for a GPU; reads straight into
/// parameter storage on the host where the session allows). Returns the stream's
/// counters; throws the first error.
StreamStats stream_into_session(const Checkpoint& checkpoint, const LoadPlan& plan, LoadSession& session,
                                const StreamOptions& options, const ProgressCallback& progress = {});

/// Result of load_layout.
struct LayoutLoad {
  StreamStats stream;
  LoadCounters counters;
};

/// One whole load of `layout` from `checkpoint`: plan, begin(mode, commit), stream,
/// finish(). `commit` defaults to default_layer_commit(mode). The stream's seconds cover all of it.
LayoutLoad load_layout(ModelLayout& layout, const Checkpoint& checkpoint, LoadMode mode, const StreamOptions& options,
                       const ProgressCallback& progress = {}, std::optional<LayerCommit> commit = std::nullopt);

/// The identity layout of `checkpoint`: one parameter per tensor, named, typed and shaped
/// as the tensor (a tensor of a sub-byte dtype, F4 or F6, as U8 of its byte count), all
/// global (layer -1), no storage yet. What an engine binds when its parameters carry the
/// checkpoint's names, and what load_checkpoint() loads.
ModelLayout identity_layout(const Checkpoint& checkpoint);

/// What engine_layout builds: one rank's layout, its storage and its model hooks.
struct EngineLayoutOptions {
  /// The rank, dtype, quantization and modules; max_tensors is set from the source's tensors.
  LayoutOptions layout;
  /// Where storage is allocated and the hooks attach; without, the layout has neither (a
  /// plan needs no storage, and an engine binds its own tensors before allocating).
  std::optional<Device> device;
  /// Whether engine_hooks are registered (only with `device`: a hook allocates its derived
  /// buffers when it attaches). Off for an engine whose own model keeps that derived state
  /// (the vLLM and SGLang plugins): the hooks' buffers would be copies of its memory.
  bool hooks = true;
  /// The config of the model that holds these weights: its torch_dtype and
  /// quantization_config replace the source's (an F16 or BF16 checkpoint as loaded into a BF16
  /// or FP8 block-scaled model), while the layers and shapes stay the source's.
  std::optional<ModelConfig> held_as;
};

/// The model hooks an engine registers on `layout` of `config`, not yet attached: a tied
/// lm_head where the embeddings are tied (tie_word_embeddings, both parameters in the
/// layout), a fused K/V buffer where model.layers.{layer} have K and V parts of qkv_proj (or
/// MLA's latent kv_a part of fused_qkv_a_proj). ModelLayout::add_hook attaches each.
std::vector<std::unique_ptr<ModelHook>> engine_hooks(const ModelLayout& layout, const ModelConfig& config);

/// The layout every front end builds of a model for one rank (the command, the Python
/// package and the engine plugins alike): `config` checked against the tensors its source
/// holds (check_checkpoint_layers; `config_object` names it in messages), built
/// (build_model_layout, at most layout_tensor_bound of them), allocated on options.device
/// with engine_hooks registered. Empty `tensor_names`: a config given without its source (a
/// dict in Python), neither checked nor bounded beyond options.layout.max_tensors. Throws
/// what those throw.
ModelLayout engine_layout(ModelConfig config, std::string_view config_object,
                          std::span<const std::string_view> tensor_names, const EngineLayoutOptions& options);

/// engine_layout of `checkpoint`'s config.json and tensors. Throws Error(kNotFound) naming the
/// checkpoint when it has no config.json.
ModelLayout engine_layout(const Checkpoint& checkpoint, const EngineLayoutOptions& options);

/// `checkpoint`'s config.json, refused (Error(kModel) naming it and num_hidden_layers) when it
/// asks for more layers than the checkpoint's tensors hold (check_checkpoint_layers), before
/// any layout is built from it.
ModelConfig checkpoint_layout_config(const Checkpoint& checkpoint);

/// One tensor loaded into memory.
struct LoadedTensor {
  size_t tensor = 0;          ///< index into Checkpoint::tensors()
  std::byte* data = nullptr;  ///< host or device address, writable
  uint64_t bytes = 0;
  /// True when `data` points into a copy-on-write mapping of the tensor's shard (a host load
  /// at LocalIo::kAuto or kMmap), false when it lies in the arena.
  bool in_place = false;
};

/// The result of load_checkpoint.
struct LoadedCheckpoint {
  /// The identity layout of the tensors in the arena, which it owns; the tensors taken in
  /// place are skipped tensors of it.
  ModelLayout layout;
  std::vector<LoadedTensor> tensors;  ///< parallel to Checkpoint::tensors()
  /// Keeps the copy-on-write mappings that in-place tensors point into (null when there are
  /// none); they are unmapped with the last copy of it, so a holder of tensors past this
  /// result keeps a copy.
  std::shared_ptr<const void> mappings;
  StreamStats stats;  ///< the whole load, in place and arena: seconds from the start to the last byte landed
};

/// Loads every tensor of `checkpoint` onto `device`. Into one arena (the identity layout,
/// allocated there, loaded cold through a LoadSession), except for a host load at
/// options.local_io kAuto (the default) or kMmap: each local shard is then mapped once,
/// privately, its pages populated in chunk_bytes pieces on up to min(concurrency, cores)
/// threads, and every tensor of it whose offset is a multiple of its element size is handed
/// out in place, a copy-on-write view of the page cache: writing into it copies the pages
/// written, never reaches the file or another load. A shard rewritten in place (truncated or
/// overwritten) while such tensors live changes them or makes touching them raise SIGBUS. At
/// kAuto a shard on a file system that cannot map files goes to the arena; at kMmap that is
/// Error(kUnsupported). The other tensors (misaligned ones, those of object storage) load
/// into the arena as above, neighbours in a file read together (one ranged GET for up to
/// chunk_bytes of them from S3), so every byte is delivered once. Throws Error naming the
/// tensor, the source and the cause, and Error(kIo) naming the shard and both sizes when a
/// shard to be mapped is no longer the size it had when the checkpoint was opened.
LoadedCheckpoint load_checkpoint(const Checkpoint& checkpoint, const Device& device, const StreamOptions& options,
                                 const ProgressCallback& progress = {});

/// Hashes every tensor. On the host, over the bytes as streamed (digest_streamed); with a
/// CUDA `device`, the checkpoint is loaded there (load_checkpoint) and hashed from what the
/// device holds, read back in pieces within options.memory_limit of pinned memory.
/// Digests are in the order of Checkpoint::tensors().
std::vector<TensorDigest> digest_checkpoint(const Checkpoint& checkpoint, HashKind kind, const Device& device,
                                            const StreamOptions& options, StreamStats* stats = nullptr,
                                            const ProgressCallback& progress = {});
/// The same for several hash kinds in one pass over the bytes: result[k] holds the digests
/// of kinds[k] (`digest --hash sha256` also computes the xxh64 the content digest needs).
std::vector<std::vector<TensorDigest>> digest_checkpoint(const Checkpoint& checkpoint, const std::vector<HashKind>& kinds,
                                                         const Device& device, const StreamOptions& options,
                                                         StreamStats* stats = nullptr,
                                                         const ProgressCallback& progress = {});

/// The checkpoint's content digest (content_digest in stream.hpp): every tensor's bytes are
/// streamed once through host staging and hashed (xxh64). It costs a read of the whole
/// checkpoint. Throws what digest_checkpoint throws.
std::string checkpoint_content_digest(const Checkpoint& checkpoint, const StreamOptions& options,
                                      StreamStats* stats = nullptr, const ProgressCallback& progress = {});

/// The checkpoint's config.json, parsed. Throws Error(kNotFound) naming the checkpoint
/// when it has none.
ModelConfig checkpoint_model_config(const Checkpoint& checkpoint);

}  // namespace weightstream
