#pragma once
// The private state of a LoadSession and its steps. load() takes a batch in five: check
// (every tensor of the batch, before any byte of it is written: session_checks.cpp), account
// (count its bytes, find the parts, parameters and layers it completes: session_progress.cpp),
// hold (with LayerCommit::kWholeLayer, pieces of a layer still incomplete wait for their
// layer: session_held.cpp), write (session_writes.cpp), and process the layers it made ready
// (session_progress.cpp). finish() checks what arrived and writes what is still held
// (session_finish.cpp); the public methods are in session.cpp.

#include <cstddef>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "device/shared/copies.hpp"
#include "model/held_bytes_pool.hpp"
#include "model/parameter_writer.hpp"
#include "model/piece_write.hpp"
#include "weightstream/error.hpp"
#include "weightstream/model.hpp"

namespace weightstream {

struct LoadSession::State {
  explicit State(ModelLayout& layout_) : layout(layout_) {}
  ModelLayout& layout;

  // What a load has received: per part, per parameter, per layer (with its held pieces).

  struct PartState {
    uint64_t received = 0;       ///< bytes of the slice (its columns of its rows) accounted in this load
    std::optional<Dtype> dtype;  ///< dtype its pieces arrive in (one per load)
    std::vector<std::byte> assembly;  ///< the slice, compactly, gathered when pieces must be converted
    uint64_t assembled = 0;           ///< bytes gathered into `assembly` (or `device_assembly`)
    std::shared_ptr<LaneScratch> device_assembly;  ///< the slice gathered on the GPU, to be quantized there
    unsigned lane = 0;                             ///< the writer's lane that gathers and quantizes it
    bool complete = false;
  };
  struct ParameterState {
    std::vector<PartState> parts;
    size_t parts_complete = 0;
    uint64_t engine_received = 0;  ///< engine format: bytes accounted
    bool touched = false;
    bool complete = false;
    bool processed = false;
    Buffer staging;  ///< checkpoint-format bytes of a processed parameter
  };

  using Write = model::PieceWrite;
  /// A held piece's copy out of a source that is valid only during its load() call: made by
  /// that call after it lets go of the session's lock, so reader threads copy in parallel
  /// (one thread at a time under the lock ran at a fraction of the memory's rate).
  struct HeldCopy {
    std::byte* destination = nullptr;
    Device destination_device;  ///< the host, or the GPU whose pool holds the piece
    const std::byte* source = nullptr;
    uint64_t bytes = 0;
    std::promise<void> done;
    std::shared_future<void> copied = done.get_future().share();
  };
  /// A piece of a layer not yet complete (LayerCommit::kWholeLayer), written with its layer.
  struct Held {
    Write write;
    std::shared_ptr<const std::string> name;  ///< the write's name points here (not moved by a move)
    std::shared_future<void> copied;          ///< valid while its bytes are copied by another load() call
  };
  struct LayerState {
    size_t parameters = 0;  ///< parameters of the layer that parts fill
    size_t complete = 0;
    unsigned writing = 0;   ///< writes of the layer issued by load() calls not yet returned
    bool processed = false;
    std::vector<Held> held;
    bool complete_now() const { return parameters > 0 && complete == parameters; }
  };

  /// The first error of a batch in this load: later load() and finish() calls refuse.
  struct Failure {
    ErrorCode code;
    std::string message;
    bool wrote = false;  ///< the batch had begun writing (its checks had passed)
  };

  std::mutex mutex;

  // The device path, kept across loads: the writer and the memory of held pieces.
  std::optional<model::ParameterWriter> writer;  ///< made for the layout's device, kept across loads
  std::shared_ptr<model::HeldBytesPool> held_bytes = std::make_shared<model::HeldBytesPool>();  ///< host copies of held pieces
  std::shared_ptr<model::HeldBytesPool> held_device_bytes;  ///< copies of held pieces on the writer's GPU

  // The current load: how it was begun, what it has received, its first failure.
  bool active = false;
  TensorFormat format = TensorFormat::kCheckpoint;
  LayerCommit commit = LayerCommit::kAsArrived;
  std::vector<ParameterState> parameters;
  std::map<int64_t, LayerState> layers;
  LoadCounters counters;
  std::optional<Failure> failure;

  // The current batch's checks (engine format): bytes per parameter, reset after each batch.
  std::vector<size_t> batch_bytes_touched;   ///< parameters with engine bytes in the current batch
  std::vector<uint64_t> batch_engine_bytes;  ///< per parameter: engine bytes in the current batch

  /// A batch checked whole: what it writes, in the order of its tensors.
  struct CheckedBatch {
    std::vector<Write> writes;
    uint64_t skipped = 0;  ///< tensors the layout ignores or skips
    bool waits = false;    ///< a view of lifetime kCall without a keepalive: wait before load() returns
  };

  /// The writes to issue now. `names` keeps the names of held pieces among them alive;
  /// `copies` are this call's held pieces to copy out of their sources, and `waits` the
  /// copies of other calls' held pieces among `writes`, to wait for before writing.
  struct Ready {
    std::vector<Write> writes;
    std::vector<std::shared_ptr<const std::string>> names;
    std::vector<std::shared_ptr<HeldCopy>> copies;
    std::vector<std::shared_future<void>> waits;

    /// Makes this call's held copies and waits for the others' (without the session's lock).
    void copy_held();
    /// A call that fails before its copies are made leaves their pieces unwritable: whoever
    /// flushes them gets this error rather than waiting for ever.
    ~Ready();
    Ready() = default;
    Ready(Ready&&) = default;
    Ready& operator=(Ready&&) = delete;
  };

  // Checking a batch (session_checks.cpp).

  /// Step 1 of load(): checks every tensor of `batch` (lock held); nothing is written or
  /// counted until all pass.
  CheckedBatch check(std::span<const TensorView> batch, const std::string& what);

  static void add_write(CheckedBatch& checked, const TensorView& view, size_t parameter, size_t part, uint64_t begin,
                        uint64_t end, uint64_t needed);

  /// A view of changed elements (a delta): the whole tensor, its indices ascending inside it
  /// and one value each.
  static void check_changes(const TensorView& view, uint64_t size);

  /// A delta reaches only parameters that hold the tensor's values as they are, on the host.
  template <typename TargetText>
  void check_changes_target(const TensorView& view, const Parameter& parameter, const TargetText& target_text) const;

  /// An engine-format tensor: a whole parameter's bytes (or a piece of them) as they are.
  void check_engine(const TensorView& view, const std::string& what, CheckedBatch& checked);

  /// A checkpoint-format tensor (or a piece of it): its bytes that each part it fills needs.
  void check_checkpoint(const TensorView& view, const std::string& what,
                        std::map<std::pair<size_t, size_t>, uint64_t>& part_bytes, CheckedBatch& checked);

  /// A weight is quantized here (its scales written with it) or arrives as FP8 codes with
  /// its scales: one load cannot mix the two.
  template <typename TargetText>
  void check_quantization(const TensorView& view, const Parameter& parameter, size_t part_index, bool quantizes,
                          const std::string& what, const TargetText& target_text) const;

  // Accounting and the layers' progress: which are being written, which are ready to
  // process (session_progress.cpp).

  /// Whether every part that `tensor` fills is complete in this load.
  bool tensor_complete(const std::string& tensor) const;

  /// Step 2: counts a checked batch and marks the parts, parameters and layers it completes
  /// (lock held). Returns whether its writes may be issued outside the lock: pieces copied
  /// as they are into their parts. Conversions gather on the host, and engine batches stay
  /// under the lock. With whole-layer commits, only the call that completes a layer writes
  /// it (the others hold their pieces), so its writes go outside the lock as well, unless a
  /// held piece it flushes needs the lock (may_write_unlocked()).
  bool account(const CheckedBatch& checked);

  /// A checkpoint-format write's bytes in its part; a part it completes goes to `completed`
  /// with its parameter's last, and quantizing a part fills its block scales' part too.
  void account_part(const Write& write, std::vector<size_t>& completed);

  /// The layer of each checkpoint-format write, each counted as writing while `unlocked`
  /// writes are issued outside the lock (lock held).
  std::vector<int64_t> begin_writing(std::span<const Write> writes, bool unlocked);

  /// Step 5 (lock held): layers whose last write has now been issued by every load() call
  /// are processed (cold and reload) once their copies have landed. An update may bring a
  /// layer in several buckets; its processing waits for finish().
  void end_writing(std::vector<int64_t> written, bool unlocked, LoadMode mode);

  /// Runs per-layer processing of `layer`'s complete, unprocessed parameters (lock held),
  /// once the copies that fed them have landed.
  void process_layer(int64_t layer);

  /// Waits for every copy issued so far (lock held).
  void settle();

  /// The writer into `device`'s memory, made anew (with the pool of held pieces on a GPU)
  /// when the layout's device changed.
  model::ParameterWriter& writer_for(const Device& device);

  // Holding pieces of incomplete layers (session_held.cpp).

  /// Step 3: with whole-layer commits, holds back each piece of a layer still incomplete,
  /// and a layer this batch completes takes its held pieces along (lock held).
  Ready hold(std::vector<Write> writes);

  /// Keeps a held piece with its layer: kept by reference when it stays valid for the whole
  /// load or while its keepalive lives, else copied out of its source, which may change after
  /// load() returns (host bytes by `ready`'s copy_held(), once the lock is let go).
  void keep(Held held, Ready& ready);

  /// Memory on the writer's GPU for a held piece from the host that is written as it is
  /// into a parameter on that GPU: it crosses now from its pinned staging, and lands by a
  /// device-to-device copy when its layer is whole. Null when the piece is converted on the
  /// host, its parameter lies elsewhere, or the GPU's pool is at its bound.
  std::shared_ptr<std::byte> take_device_held(const Write& write);

  /// Whether `writes` (a batch's and the held pieces it flushes) are plain copies that may
  /// be issued outside the lock: no conversion, no changed elements (lock held).
  bool may_write_unlocked(std::span<const Write> writes) const;

  /// Gives back the memory of held pieces no write holds any more (the load ended).
  void release_held_bytes();

  // Writing (session_writes.cpp).

  /// Step 4: issues the writes, every one through the writer.
  void write(std::span<const Write> writes);

  /// Writes one checkpoint-format piece into its part (or the part's staging). A piece
  /// in another dtype gathers on the host until its part is whole, then lands converted.
  void write_checkpoint(const Write& write);

  /// Writes a batch of checkpoint-format pieces into a GPU's parameters: the plain ones (from
  /// the host, in the parameter's dtype) go to the writer together, so a read's small tensors
  /// and column windows land in one copy (ParameterWriter::copy_from_host()); pieces on this
  /// GPU quantized where they lie (a pushed BF16 update of an FP8 model) in as few launches
  /// as they allow; the rest one by one (write_checkpoint()).
  void write_checkpoint_batch(std::span<const Write> writes);

  /// Writes the changed elements of `write` that fall in `part`'s slice at their places in
  /// the part (host storage at `base`, checked by check_changes_target()); values in another
  /// float dtype than the parameter's (a BF16 checkpoint tensor an engine holds in F32) are
  /// converted first, as a whole piece would be.
  void write_changes(const ParameterPart& part, const Write& write, std::byte* base);

  /// write_changes() for elements of `kElement` bytes: a part of whole rows takes each change
  /// at its offset from the part's first element; a column window places it by row and column.
  template <uint64_t kElement>
  static void scatter_changes(const ChangedElements& changes, const ParameterPart& part, std::byte* base);

  /// Quantizes a floating-point part's slice gathered whole (compactly) in its
  /// PartState::assembly into the part's E4M3 codes and its block scales (the scale
  /// parameter's part of the same index).
  void write_quantized(const Parameter& parameter, const Write& write, std::byte* base);

  /// write_quantized() on the GPU that holds the parameter: the part's slice gathers compactly
  /// in device scratch (source dtype; the pieces' copies and the kernel on one lane, in order),
  /// then one kernel writes its codes and block scales in place. Nothing waits here: the
  /// session's wait covers the kernel as it covers the copies. A piece on this GPU that holds
  /// the whole slice is quantized where it lies.
  /// With `batch`, a piece quantized where it lies adds its job there instead, for the caller
  /// to launch with the rest of its batch (write_checkpoint_batch()).
  void write_quantized_on_device(const Parameter& parameter, const Write& write, std::byte* base,
                                 std::vector<E4m3BlockJob>* batch = nullptr);

  /// Writes engine-format pieces as they are: one batch of copies (on a GPU one driver call
  /// or one gather launch, not one per tensor). Copies within the GPU are only issued; their
  /// sources stay valid until the writer's wait().
  void write_engine(std::span<const Write> writes);

  /// Where a checkpoint-format write's part begins: in its parameter, or in the parameter's
  /// staging for processing.
  std::byte* part_base(const Write& write);

  // The steps of LoadSession::finish() (session_finish.cpp), in its order.

  /// After a batch of this load failed: drops the held pieces, lets the copies in flight land
  /// and throws the batch's error, saying what the failure left written.
  [[noreturn]] void refuse_finish_after_failure(const std::string& what);
  /// A reload or update may leave out tensors, but not part of one: that is a sender's or a
  /// stream's fault, found before held pieces are written. Throws naming them.
  void expect_no_partial_tensors(const std::string& what);
  /// Writes the pieces still held (layers a load covers only in part, as an update of some
  /// tensors) and waits for every copy.
  void write_remaining_held();
  /// Completeness: a cold load names every parameter still missing, grouped by layer; any
  /// load, the FP8-processed parameters it touched but did not fill.
  void expect_complete(LoadMode mode, const std::string& what);
  /// Processes the layers not processed yet, waits for every write and gives back the
  /// memory of held pieces: the parameters are then final, for the model hooks.
  void process_remaining_layers();
};

}  // namespace weightstream
