// LoadSession: the one path every load takes, and its one set of checks. load() takes a
// batch in five steps: check (every tensor of the batch, before any byte of it is written),
// account (count its bytes, find the parts, parameters and layers it completes), hold (with
// LayerCommit::kWholeLayer, pieces of a layer still incomplete wait for their layer), write,
// and process the layers it made ready. Model hooks run once, in finish(). Every write, in
// either tensor format, goes through the session's ParameterWriter: on a GPU, asynchronous
// copies that nothing waits for per piece, issued outside the session's lock so that reader
// threads copy in parallel, and one wait (settle(), or before processing and hooks).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>

#include "base/text.hpp"
#include "device/shared/copies.hpp"
#include "model/fp8_blocks.hpp"
#include "model/parameter_writer.hpp"
#include "model/processing.hpp"
#include "weightstream/error.hpp"
#include "weightstream/model.hpp"

namespace weightstream {
namespace {

const Device kHost{};

/// The most GPU memory a load holds pieces of incomplete layers in (whole-layer commits), on
/// top of the engine's own: a reload in file order holds a few layers at a time, well below
/// it; past it (a shuffled reload of a large model), pieces are held in host memory.
constexpr uint64_t kMostHeldDeviceBytes = 2ull << 30;

uint64_t element_bytes(Dtype dtype) { return dtype_bits(dtype) / 8; }

bool is_float(Dtype dtype) { return dtype == Dtype::kBF16 || dtype == Dtype::kF16 || dtype == Dtype::kF32; }

bool convertible(Dtype from, Dtype to) { return from == to || (is_float(from) && is_float(to)); }

/// Whether a piece of `dtype` written into `parameter` is quantized into its FP8 blocks (a
/// trainer pushing BF16 weights into an FP8 block-scaled model).
bool quantizes_into(Dtype dtype, const Parameter& parameter) {
  return !parameter.block_scale.empty() && parameter.load_dtype == Dtype::kF8E4M3 && is_float(dtype);
}

/// The index of the FP8 block-scaled weight whose scales `parameter` holds, if it does.
std::optional<size_t> scaled_weight(const ModelLayout& layout, const Parameter& parameter) {
  constexpr std::string_view kSuffix = "_scale_inv";
  if (!parameter.name.ends_with(kSuffix)) return std::nullopt;
  auto weight = layout.find(std::string_view(parameter.name).substr(0, parameter.name.size() - kSuffix.size()));
  if (!weight || layout.parameters()[*weight].block_scale != parameter.name) return std::nullopt;
  return weight;
}

using detail::join;

/// Bytes of `part`'s slice (its columns of its rows) in `element`-byte elements: what a
/// load must deliver of its tensor, whichever gaps between its rows come along.
uint64_t slice_bytes(const ParameterPart& part, uint64_t element) { return part.elements() * element; }

/// The bytes of `part`'s slice among bytes [begin, end) of its tensor (elements of `element`
/// bytes): whole rows count their columns of the slice, a partial row what it holds of them.
uint64_t slice_bytes_within(const ParameterPart& part, uint64_t element, uint64_t begin, uint64_t end) {
  const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element;
  const uint64_t needed_begin = static_cast<uint64_t>(part.row_begin) * row_bytes;
  const uint64_t needed_length = static_cast<uint64_t>(part.rows) * row_bytes;
  const uint64_t column_begin = static_cast<uint64_t>(part.column_begin) * element;
  const uint64_t width = static_cast<uint64_t>(part.columns) * element;
  if (row_bytes == 0) return 0;
  // Slice bytes before position x of the needed rows.
  auto before = [&](uint64_t position) {
    uint64_t x = std::clamp(position, needed_begin, needed_begin + needed_length) - needed_begin;
    uint64_t in_row = x % row_bytes;
    return (x / row_bytes) * width + std::min(width, in_row > column_begin ? in_row - column_begin : 0);
  };
  return before(end) - before(begin);
}

/// Calls `copy(slice_offset, position, length)` for each row's run of `part`'s slice among
/// bytes [begin, end) of its tensor: `position` in the tensor, `slice_offset` in the slice
/// laid out compactly (row after row of its columns).
template <typename Copy>
void for_each_slice_run(const ParameterPart& part, uint64_t element, uint64_t begin, uint64_t end, Copy&& copy) {
  const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element;
  const uint64_t needed_begin = static_cast<uint64_t>(part.row_begin) * row_bytes;
  const uint64_t column_begin = static_cast<uint64_t>(part.column_begin) * element;
  const uint64_t width = static_cast<uint64_t>(part.columns) * element;
  if (row_bytes == 0 || end <= begin) return;
  for (uint64_t row = (begin - needed_begin) / row_bytes; row < static_cast<uint64_t>(part.rows); ++row) {
    const uint64_t run = needed_begin + row * row_bytes + column_begin;
    if (run >= end) break;
    const uint64_t lo = std::max(begin, run), hi = std::min(end, run + width);
    if (lo < hi) copy(row * width + (lo - run), lo, hi - lo);
  }
}

/// One write of a checked batch: bytes [begin, end) of a tensor into one part of one
/// parameter (checkpoint format) or into a parameter (engine format).
struct PieceWrite {
  size_t parameter = 0;
  size_t part = 0;
  uint64_t begin = 0, end = 0;        ///< bytes of the tensor, within the needed range
  uint64_t needed = 0;                ///< bytes of [begin, end) the part takes (its columns of those rows)
  const std::byte* source = nullptr;  ///< the bytes of [begin, end) (packed: the runs among them, source_at())
  uint64_t packed_run = 0, packed_stride = 0;  ///< as TensorView's: the source holds only runs
  Device device;
  Dtype dtype = Dtype::kBF16;
  SourceLifetime lifetime = SourceLifetime::kCall;
  std::shared_ptr<const void> keepalive;
  std::string_view name;
  std::shared_ptr<const ChangedElements> changes;  ///< set: the part's changed elements, not bytes at `source`
};

/// Where the byte at tensor position `position` (in [write.begin, write.end); packed: in
/// one of its runs) lies in the write's source.
const std::byte* source_at(const PieceWrite& write, uint64_t position) {
  const uint64_t from = position - write.begin;
  if (write.packed_run == 0) return write.source + from;
  return write.source + from / write.packed_stride * write.packed_run + from % write.packed_stride;
}

/// The bytes at a write's source: [begin, end) as it lies, or packed, its runs alone.
uint64_t source_bytes(const PieceWrite& write) {
  const uint64_t span = write.end - write.begin;
  if (write.packed_run == 0) return span;
  return (span - std::min(span, write.packed_run)) / write.packed_stride * write.packed_run + write.packed_run;
}

/// Calls `rectangle(destination, destination_pitch, source, source_pitch, width, rows)` for
/// each copy that writes the bytes of `write` (in the parameter's load dtype) into one part
/// at `base`: a run of a row slice lands where it belongs; a column slice is written as the
/// partial rows at the piece's ends (one row each) and one rectangle of the whole rows
/// between them, which reads only the slice's columns (a piece of a strided read holds
/// nothing else).
template <typename Rectangle>
void for_each_part_copy(std::byte* base, const ParameterPart& part, uint64_t element, const PieceWrite& write,
                        Rectangle&& rectangle) {
  const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element;
  const uint64_t needed_begin = static_cast<uint64_t>(part.row_begin) * row_bytes;
  const uint64_t length = write.end - write.begin;
  const uint64_t column_begin = static_cast<uint64_t>(part.column_begin) * element;
  const uint64_t width = static_cast<uint64_t>(part.columns) * element;  // destination row pitch too
  // A packed source holds exactly this part's window of each row (its read's runs).
  WS_EXPECT(write.packed_run == 0 || (!part.contiguous() && write.packed_stride == row_bytes && write.packed_run == width),
            ErrorCode::kInternal,
            "tensor " + std::string(write.name) + ": a packed piece of runs of " + std::to_string(write.packed_run) +
                " bytes every " + std::to_string(write.packed_stride) + " does not match its part's column window");
  if (part.contiguous()) {
    rectangle(base + (write.begin - needed_begin), length, write.source, length, length, 1);
    return;
  }
  // Positions count from the needed range's first byte, rows from the part's first row.
  const uint64_t first = write.begin - needed_begin;
  const uint64_t last = write.end - needed_begin;
  const uint64_t source_pitch = write.packed_run ? width : row_bytes;
  auto source_at = [&](uint64_t position) { return weightstream::source_at(write, position + needed_begin); };
  auto write_partial_row = [&](uint64_t row, uint64_t from, uint64_t to) {
    // The part's columns of `row` that lie in [from, to).
    uint64_t columns_from = row * row_bytes + column_begin;
    uint64_t lo = std::max(from, columns_from);
    uint64_t hi = std::min(to, columns_from + width);
    if (lo >= hi) return;
    rectangle(base + row * width + (lo - columns_from), hi - lo, source_at(lo), hi - lo, hi - lo, 1);
  };
  uint64_t row = first / row_bytes;
  uint64_t position = first;
  if (position % row_bytes != 0 || last - position < row_bytes) {
    uint64_t row_end = std::min(last, (row + 1) * row_bytes);
    write_partial_row(row, position, row_end);
    position = row_end;
    ++row;
  }
  uint64_t whole_rows = (last - position) / row_bytes;
  if (whole_rows > 0) {
    rectangle(base + row * width, width, source_at(position + column_begin), source_pitch, width, whole_rows);
    position += whole_rows * row_bytes;
    row += whole_rows;
  }
  if (position < last) write_partial_row(row, position, last);
}

/// Writes the bytes of `write` (in the parameter's load dtype) into one part through
/// `writer` (for_each_part_copy()). On a GPU, every copy runs on lane `lane` when given.
void write_part_bytes(model::ParameterWriter& writer, std::byte* base, const ParameterPart& part, uint64_t element,
                      const PieceWrite& write, std::optional<unsigned> lane = std::nullopt) {
  for_each_part_copy(base, part, element, write,
                     [&](std::byte* destination, uint64_t destination_pitch, const std::byte* source,
                         uint64_t source_pitch, uint64_t width, uint64_t rows) {
                       writer.copy_rows(destination, destination_pitch, source, write.device, source_pitch, width, rows,
                                        write.keepalive, write.name, lane);
                     });
}

/// Memory for held pieces, reused within a load: host memory, or a GPU's when the pieces go
/// to that GPU. A held piece's copy in fresh host memory costs more than the copy itself: the
/// kernel faults in and zero-fills every page first (a pushed update of a 1 GiB llama in 64
/// MiB buckets holds about 60% of its bytes, and the receiver applied it at 2.1 GB/s). On a
/// GPU, a piece held in host memory would later cross from pageable memory (about 6 GB/s; a
/// 16 GB reload took 11 s): held in the GPU's memory it crosses once from the pinned staging
/// at the link's rate and lands by a device-to-device copy. Memory comes back when its last
/// holder lets go; free memory is kept up to the most ever in use at once, so the pool stays
/// within twice the peak of held bytes, and release() gives it all back when the load ends.
/// A GPU's pool holds at most `most_bytes` in use: take() then gives nothing, and the piece
/// is held in host memory. (The stream's StagingPool does not fit: its buffers are of one
/// size and capped, and a held piece may neither wait nor be refused.)
class HeldBytesPool : public std::enable_shared_from_this<HeldBytesPool> {
 public:
  HeldBytesPool() = default;
  HeldBytesPool(Device device, uint64_t most_bytes) : device_(std::move(device)), most_bytes_(most_bytes) {}

  const Device& device() const noexcept { return device_; }

  /// `bytes` of the pool's memory, unwritten (or holding an earlier piece's bytes); null when
  /// a GPU's pool would go past its bound.
  std::shared_ptr<std::byte> take(uint64_t bytes) {
    const uint64_t capacity = (std::max<uint64_t>(bytes, 1) + kGranule - 1) / kGranule * kGranule;
    std::shared_ptr<Block> buffer;
    {
      std::lock_guard lock(mutex_);
      // The smallest free buffer that fits, unless it is much larger than the piece.
      auto found = free_.lower_bound(capacity);
      if (found != free_.end() && found->first <= 2 * capacity) {
        buffer = std::move(found->second);
        free_bytes_ -= found->first;
        free_.erase(found);
      } else if (device_.is_cuda() && in_use_bytes_ + free_bytes_ + capacity > most_bytes_) {
        return nullptr;
      }
      in_use_bytes_ += buffer ? buffer->size : capacity;
      peak_in_use_bytes_ = std::max(peak_in_use_bytes_, in_use_bytes_);
    }
    if (!buffer) buffer = allocate(capacity);
    if (!buffer) return nullptr;
    std::byte* data = buffer->data();
    return std::shared_ptr<std::byte>(data, [pool = shared_from_this(), buffer](std::byte*) { pool->give_back(buffer); });
  }

  /// Frees the memory no piece holds now.
  void release() {
    std::lock_guard lock(mutex_);
    free_.clear();
    free_bytes_ = 0;
    peak_in_use_bytes_ = in_use_bytes_;
  }

 private:
  static constexpr uint64_t kGranule = 64 * 1024;
  struct Block {
    std::unique_ptr<std::byte[]> host;
    Buffer device;
    uint64_t size = 0;
    std::byte* data() const { return host ? host.get() : device.data(); }
  };

  /// A new block; null when the GPU has no memory left for it (the pool then takes no more,
  /// and pieces are held in host memory).
  std::shared_ptr<Block> allocate(uint64_t capacity) {
    auto block = std::make_shared<Block>();
    block->size = capacity;
    try {
      // Host: malloc's memory, not the device layer's mapped host buffers: those ask for
      // transparent huge pages, whose first faults stall here.
      if (device_.is_cuda()) {
        block->device = Buffer(device_, capacity);
      } else {
        block->host.reset(new std::byte[capacity]);
      }
      return block;
    } catch (const Error& error) {
      std::lock_guard lock(mutex_);
      in_use_bytes_ -= capacity;
      if (!device_.is_cuda() || error.code() != ErrorCode::kDevice) throw;
      most_bytes_ = 0;
      return nullptr;
    } catch (...) {
      std::lock_guard lock(mutex_);
      in_use_bytes_ -= capacity;
      throw;
    }
  }

  void give_back(const std::shared_ptr<Block>& buffer) {
    std::lock_guard lock(mutex_);
    in_use_bytes_ -= buffer->size;
    if (free_bytes_ + buffer->size > peak_in_use_bytes_) return;  // freed with its last reference
    free_bytes_ += buffer->size;
    free_.emplace(buffer->size, buffer);
  }

  Device device_;
  uint64_t most_bytes_ = 0;
  std::mutex mutex_;
  std::multimap<uint64_t, std::shared_ptr<Block>> free_;  ///< by size
  uint64_t free_bytes_ = 0;
  uint64_t in_use_bytes_ = 0;
  uint64_t peak_in_use_bytes_ = 0;
};

}  // namespace

struct LoadSession::State {
  explicit State(ModelLayout& layout_) : layout(layout_) {}
  ModelLayout& layout;

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

  using Write = PieceWrite;
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

  std::mutex mutex;
  std::optional<model::ParameterWriter> writer;  ///< made for the layout's device, kept across loads
  std::shared_ptr<HeldBytesPool> held_bytes = std::make_shared<HeldBytesPool>();  ///< host copies of held pieces
  std::shared_ptr<HeldBytesPool> held_device_bytes;  ///< copies of held pieces on the writer's GPU
  std::vector<size_t> batch_bytes_touched;   ///< parameters with engine bytes in the current batch
  std::vector<uint64_t> batch_engine_bytes;  ///< per parameter: engine bytes in the current batch
  bool active = false;
  TensorFormat format = TensorFormat::kCheckpoint;
  LayerCommit commit = LayerCommit::kAsArrived;
  std::vector<ParameterState> parameters;
  std::map<int64_t, LayerState> layers;
  LoadCounters counters;
  /// The first error of a batch in this load: later load() and finish() calls refuse.
  struct Failure {
    ErrorCode code;
    std::string message;
    bool wrote = false;  ///< the batch had begun writing (its checks had passed)
  };
  std::optional<Failure> failure;

  /// Whether every part that `tensor` fills is complete in this load.
  bool tensor_complete(const std::string& tensor) const {
    for (const auto& [parameter, part] : layout.route(tensor).targets) {
      if (!parameters[parameter].parts[part].complete) return false;
    }
    return true;
  }

  /// Writes one checkpoint-format piece into its part (or the part's staging). A piece
  /// in another dtype gathers on the host until its part is whole, then lands converted.
  void write_checkpoint(const Write& write) {
    Parameter& parameter = layout.mutable_parameter(write.parameter);
    const ParameterPart& part = parameter.parts[write.part];
    ParameterState& parameter_state = parameters[write.parameter];
    std::byte* base = part_base(write);
    if (write.changes) return write_changes(part, write, base);
    if (write.dtype == parameter.load_dtype) return write_part_bytes(*writer, base, part, element_bytes(write.dtype), write);
    if (quantizes_into(write.dtype, parameter) && writer->quantizes_on_device() && parameter.device == writer->device() &&
        (!write.device.is_cuda() || write.device == writer->device())) {
      return write_quantized_on_device(parameter, write, base);
    }
    // The part's slice gathers compactly (its columns of each row) until it is whole.
    PartState& part_state = parameter_state.parts[write.part];
    const uint64_t source_element = element_bytes(write.dtype);
    const uint64_t needed_bytes = slice_bytes(part, source_element);
    if (part_state.assembly.empty()) part_state.assembly.resize(needed_bytes);
    // A piece on a GPU comes to the host in one copy, not one a row.
    const std::byte* source = write.source;
    std::vector<std::byte> host_piece;
    if (write.device.is_cuda()) {
      host_piece.resize(write.end - write.begin);
      copy_bytes(host_piece.data(), kHost, write.source, write.device, host_piece.size());
      source = host_piece.data();
    }
    for_each_slice_run(part, source_element, write.begin, write.end,
                       [&](uint64_t slice_offset, uint64_t position, uint64_t length) {
                         const std::byte* from =
                             source == write.source ? source_at(write, position) : source + (position - write.begin);
                         std::memcpy(part_state.assembly.data() + slice_offset, from, length);
                       });
    part_state.assembled += write.needed;
    if (part_state.assembled < needed_bytes) return;
    if (quantizes_into(write.dtype, parameter)) return write_quantized(parameter, write, base);
    auto converted = std::make_shared<std::vector<std::byte>>(part.elements() * element_bytes(parameter.load_dtype));
    convert_elements(converted->data(), parameter.load_dtype, part_state.assembly.data(), write.dtype, part.elements());
    std::vector<std::byte>().swap(part_state.assembly);
    writer->copy(base, converted->data(), kHost, converted->size(), converted, write.name);
  }

  /// Writes the changed elements of `write` that fall in `part`'s slice at their places in
  /// the part (host storage at `base`, checked by check_changes_target()); values in another
  /// float dtype than the parameter's (a BF16 checkpoint tensor an engine holds in F32) are
  /// converted first, as a whole piece would be.
  void write_changes(const ParameterPart& part, const Write& write, std::byte* base) {
    const Dtype held = layout.parameters()[write.parameter].dtype;
    const ChangedElements* changes = write.changes.get();
    ChangedElements converted;
    if (held != write.dtype) {
      converted.indices = changes->indices;
      converted.values.resize(changes->indices.size() * element_bytes(held));
      convert_elements(converted.values.data(), held, changes->values.data(), write.dtype, changes->indices.size());
      changes = &converted;
    }
    switch (element_bytes(held)) {
      case 1: return scatter_changes<1>(*changes, part, base);
      case 2: return scatter_changes<2>(*changes, part, base);
      case 4: return scatter_changes<4>(*changes, part, base);
      case 8: return scatter_changes<8>(*changes, part, base);
    }
    WS_FAIL(ErrorCode::kInternal, "tensor " + std::string(write.name) + ": changed elements of " +
                                      std::string(dtype_name(write.dtype)) + " cannot be written");
  }

  /// write_changes() for elements of `kElement` bytes: a part of whole rows takes each change
  /// at its offset from the part's first element; a column window places it by row and column.
  template <uint64_t kElement>
  static void scatter_changes(const ChangedElements& changes, const ParameterPart& part, std::byte* base) {
    const auto tensor_columns = static_cast<uint64_t>(part.tensor_columns());
    const auto column_begin = static_cast<uint64_t>(part.column_begin);
    const auto columns = static_cast<uint64_t>(part.columns);
    const uint64_t first = static_cast<uint64_t>(part.row_begin) * tensor_columns;
    const uint64_t end = first + static_cast<uint64_t>(part.rows) * tensor_columns;
    const auto begin = std::lower_bound(changes.indices.begin(), changes.indices.end(), first);
    const std::byte* values = changes.values.data();
    for (auto at = begin; at != changes.indices.end() && *at < end; ++at) {
      const auto k = static_cast<uint64_t>(at - changes.indices.begin());
      uint64_t element = *at - first;  // in the part, when it holds whole rows
      if (!part.contiguous()) {
        const uint64_t column = *at % tensor_columns;
        if (column < column_begin || column >= column_begin + columns) continue;  // another rank's columns
        element = (element / tensor_columns) * columns + column - column_begin;
      }
      std::memcpy(base + element * kElement, values + k * kElement, kElement);
    }
  }

  /// Quantizes a floating-point part's slice gathered whole (compactly) in its
  /// PartState::assembly into the part's E4M3 codes and its block scales (the scale
  /// parameter's part of the same index).
  void write_quantized(const Parameter& parameter, const Write& write, std::byte* base) {
    const ParameterPart& part = parameter.parts[write.part];
    PartState& part_state = parameters[write.parameter].parts[write.part];
    const auto rows = static_cast<uint64_t>(part.rows), columns = static_cast<uint64_t>(part.columns);
    std::vector<float> values(rows * columns);
    convert_elements(reinterpret_cast<std::byte*>(values.data()), Dtype::kF32, part_state.assembly.data(), write.dtype,
                     rows * columns);
    std::vector<std::byte>().swap(part_state.assembly);
    const Parameter& scale = layout.parameter(parameter.block_scale);
    const ParameterPart& scale_part = scale.parts[write.part];
    auto codes = std::make_shared<std::vector<std::byte>>(rows * columns);
    auto scales = std::make_shared<std::vector<float>>(scale_part.elements());
    model::quantize_e4m3_blocks(values, rows, columns, parameter.scale_block, *codes, *scales);
    writer->copy(base, codes->data(), kHost, codes->size(), codes, write.name);
    writer->copy(scale.data + scale_part.element_offset * sizeof(float), reinterpret_cast<const std::byte*>(scales->data()),
                 kHost, scales->size() * sizeof(float), scales, write.name);
  }

  /// write_quantized() on the GPU that holds the parameter: the part's slice gathers compactly
  /// in device scratch (source dtype; the pieces' copies and the kernel on one lane, in order),
  /// then one kernel writes its codes and block scales in place. Nothing waits here: the
  /// session's wait covers the kernel as it covers the copies. A piece on this GPU that holds
  /// the whole slice is quantized where it lies.
  /// With `batch`, a piece quantized where it lies adds its job there instead, for the caller
  /// to launch with the rest of its batch (write_checkpoint_batch()).
  void write_quantized_on_device(const Parameter& parameter, const Write& write, std::byte* base,
                                 std::vector<E4m3BlockJob>* batch = nullptr) {
    const ParameterPart& part = parameter.parts[write.part];
    PartState& part_state = parameters[write.parameter].parts[write.part];
    const uint64_t element = element_bytes(write.dtype);
    const uint64_t needed_bytes = slice_bytes(part, element);
    const Parameter& scale = layout.parameter(parameter.block_scale);
    const ParameterPart& scale_part = scale.parts[write.part];
    E4m3BlockJob job;
    job.dtype = write.dtype;
    job.rows = static_cast<uint64_t>(part.rows);
    job.columns = static_cast<uint64_t>(part.columns);
    job.block_rows = static_cast<uint64_t>(parameter.scale_block[0]);
    job.block_columns = static_cast<uint64_t>(parameter.scale_block[1]);
    job.codes = base;
    job.scales = reinterpret_cast<float*>(scale.data + scale_part.element_offset * sizeof(float));
    if (write.device.is_cuda() && part_state.assembled == 0 && write.needed == needed_bytes) {
      const uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element;
      const uint64_t first = static_cast<uint64_t>(part.row_begin) * row_bytes +
                             static_cast<uint64_t>(part.column_begin) * element;  // the slice's first byte
      job.source = write.source + (first - write.begin);
      job.source_pitch = row_bytes;
      if (reinterpret_cast<uintptr_t>(job.source) % element == 0) {
        part_state.assembled = needed_bytes;
        if (batch) return batch->push_back(job);
        return writer->quantize_e4m3(std::span(&job, 1), write.keepalive, writer->take_lane(),
                                     "tensor '" + std::string(write.name) + "'");
      }
    }
    if (!part_state.device_assembly) {
      part_state.lane = writer->take_lane();
      part_state.device_assembly = writer->scratch(needed_bytes, part_state.lane);
    }
    write_part_bytes(*writer, part_state.device_assembly->data(), part, element, write, part_state.lane);
    part_state.assembled += write.needed;
    if (part_state.assembled < needed_bytes) return;
    job.source = part_state.device_assembly->data();
    job.source_pitch = job.columns * element;
    writer->quantize_e4m3(std::span(&job, 1), nullptr, part_state.lane, "tensor '" + std::string(write.name) + "'");
    part_state.device_assembly.reset();  // back to the pool after the kernel, in the lane's order
  }

  /// Writes engine-format pieces as they are: one batch of copies (on a GPU one driver call
  /// or one gather launch, not one per tensor). Copies within the GPU are only issued; their
  /// sources stay valid until the writer's wait().
  void write_engine(std::span<const Write> writes) {
    std::vector<CopyRange> host_copies;    // from host memory, or all on the host
    std::vector<CopyRange> device_copies;  // from and to the layout's GPU
    std::vector<std::shared_ptr<const void>> device_keepalives;
    for (const Write& write : writes) {
      const Parameter& parameter = layout.parameters()[write.parameter];
      const uint64_t length = write.end - write.begin;
      if (parameter.device == write.device && write.device.is_cuda()) {
        device_copies.push_back({parameter.data + write.begin, write.source, length});
        device_keepalives.push_back(write.keepalive);
      } else if (parameter.device == write.device || !write.device.is_cuda()) {
        host_copies.push_back({parameter.data + write.begin, write.source, length});
      } else {
        writer->copy(parameter.data + write.begin, write.source, write.device, length, write.keepalive, write.name);
      }
    }
    writer->copy_ranges(host_copies, kHost, {});
    writer->copy_ranges(device_copies, layout.device(), std::move(device_keepalives));
  }

  /// Runs per-layer processing of `layer`'s complete, unprocessed parameters (lock held),
  /// once the copies that fed them have landed.
  void process_layer(int64_t layer) {
    bool ran = false;
    bool waited = false;
    for (size_t index : layout.layer_parameters(layer)) {
      const Parameter& parameter = layout.parameters()[index];
      ParameterState& parameter_state = parameters[index];
      if (parameter.processing == Processing::kNone || !parameter_state.complete || parameter_state.processed) continue;
      if (!waited) {
        writer->wait();
        waited = true;
      }
      const Parameter* scale = nullptr;
      if (auto scale_index = layout.find(parameter.scale)) scale = &layout.parameters()[*scale_index];
      model::process_parameter(parameter, parameter_state.staging.data(), scale);
      parameter_state.processed = true;
      parameter_state.staging = Buffer();
      ran = true;
    }
    layers[layer].processed = true;
    if (ran) ++counters.layer_processing_runs;
  }

  /// Waits for every copy issued so far (lock held).
  void settle() {
    if (writer) writer->wait();
  }

  /// A batch checked whole: what it writes, in the order of its tensors.
  struct CheckedBatch {
    std::vector<Write> writes;
    uint64_t skipped = 0;  ///< tensors the layout ignores or skips
    bool waits = false;    ///< a view of lifetime kCall without a keepalive: wait before load() returns
  };

  /// Step 1 of load(): checks every tensor of `batch` (lock held); nothing is written or
  /// counted until all pass.
  CheckedBatch check(std::span<const TensorView> batch, const std::string& what) {
    CheckedBatch checked;
    checked.writes.reserve(batch.size());
    std::map<std::pair<size_t, size_t>, uint64_t> part_bytes;  // checkpoint format: this batch's, per part
    // Engine format, per parameter: a flat array reset after the batch (an update brings
    // thousands of tensors a batch; a tree of them cost more than the checks).
    batch_engine_bytes.resize(layout.parameters().size());
    struct ResetEngineBytes {
      State& state;
      ~ResetEngineBytes() {
        for (size_t index : state.batch_bytes_touched) state.batch_engine_bytes[index] = 0;
        state.batch_bytes_touched.clear();
      }
    } reset_engine_bytes{*this};
    for (const TensorView& view : batch) {
      auto size = tensor_byte_size(view.dtype, view.shape);
      WS_EXPECT(size.has_value(), ErrorCode::kModel,
                "tensor " + std::string(view.name) + ": shape " + shape_text(view.shape) + " of " +
                    std::string(dtype_name(view.dtype)) + " has no valid byte size");
      WS_EXPECT(view.offset <= *size && view.bytes <= *size - view.offset, ErrorCode::kModel,
                "tensor " + std::string(view.name) + ": piece " + std::to_string(view.offset) + "+" + std::to_string(view.bytes) +
                    " lies outside its " + std::to_string(*size) + " bytes");
      WS_EXPECT(view.data != nullptr || view.bytes == 0 || view.changes, ErrorCode::kModel,
                "tensor " + std::string(view.name) + ": no data");
      WS_EXPECT(view.packed_run == 0 || (format == TensorFormat::kCheckpoint && view.packed_stride >= view.packed_run &&
                                         view.bytes >= view.packed_run &&
                                         (view.bytes - view.packed_run) % view.packed_stride == 0),
                ErrorCode::kModel,
                "tensor " + std::string(view.name) + ": a packed piece of runs of " + std::to_string(view.packed_run) +
                    " bytes every " + std::to_string(view.packed_stride) + " bytes does not span " +
                    std::to_string(view.bytes) + " bytes in whole runs" +
                    (format == TensorFormat::kEngine ? " (and engine-format pieces are never packed)" : ""));
      WS_EXPECT(!view.changes || view.packed_run == 0, ErrorCode::kModel,
                "tensor " + std::string(view.name) + ": changed elements are never packed");
      if (view.changes) check_changes(view, *size);
      if (format == TensorFormat::kEngine) {
        check_engine(view, what, checked);
      } else {
        check_checkpoint(view, what, part_bytes, checked);
      }
    }
    return checked;
  }

  static void add_write(CheckedBatch& checked, const TensorView& view, size_t parameter, size_t part, uint64_t begin,
                        uint64_t end, uint64_t needed) {
    const PieceWrite whole{.begin = view.offset, .source = view.data, .packed_run = view.packed_run,
                           .packed_stride = view.packed_stride};
    const std::byte* source = view.changes ? nullptr : source_at(whole, begin);
    checked.writes.push_back({parameter, part, begin, end, needed, source, view.packed_run, view.packed_stride,
                              view.device, view.dtype, view.lifetime, view.keepalive, view.name, view.changes});
    checked.waits = checked.waits || (view.lifetime == SourceLifetime::kCall && !view.keepalive && !view.changes);
  }

  /// A view of changed elements (a delta): the whole tensor, its indices ascending inside it
  /// and one value each.
  static void check_changes(const TensorView& view, uint64_t size) {
    const ChangedElements& changes = *view.changes;
    const std::string tensor = "tensor " + std::string(view.name);
    WS_EXPECT(view.offset == 0 && view.bytes == size, ErrorCode::kModel,
              tensor + ": changed elements stand for the whole tensor (offset 0, " + std::to_string(size) +
                  " bytes), not the piece " + std::to_string(view.offset) + "+" + std::to_string(view.bytes));
    const uint64_t element = element_bytes(view.dtype);
    WS_EXPECT(element > 0, ErrorCode::kModel,
              tensor + ": changed elements are whole-byte elements, and " + std::string(dtype_name(view.dtype)) +
                  " packs several in a byte; send it whole");
    WS_EXPECT(changes.values.size() == changes.indices.size() * element, ErrorCode::kModel,
              tensor + ": " + std::to_string(changes.indices.size()) + " changed elements of " +
                  std::string(dtype_name(view.dtype)) + " come with " + std::to_string(changes.values.size()) +
                  " bytes of values");
    const uint64_t elements = size / element;
    for (size_t i = 0; i < changes.indices.size(); ++i) {
      const uint64_t index = changes.indices[i];
      WS_EXPECT(index < elements && (i == 0 || index > changes.indices[i - 1]), ErrorCode::kModel,
                tensor + ": changed element " + std::to_string(i) + " is at index " + std::to_string(index) +
                    (index < elements ? ", not after the one before it" : ", outside its " + std::to_string(elements) +
                                                                              " elements"));
    }
  }

  /// A delta reaches only parameters that hold the tensor's values as they are, on the host.
  template <typename TargetText>
  void check_changes_target(const TensorView& view, const Parameter& parameter, const TargetText& target_text) const {
    std::string why;
    if (parameter.processing != Processing::kNone) {
      why = "is processed (quantized) after loading";
    } else if (view.dtype != parameter.dtype && !convertible(view.dtype, parameter.dtype)) {
      why = "holds " + std::string(dtype_name(parameter.dtype)) + ", not the tensor's " +
            std::string(dtype_name(view.dtype));
    } else if (parameter.device.is_cuda()) {
      why = "lives on a GPU, where changed elements are not written yet";
    }
    WS_EXPECT(why.empty(), ErrorCode::kModel,
              "tensor " + std::string(view.name) + " arrives as changed elements but " + target_text() + " " + why +
                  "; send it whole");
  }

  /// An engine-format tensor: a whole parameter's bytes (or a piece of them) as they are.
  void check_engine(const TensorView& view, const std::string& what, CheckedBatch& checked) {
    const std::string_view tensor = view.name;
    auto index = layout.find(tensor);
    WS_EXPECT(index.has_value(), ErrorCode::kModel,
              "engine-format tensor " + std::string(tensor) + " names no parameter of " + layout.description());
    const Parameter& parameter = layout.parameters()[*index];
    WS_EXPECT(!view.changes, ErrorCode::kModel,
              "engine-format tensor " + std::string(tensor) + " arrives as changed elements, which take checkpoint names");
    WS_EXPECT(view.dtype == parameter.dtype, ErrorCode::kModel,
              "engine-format tensor " + std::string(tensor) + " has dtype " + std::string(dtype_name(view.dtype)) + " but parameter " +
                  parameter.name + " (" + layer_label(layout, parameter.layer) + ") holds " +
                  std::string(dtype_name(parameter.dtype)));
    WS_EXPECT(std::ranges::equal(view.shape, parameter.shape), ErrorCode::kModel,
              "engine-format tensor " + std::string(tensor) + " has shape " + shape_text(view.shape) + " but parameter " +
                  parameter.name + " (" + layer_label(layout, parameter.layer) + ") has shape " +
                  shape_text(parameter.shape));
    uint64_t& pending = batch_engine_bytes[*index];
    WS_EXPECT(parameters[*index].engine_received + pending + view.bytes <= parameter.bytes(), ErrorCode::kModel,
              "tensor " + std::string(tensor) + " delivered twice in this " + what);
    if (pending == 0) batch_bytes_touched.push_back(*index);
    pending += view.bytes;
    add_write(checked, view, *index, 0, view.offset, view.offset + view.bytes, view.bytes);
  }

  /// A checkpoint-format tensor (or a piece of it): its bytes that each part it fills needs.
  void check_checkpoint(const TensorView& view, const std::string& what,
                        std::map<std::pair<size_t, size_t>, uint64_t>& part_bytes, CheckedBatch& checked) {
    const std::string_view tensor = view.name;
    TensorRoute route = layout.route(tensor);
    if (route.kind == TensorRoute::Kind::kIgnored || route.kind == TensorRoute::Kind::kSkipped) {
      if (view.offset == 0) ++checked.skipped;
      return;
    }
    WS_EXPECT(route.kind == TensorRoute::Kind::kParameter, ErrorCode::kModel,
              "tensor " + std::string(tensor) + " matches no parameter of " + layout.description() +
                  " and no ignore rule; add an ignore rule if the engine does not use it");
    for (const auto& [index, part_index] : route.targets) {
      const Parameter& parameter = layout.parameters()[index];
      const ParameterPart& part = parameter.parts[part_index];
      // Built only for a message: this runs for every tensor of every load.
      auto target_text = [&] {
        return "parameter " + parameter.name + " (part '" + part.id + "', " + layer_label(layout, parameter.layer) +
               ", rule " + part.rule + ")";
      };
      WS_EXPECT(std::ranges::equal(view.shape, part.shape), ErrorCode::kModel,
                "tensor " + std::string(tensor) + " has shape " + shape_text(view.shape) + " but " + target_text() + " expects " +
                    shape_text(part.shape));
      if (view.changes) check_changes_target(view, parameter, target_text);
      const bool quantizes = quantizes_into(view.dtype, parameter);
      WS_EXPECT(convertible(view.dtype, parameter.load_dtype) || quantizes, ErrorCode::kModel,
                "tensor " + std::string(tensor) + " has dtype " + std::string(dtype_name(view.dtype)) + " but " + target_text() +
                    " is loaded as " + std::string(dtype_name(parameter.load_dtype)) +
                    " (only BF16, F16 and F32 convert on copy, and quantize into FP8 block-scaled weights)");
      const PartState& part_state = parameters[index].parts[part_index];
      WS_EXPECT(!part_state.dtype || *part_state.dtype == view.dtype, ErrorCode::kModel,
                "tensor " + std::string(tensor) + ": a piece arrived as " + std::string(dtype_name(view.dtype)) +
                    " after earlier pieces as " + std::string(dtype_name(*part_state.dtype)));
      uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element_bytes(view.dtype);
      uint64_t needed_begin = static_cast<uint64_t>(part.row_begin) * row_bytes;
      uint64_t needed_end = needed_begin + static_cast<uint64_t>(part.rows) * row_bytes;
      uint64_t begin = std::max(view.offset, needed_begin);
      uint64_t end = std::min(view.offset + view.bytes, needed_end);
      if (begin >= end) continue;  // a piece of rows another rank holds
      const uint64_t needed = slice_bytes_within(part, element_bytes(view.dtype), begin, end);
      if (needed == 0) continue;  // only columns another rank holds
      uint64_t& pending = part_bytes[{index, part_index}];
      WS_EXPECT(!part_state.complete &&
                    part_state.received + pending + needed <= slice_bytes(part, element_bytes(view.dtype)),
                ErrorCode::kModel, "tensor " + std::string(tensor) + " delivered twice in this " + what + " (" + target_text() + ")");
      check_quantization(view, parameter, part_index, quantizes, what, target_text);
      pending += needed;
      add_write(checked, view, index, part_index, begin, end, needed);
    }
  }

  /// A weight is quantized here (its scales written with it) or arrives as FP8 codes with
  /// its scales: one load cannot mix the two.
  template <typename TargetText>
  void check_quantization(const TensorView& view, const Parameter& parameter, size_t part_index, bool quantizes,
                          const std::string& what, const TargetText& target_text) const {
    const std::string mixed = ": send an FP8 weight with its weight_scale_inv, or a BF16, F16 or F32 weight alone";
    if (quantizes) {
      const size_t scale_index = *layout.find(parameter.block_scale);
      const PartState& scale_state = parameters[scale_index].parts[part_index];
      WS_EXPECT(scale_state.received == 0 && !scale_state.complete, ErrorCode::kModel,
                "tensor " + std::string(view.name) + " arrives as " + std::string(dtype_name(view.dtype)) + " to be quantized into " +
                    target_text() + ", but its block scales " + parameter.parts[part_index].tensor +
                    "_scale_inv arrived in this " + what + " already" + mixed);
    } else if (auto weight = scaled_weight(layout, parameter)) {
      const PartState& weight_state = parameters[*weight].parts[part_index];
      WS_EXPECT(!weight_state.dtype || !quantizes_into(*weight_state.dtype, layout.parameters()[*weight]),
                ErrorCode::kModel,
                "tensor " + std::string(view.name) + " (block scales) arrives after its weight " +
                    layout.parameters()[*weight].parts[part_index].tensor + " arrived as " +
                    std::string(dtype_name(*weight_state.dtype)) + " to be quantized, in this " + what + mixed);
    }
  }

  /// Step 2: counts a checked batch and marks the parts, parameters and layers it completes
  /// (lock held). Returns whether its writes may be issued outside the lock: pieces copied
  /// as they are into their parts. Conversions gather on the host, and engine batches stay
  /// under the lock. With whole-layer commits, only the call that completes a layer writes
  /// it (the others hold their pieces), so its writes go outside the lock as well, unless a
  /// held piece it flushes needs the lock (may_write_unlocked()).
  bool account(const CheckedBatch& checked) {
    counters.tensors_skipped += checked.skipped;
    std::vector<size_t> completed;  // parameters this batch completes
    bool unlocked = format == TensorFormat::kCheckpoint;
    for (const Write& write : checked.writes) {
      const Parameter& parameter = layout.parameters()[write.parameter];
      ParameterState& parameter_state = parameters[write.parameter];
      parameter_state.touched = true;
      counters.bytes_applied += write.needed;
      if (format == TensorFormat::kEngine) {
        parameter_state.engine_received += write.needed;
        if (parameter_state.engine_received == parameter.bytes()) {
          ++counters.tensors_applied;
          completed.push_back(write.parameter);
        }
        continue;
      }
      if (write.dtype != parameter.load_dtype || write.changes) unlocked = false;
      account_part(write, completed);
    }
    for (size_t index : completed) {
      parameters[index].complete = true;
      ++counters.parameters_completed;
      ++layers[layout.parameters()[index].layer].complete;
    }
    return unlocked;
  }

  /// A checkpoint-format write's bytes in its part; a part it completes goes to `completed`
  /// with its parameter's last, and quantizing a part fills its block scales' part too.
  void account_part(const Write& write, std::vector<size_t>& completed) {
    const Parameter& parameter = layout.parameters()[write.parameter];
    ParameterState& parameter_state = parameters[write.parameter];
    PartState& part_state = parameter_state.parts[write.part];
    part_state.dtype = write.dtype;
    if (parameter.processing != Processing::kNone && parameter_state.staging.size() == 0) {
      // Processed parameters take their checkpoint-format bytes in staging; the kernel-format
      // storage is written only by processing, so a failed or partial load never leaves it half-new.
      parameter_state.staging = Buffer(parameter.device, parameter.elements() * element_bytes(parameter.load_dtype));
      fill_zero(parameter_state.staging.data(), parameter.device, parameter_state.staging.size());
    }
    const ParameterPart& part = parameter.parts[write.part];
    part_state.received += write.needed;
    if (part_state.received != slice_bytes(part, element_bytes(write.dtype))) return;
    part_state.complete = true;
    // A tensor may fill several parts (a sectioned split): it counts once, with its last.
    if (tensor_complete(part.tensor)) ++counters.tensors_applied;
    if (++parameter_state.parts_complete == parameter.parts.size()) completed.push_back(write.parameter);
    if (!quantizes_into(write.dtype, parameter)) return;
    const size_t scale_index = *layout.find(parameter.block_scale);
    const Parameter& scale = layout.parameters()[scale_index];
    ParameterState& scale_state = parameters[scale_index];
    PartState& scale_part = scale_state.parts[write.part];
    scale_part.dtype = scale.load_dtype;
    scale_part.received = slice_bytes(scale.parts[write.part], element_bytes(scale.load_dtype));
    scale_part.complete = true;
    scale_state.touched = true;
    if (++scale_state.parts_complete == scale.parts.size()) completed.push_back(scale_index);
  }

  /// The writes to issue now. `names` keeps the names of held pieces among them alive;
  /// `copies` are this call's held pieces to copy out of their sources, and `waits` the
  /// copies of other calls' held pieces among `writes`, to wait for before writing.
  struct Ready {
    std::vector<Write> writes;
    std::vector<std::shared_ptr<const std::string>> names;
    std::vector<std::shared_ptr<HeldCopy>> copies;
    std::vector<std::shared_future<void>> waits;

    /// Makes this call's held copies and waits for the others' (without the session's lock).
    void copy_held() {
      for (const auto& copy : copies) {
        try {
          copy_bytes(copy->destination, copy->destination_device, copy->source, kHost, copy->bytes);
        } catch (...) {
          copy->done.set_exception(std::current_exception());
          throw;
        }
        copy->done.set_value();
      }
      copies.clear();
      for (const auto& copied : waits) copied.get();  // rethrows a copy that was abandoned
    }
    /// A call that fails before its copies are made leaves their pieces unwritable: whoever
    /// flushes them gets this error rather than waiting for ever.
    ~Ready() {
      for (const auto& copy : copies) {
        copy->done.set_exception(std::make_exception_ptr(
            Error(ErrorCode::kModel, "a held piece was never copied: the load() call that held it failed")));
      }
    }
    Ready() = default;
    Ready(Ready&&) = default;
    Ready& operator=(Ready&&) = delete;
  };

  /// Step 3: with whole-layer commits, holds back each piece of a layer still incomplete,
  /// and a layer this batch completes takes its held pieces along (lock held).
  Ready hold(std::vector<Write> writes) {
    Ready ready;
    if (commit != LayerCommit::kWholeLayer) {
      ready.writes = std::move(writes);
      return ready;
    }
    std::set<int64_t> flushed;
    for (Write& write : writes) {
      LayerState& layer_state = layers[layout.parameters()[write.parameter].layer];
      if (!layer_state.complete_now()) {
        keep(Held{write, std::make_shared<const std::string>(write.name), {}}, ready);
        continue;
      }
      ready.writes.push_back(write);
      if (!flushed.insert(layout.parameters()[write.parameter].layer).second) continue;
      for (Held& held : layer_state.held) {
        ready.writes.push_back(held.write);
        ready.names.push_back(held.name);
        if (held.copied.valid()) ready.waits.push_back(held.copied);
      }
      // The held bytes live on in the writes' keepalives.
      layer_state.held.clear();
    }
    return ready;
  }

  /// Keeps a held piece with its layer: kept by reference when it stays valid for the whole
  /// load or while its keepalive lives, else copied out of its source, which may change after
  /// load() returns (host bytes by `ready`'s copy_held(), once the lock is let go).
  void keep(Held held, Ready& ready) {
    Write& write = held.write;
    write.name = *held.name;
    if (write.changes) {
      // The changed elements are the session's own: nothing to copy.
    } else if (write.lifetime == SourceLifetime::kLoad) {
      write.keepalive.reset();
    } else if (write.lifetime == SourceLifetime::kKeepalive && write.keepalive) {
      // The keepalive goes with the held write: nothing to copy.
    } else if (!write.device.is_cuda()) {
      counters.held_bytes_copied += source_bytes(write);
      auto pending = std::make_shared<HeldCopy>();
      std::shared_ptr<std::byte> copy = take_device_held(write);
      if (copy) {
        counters.held_bytes_on_device += source_bytes(write);
        pending->destination_device = held_device_bytes->device();
      } else {
        copy = held_bytes->take(source_bytes(write));
      }
      pending->destination = copy.get();
      pending->source = write.source;
      pending->bytes = source_bytes(write);
      held.copied = pending->copied;
      write.source = copy.get();
      write.device = pending->destination_device;
      write.keepalive = std::move(copy);
      ready.copies.push_back(std::move(pending));
    } else {
      counters.held_bytes_copied += write.end - write.begin;
      auto copy = std::make_shared<Buffer>(write.device, std::max<uint64_t>(write.end - write.begin, 1));
      copy_bytes(copy->data(), write.device, write.source, write.device, write.end - write.begin);
      wait_for_copies(write.device);
      write.source = copy->data();
      write.keepalive = std::move(copy);
    }
    layers[layout.parameters()[write.parameter].layer].held.push_back(std::move(held));
  }

  /// Gives back the memory of held pieces no write holds any more (the load ended).
  void release_held_bytes() {
    held_bytes->release();
    if (held_device_bytes) held_device_bytes->release();
  }

  /// Memory on the writer's GPU for a held piece from the host that is written as it is
  /// into a parameter on that GPU: it crosses now from its pinned staging, and lands by a
  /// device-to-device copy when its layer is whole. Null when the piece is converted on the
  /// host, its parameter lies elsewhere, or the GPU's pool is at its bound.
  std::shared_ptr<std::byte> take_device_held(const Write& write) {
    const Parameter& parameter = layout.parameters()[write.parameter];
    if (!held_device_bytes || parameter.device != held_device_bytes->device() || write.dtype != parameter.load_dtype) {
      return nullptr;
    }
    return held_device_bytes->take(source_bytes(write));
  }

  /// Whether `writes` (a batch's and the held pieces it flushes) are plain copies that may
  /// be issued outside the lock: no conversion, no changed elements (lock held).
  bool may_write_unlocked(std::span<const Write> writes) const {
    return std::ranges::none_of(writes, [&](const Write& write) {
      return write.changes || write.dtype != layout.parameters()[write.parameter].load_dtype;
    });
  }

  /// The layer of each checkpoint-format write, each counted as writing while `unlocked`
  /// writes are issued outside the lock (lock held).
  std::vector<int64_t> begin_writing(std::span<const Write> writes, bool unlocked) {
    std::vector<int64_t> written;
    if (format != TensorFormat::kCheckpoint) return written;
    written.reserve(writes.size());
    for (const Write& write : writes) {
      written.push_back(layout.parameters()[write.parameter].layer);
      if (unlocked) ++layers[written.back()].writing;
    }
    return written;
  }

  /// Step 4: issues the writes, every one through the writer.
  void write(std::span<const Write> writes) {
    if (format == TensorFormat::kEngine) return write_engine(writes);
    if (writes.size() > 1 && writer->asynchronous()) return write_checkpoint_batch(writes);
    for (const Write& write : writes) write_checkpoint(write);
  }

  /// Writes a batch of checkpoint-format pieces into a GPU's parameters: the plain ones (from
  /// the host, in the parameter's dtype) go to the writer together, so a read's small tensors
  /// and column windows land in one copy (ParameterWriter::copy_from_host()); pieces on this
  /// GPU quantized where they lie (a pushed BF16 update of an FP8 model) in as few launches
  /// as they allow; the rest one by one (write_checkpoint()).
  void write_checkpoint_batch(std::span<const Write> writes) {
    std::vector<model::ParameterWriter::HostCopy> copies;
    std::vector<std::shared_ptr<const void>> keepalives;
    const Write* first = nullptr;
    const Write* last = nullptr;
    std::vector<E4m3BlockJob> quantized;  // pieces on this GPU quantized where they lie
    for (const Write& write : writes) {
      Parameter& parameter = layout.mutable_parameter(write.parameter);
      if (write.device == writer->device() && parameter.device == writer->device() &&
          quantizes_into(write.dtype, parameter) && writer->quantizes_on_device()) {
        write_quantized_on_device(parameter, write, part_base(write), &quantized);
      } else if (write.changes || write.device.is_cuda() || write.dtype != parameter.load_dtype ||
                 parameter.device != writer->device()) {
        write_checkpoint(write);
        continue;
      }
      if (write.keepalive && (keepalives.empty() || keepalives.back() != write.keepalive)) {
        keepalives.push_back(write.keepalive);
      }
      if (!first) first = &write;
      last = &write;
      if (write.device.is_cuda()) continue;
      const uint64_t element = element_bytes(write.dtype);
      for_each_part_copy(part_base(write), parameter.parts[write.part], element, write,
                         [&](std::byte* destination, uint64_t destination_pitch, const std::byte* source,
                             uint64_t source_pitch, uint64_t width, uint64_t rows) {
                           copies.push_back(
                               {destination, destination_pitch, source, source_pitch, width, rows, write.keepalive.get()});
                         });
    }
    if (copies.empty() && quantized.empty()) return;
    std::shared_ptr<const void> keepalive;
    if (keepalives.size() == 1) {
      keepalive = std::move(keepalives.front());
    } else if (!keepalives.empty()) {
      keepalive = std::make_shared<std::vector<std::shared_ptr<const void>>>(std::move(keepalives));
    }
    const std::string what = first == last ? "tensor '" + std::string(first->name) + "'"
                                           : "tensors '" + std::string(first->name) + "' to '" +
                                                 std::string(last->name) + "' of one batch";
    if (!copies.empty()) writer->copy_from_host(copies, keepalive, what);
    if (!quantized.empty()) writer->quantize_e4m3(quantized, std::move(keepalive), writer->take_lane(), what);
  }

  /// Where a checkpoint-format write's part begins: in its parameter, or in the parameter's
  /// staging for processing.
  std::byte* part_base(const Write& write) {
    Parameter& parameter = layout.mutable_parameter(write.parameter);
    std::byte* base = parameter.processing != Processing::kNone ? parameters[write.parameter].staging.data()
                                                                 : parameter.data;
    return base + parameter.parts[write.part].element_offset * element_bytes(parameter.load_dtype);
  }

  /// Step 5 (lock held): layers whose last write has now been issued by every load() call
  /// are processed (cold and reload) once their copies have landed. An update may bring a
  /// layer in several buckets; its processing waits for finish().
  void end_writing(std::vector<int64_t> written, bool unlocked, LoadMode mode) {
    if (unlocked) {
      for (int64_t layer : written) --layers[layer].writing;
    }
    if (mode == LoadMode::kUpdate) return;
    std::sort(written.begin(), written.end());
    written.erase(std::unique(written.begin(), written.end()), written.end());
    for (int64_t layer : written) {
      LayerState& layer_state = layers[layer];
      if (layer_state.complete_now() && layer_state.writing == 0 && !layer_state.processed) process_layer(layer);
    }
  }

  model::ParameterWriter& writer_for(const Device& device) {
    if (!writer || writer->device() != device) {
      if (writer) writer->wait();
      writer.emplace(device);
      held_device_bytes = device.is_cuda() ? std::make_shared<HeldBytesPool>(device, kMostHeldDeviceBytes) : nullptr;
    }
    return *writer;
  }
};

LoadSession::LoadSession(ModelLayout& layout) : layout_(layout), state_(std::make_unique<State>(layout)) {}

LoadSession::~LoadSession() = default;  // the writer waits for its copies

LoadCounters LoadSession::counters() const {
  std::lock_guard lock(state_->mutex);
  return state_->counters;
}

std::vector<int64_t> LoadSession::completed_layers() const {
  std::lock_guard lock(state_->mutex);
  std::vector<int64_t> result;
  for (const auto& [layer, state] : state_->layers) {
    if (state.complete_now()) result.push_back(layer);
  }
  return result;
}

std::vector<int64_t> LoadSession::touched_layers() const {
  std::lock_guard lock(state_->mutex);
  std::set<int64_t> layers;
  for (size_t i = 0; i < state_->parameters.size(); ++i) {
    if (state_->parameters[i].touched) layers.insert(layout_.parameters()[i].layer);
  }
  return {layers.begin(), layers.end()};
}

LayerCommit default_layer_commit(LoadMode mode) noexcept {
  return mode == LoadMode::kCold ? LayerCommit::kAsArrived : LayerCommit::kWholeLayer;
}

void LoadSession::begin(LoadMode mode, TensorFormat format, std::optional<LayerCommit> commit) {
  std::lock_guard lock(state_->mutex);
  State& state = *state_;
  const std::string what = std::string(load_mode_name(mode)) + " load of " + layout_.description();
  // A load whose batch failed may be abandoned: begin() starts afresh (finish() would refuse).
  WS_EXPECT(!state.active || state.failure, ErrorCode::kModel,
            "cannot begin a " + what + ": the previous load has not finished");
  std::vector<std::string> unbound;
  for (const Parameter& parameter : layout_.parameters()) {
    if (parameter.data == nullptr) unbound.push_back(parameter.name);
  }
  WS_EXPECT(unbound.empty(), ErrorCode::kModel,
            "cannot begin a " + what + ": parameters without storage (allocate() or bind() them first): " +
                join(unbound, ", "));
  WS_EXPECT(mode == LoadMode::kCold || layout_.loads_finished() > 0, ErrorCode::kModel,
            "cannot begin a " + what + ": it has never been loaded; the first load must be cold");
  if (layout_.loads_finished() > 0) {
    for (const auto& hook : layout_.hooks()) {
      // Refuse here, before a byte is written: running the hook again would leave derived
      // state stale or wrong, and stopping after the weights changed would be worse.
      WS_EXPECT(hook->rerunnable(), ErrorCode::kModel,
                "cannot begin a " + what + ": model hook '" + hook->name() +
                    "' declares that it cannot run twice, and this layout has already been loaded; "
                    "rebuild the model instead of reloading it");
    }
  }
  model::ParameterWriter& writer = state.writer_for(layout_.device());
  state.format = format;
  state.commit = commit.value_or(default_layer_commit(mode));
  state.counters = {};
  state.failure.reset();
  // Reset in place: a session reused for update after update (a receiver's) does this for
  // every parameter before the first byte of each update can land.
  state.parameters.resize(layout_.parameters().size());
  for (auto& [layer, layer_state] : state.layers) layer_state = {};
  auto layer_entry = state.layers.end();  // parameters come layer by layer: one lookup a layer
  for (size_t i = 0; i < layout_.parameters().size(); ++i) {
    const Parameter& parameter = layout_.parameters()[i];
    State::ParameterState& parameter_state = state.parameters[i];
    parameter_state.parts.assign(parameter.parts.size(), State::PartState{});
    parameter_state.parts_complete = 0;
    parameter_state.engine_received = 0;
    parameter_state.touched = parameter_state.complete = parameter_state.processed = false;
    parameter_state.staging = Buffer();
    bool filled = format == TensorFormat::kEngine || !parameter.parts.empty();
    if (!filled) continue;
    if (layer_entry == state.layers.end() || layer_entry->first != parameter.layer) {
      layer_entry = state.layers.try_emplace(parameter.layer).first;
    }
    ++layer_entry->second.parameters;
  }
  std::erase_if(state.layers, [](const auto& entry) { return entry.second.parameters == 0; });
  // Parts that hold no rows on this rank (a vocabulary slice wholly in padding) are complete
  // before any byte arrives.
  if (format == TensorFormat::kCheckpoint) {
    for (size_t i = 0; i < layout_.parameters().size(); ++i) {
      const Parameter& parameter = layout_.parameters()[i];
      State::ParameterState& parameter_state = state.parameters[i];
      for (size_t p = 0; p < parameter.parts.size(); ++p) {
        if (parameter.parts[p].elements() > 0) continue;
        parameter_state.parts[p].complete = true;
        ++parameter_state.parts_complete;
      }
      if (!parameter.parts.empty() && parameter_state.parts_complete == parameter.parts.size()) {
        parameter_state.complete = true;
        ++state.layers[parameter.layer].complete;
      }
    }
  }
  if (mode == LoadMode::kCold) {
    writer.wait();  // nothing of an earlier load may land on the zeroed padding
    for (const Parameter& parameter : layout_.parameters()) {
      for (const auto& [begin, end] : parameter.padding) fill_zero(parameter.data + begin, parameter.device, end - begin);
    }
  }
  mode_ = mode;
  commit_ = state.commit;
  state.active = true;
}

std::byte* LoadSession::direct_destination(std::string_view tensor, Dtype dtype, std::span<const int64_t> shape,
                                           uint64_t offset, uint64_t bytes, bool gpu_source) const {
  std::lock_guard lock(state_->mutex);
  const State& state = *state_;
  if (!state.active || state.format != TensorFormat::kCheckpoint || state.commit != LayerCommit::kAsArrived) return nullptr;
  TensorRoute route = layout_.route(tensor);
  if (route.kind != TensorRoute::Kind::kParameter || route.targets.size() != 1) return nullptr;
  const Parameter& parameter = layout_.parameters()[route.targets[0].first];
  const ParameterPart& part = parameter.parts[route.targets[0].second];
  if ((parameter.device.is_cuda() && !gpu_source) || parameter.processing != Processing::kNone ||
      dtype != parameter.dtype || !part.contiguous() || !std::ranges::equal(shape, part.shape)) {
    return nullptr;
  }
  uint64_t row_bytes = static_cast<uint64_t>(part.tensor_columns()) * element_bytes(dtype);
  uint64_t needed_begin = static_cast<uint64_t>(part.row_begin) * row_bytes;
  uint64_t needed_end = needed_begin + static_cast<uint64_t>(part.rows) * row_bytes;
  if (offset < needed_begin || offset + bytes > needed_end) return nullptr;
  return parameter.data + part.element_offset * element_bytes(dtype) + (offset - needed_begin);
}

void LoadSession::check(std::span<const TensorView> batch) const {
  std::lock_guard lock(state_->mutex);
  State& state = *state_;
  const std::string what = std::string(load_mode_name(mode_)) + " load of " + layout_.description();
  WS_EXPECT(state.active, ErrorCode::kModel, "check() outside begin()/finish() on " + layout_.description());
  (void)state.check(batch, what);
}

void LoadSession::load(std::span<const TensorView> batch) {
  std::unique_lock lock(state_->mutex);
  State& state = *state_;
  const std::string what = std::string(load_mode_name(mode_)) + " load of " + layout_.description();
  WS_EXPECT(state.active, ErrorCode::kModel, "load() outside begin()/finish() on " + layout_.description());
  if (state.failure) {
    WS_FAIL(state.failure->code, "cannot go on with the " + what + ": an earlier batch failed (" +
                                     state.failure->message + "); begin() a new load");
  }
  bool wrote = false;
  try {
    State::CheckedBatch checked = state.check(batch, what);
    bool unlocked = state.account(checked);
    State::Ready ready = state.hold(std::move(checked.writes));
    unlocked = unlocked && state.may_write_unlocked(ready.writes);
    std::vector<int64_t> layers = state.begin_writing(ready.writes, unlocked);
    wrote = true;
    if (unlocked) lock.unlock();  // the reader threads of a stream copy in parallel
    ready.copy_held();
    state.write(ready.writes);
    if (checked.waits && state.writer->asynchronous()) state.writer->wait();
    if (!lock.owns_lock()) lock.lock();
    state.end_writing(std::move(layers), unlocked, mode_);
  } catch (const Error& error) {
    if (!lock.owns_lock()) lock.lock();
    if (!state.failure) state.failure = State::Failure{error.code(), error.what(), wrote};
    throw;
  }
}

void LoadSession::settle() {
  std::lock_guard lock(state_->mutex);
  state_->settle();
}

void LoadSession::finish() {
  std::unique_lock lock(state_->mutex);
  State& state = *state_;
  const std::string what = std::string(load_mode_name(mode_)) + " load of " + layout_.description();
  WS_EXPECT(state.active, ErrorCode::kModel, "finish() without begin() on " + layout_.description());
  if (state.failure) {
    state.active = false;
    for (auto& [layer, layer_state] : state.layers) layer_state.held.clear();
    try {
      state.settle();
    } catch (const Error&) {
      // The batch's error is the one the caller sees.
    }
    state.release_held_bytes();
    std::string state_text = state.failure->wrote ? "" : "nothing of that batch was written; ";
    if (state.commit == LayerCommit::kWholeLayer) {
      state_text += "layers not completed before the failure keep their old values";
    } else if (state.failure->wrote) {
      state_text += "the layers it was writing may hold a mix of old and new values (commit per layer, "
                    "LayerCommit::kWholeLayer, keeps unfinished layers as they were)";
    } else {
      state_text += "tensors of earlier batches were written";
    }
    WS_FAIL(state.failure->code, "cannot finish the " + what + ": a batch failed (" + state.failure->message + "); " +
                                     state_text + "; begin() a new load");
  }
  // A reload or update may leave out tensors, but not part of one: that is a sender's or a
  // stream's fault, found before held pieces are written.
  if (mode_ != LoadMode::kCold) {
    std::vector<std::string> partial;
    for (size_t i = 0; i < layout_.parameters().size(); ++i) {
      const Parameter& parameter = layout_.parameters()[i];
      const State::ParameterState& parameter_state = state.parameters[i];
      if (state.format == TensorFormat::kEngine) {
        if (parameter_state.engine_received > 0 && parameter_state.engine_received < parameter.bytes()) {
          partial.push_back(parameter.name + " (" + std::to_string(parameter_state.engine_received) + " of " +
                            std::to_string(parameter.bytes()) + " bytes)");
        }
        continue;
      }
      for (size_t p = 0; p < parameter.parts.size(); ++p) {
        const State::PartState& part_state = parameter_state.parts[p];
        if (part_state.received == 0 || part_state.complete) continue;
        const ParameterPart& part = parameter.parts[p];
        uint64_t needed = slice_bytes(part, element_bytes(part_state.dtype.value_or(parameter.load_dtype)));
        partial.push_back(part.tensor + " (" + std::to_string(part_state.received) + " of the " +
                          std::to_string(needed) + " bytes " + parameter.name + " needs)");
      }
    }
    if (!partial.empty()) {
      state.active = false;
      for (auto& [layer, layer_state] : state.layers) layer_state.held.clear();
      state.release_held_bytes();
      size_t count = partial.size();
      if (partial.size() > 10) partial.resize(10);
      WS_FAIL(ErrorCode::kModel, what + ": " + std::to_string(count) + " tensor" + (count == 1 ? "" : "s") +
                                     " arrived in part (a load may leave out a tensor, not part of one): " +
                                     join(partial, ", "));
    }
  }
  // Layers a load covers only in part (an update of some tensors) are written now.
  std::vector<State::Held> rest;
  for (auto& [layer, layer_state] : state.layers) {
    for (State::Held& held : layer_state.held) rest.push_back(std::move(held));
    layer_state.held.clear();
  }
  try {
    std::vector<State::Write> writes;
    for (State::Held& held : rest) {
      if (held.copied.valid()) held.copied.get();  // made by a load() call that has returned
      writes.push_back(held.write);
    }
    if (state.format == TensorFormat::kCheckpoint) {
      for (const State::Write& write : writes) state.write_checkpoint(write);
    } else {
      state.write_engine(writes);
    }
    writes.clear();
    rest.clear();
    state.settle();
  } catch (const Error&) {
    state.active = false;
    throw;
  }

  // Completeness: a cold load names every parameter still missing, grouped by layer.
  std::map<int64_t, std::vector<std::string>> missing;
  for (size_t i = 0; i < layout_.parameters().size(); ++i) {
    const Parameter& parameter = layout_.parameters()[i];
    const State::ParameterState& parameter_state = state.parameters[i];
    bool filled = state.format == TensorFormat::kEngine || !parameter.parts.empty();
    if (!filled || parameter_state.complete) continue;
    bool required = mode_ == LoadMode::kCold ||
                    (parameter.processing != Processing::kNone && parameter_state.touched &&
                     state.format == TensorFormat::kCheckpoint);
    if (!required) continue;
    std::vector<std::string> parts;
    for (size_t p = 0; p < parameter.parts.size(); ++p) {
      if (!parameter_state.parts[p].complete && parameter_state.touched) parts.push_back(parameter.parts[p].tensor);
    }
    missing[parameter.layer].push_back(parameter.name + (parts.empty() ? "" : " (missing " + join(parts, ", ") + ")"));
  }
  if (!missing.empty()) {
    std::vector<std::string> groups;
    for (const auto& [layer, names] : missing) {
      groups.push_back(layer_label(layout_, layer) + " weights missing: " + join(names, ", "));
    }
    state.active = false;
    WS_FAIL(ErrorCode::kModel,
            mode_ == LoadMode::kCold
                ? what + " is incomplete: " + join(groups, "; ")
                : what + ": FP8-processed parameters need every part in checkpoint format to be requantized: " +
                      join(groups, "; "));
  }

  for (auto& [layer, layer_state] : state.layers) {
    if (state.format == TensorFormat::kCheckpoint && !layer_state.processed) state.process_layer(layer);
  }
  state.writer->wait();
  state.release_held_bytes();
  for (const auto& hook : layout_.hooks()) {
    hook->run(layout_);
    ++state.counters.model_hook_runs;
    ++layout_.model_hook_runs_;
  }
  ++layout_.loads_finished_;
  state.active = false;
}

}  // namespace weightstream
