// Parameter and ModelLayout: the parameters of one rank, their storage, routes from
// checkpoint tensor names, and the audit helpers that read them back.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <tuple>
#include <unordered_map>

#include "weightstream/error.hpp"
#include "weightstream/model.hpp"

namespace weightstream {
namespace {

uint64_t product(std::span<const int64_t> dimensions) {
  uint64_t result = 1;
  for (int64_t dimension : dimensions) result *= static_cast<uint64_t>(dimension);
  return result;
}

/// Glob match where '*' matches any run of characters (ignore rules).
bool glob_match(std::string_view pattern, std::string_view text) {
  size_t p = 0, t = 0, star = std::string_view::npos, resume = 0;
  while (t < text.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = t;
    } else if (p < pattern.size() && pattern[p] == text[t]) {
      ++p;
      ++t;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      t = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

/// Parameters start on 256-byte boundaries in a layout's arena: what CUDA allocations
/// guarantee and what vectorized kernels and DLPack consumers expect.
constexpr uint64_t kParameterAlignment = 256;

/// Hash of std::string keys that also takes std::string_view (heterogeneous lookup): name
/// lookups run per tensor on the update path, where std::map's string compares showed.
struct NameHash {
  using is_transparent = void;
  size_t operator()(std::string_view text) const noexcept { return std::hash<std::string_view>{}(text); }
};

}  // namespace

struct ModelLayout::NameIndex {
  std::unordered_map<std::string, size_t, NameHash, std::equal_to<>> map;
};

int64_t ParameterPart::tensor_rows() const noexcept { return shape.empty() ? 1 : shape[0]; }

int64_t ParameterPart::tensor_columns() const noexcept {
  return shape.size() <= 1 ? 1 : static_cast<int64_t>(product(std::span(shape).subspan(1)));
}

uint64_t Parameter::elements() const noexcept { return product(shape); }

uint64_t Parameter::bytes() const noexcept { return elements() * (dtype_bits(dtype) / 8); }

std::string layer_label(const ModelLayout& layout, int64_t layer) {
  switch (layout.layer_kind(layer)) {
    case LayerKind::kGlobal: return "global";
    case LayerKind::kMtp: return "MTP layer " + std::to_string(layer);
    case LayerKind::kDecoder: break;
  }
  return "layer " + std::to_string(layer);
}

ModelLayout::ModelLayout() : by_name_(std::make_unique<NameIndex>()) {}
ModelLayout::~ModelLayout() = default;
ModelLayout::ModelLayout(ModelLayout&&) noexcept = default;
ModelLayout& ModelLayout::operator=(ModelLayout&&) noexcept = default;

size_t ModelLayout::add_parameter(Parameter parameter) {
  const std::string& name = parameter.name;
  WS_EXPECT(!name.empty(), ErrorCode::kModel, "a parameter of " + description_ + " has an empty name");
  WS_EXPECT(!by_name_->map.contains(name), ErrorCode::kModel,
            "parameter " + name + " is declared twice in " + description_);
  WS_EXPECT(dtype_bits(parameter.dtype) % 8 == 0 && dtype_bits(parameter.load_dtype) % 8 == 0, ErrorCode::kModel,
            "parameter " + name + ": sub-byte dtypes are not supported as parameter storage");
  WS_EXPECT(loads_finished_ == 0, ErrorCode::kModel,
            "cannot add parameter " + name + " to " + description_ + " after it has been loaded");
  for (int64_t dimension : parameter.shape) {
    WS_EXPECT(dimension >= 0, ErrorCode::kModel, "parameter " + name + " has a negative dimension");
  }
  // Every part must lie inside its tensor and inside the parameter, and parts must not
  // overlap: the rows no part fills are padding.
  std::vector<std::pair<uint64_t, uint64_t>> covered;
  for (const ParameterPart& part : parameter.parts) {
    std::string where = "part '" + part.id + "' (tensor " + part.tensor + ") of parameter " + name;
    WS_EXPECT(!part.tensor.empty(), ErrorCode::kModel, where + " names no tensor");
    WS_EXPECT(part.row_begin >= 0 && part.rows >= 0 && part.row_begin + part.rows <= part.tensor_rows() &&
                  part.column_begin >= 0 && part.columns >= 0 &&
                  part.column_begin + part.columns <= part.tensor_columns(),
              ErrorCode::kModel, where + ": slice rows " + std::to_string(part.row_begin) + "+" +
                                     std::to_string(part.rows) + ", columns " + std::to_string(part.column_begin) +
                                     "+" + std::to_string(part.columns) + " lies outside tensor shape " +
                                     shape_text(part.shape));
    WS_EXPECT(part.element_offset + part.elements() <= parameter.elements(), ErrorCode::kModel,
              where + ": elements " + std::to_string(part.element_offset) + "+" + std::to_string(part.elements()) +
                  " lie outside parameter shape " + shape_text(parameter.shape));
    covered.emplace_back(part.element_offset, part.element_offset + part.elements());
  }
  std::sort(covered.begin(), covered.end());
  uint64_t element_bytes = dtype_bits(parameter.dtype) / 8;
  uint64_t cursor = 0;
  parameter.padding.clear();
  for (const auto& [begin, end] : covered) {
    WS_EXPECT(begin >= cursor, ErrorCode::kModel,
              "parameter " + name + ": two parts fill element " + std::to_string(begin));
    if (begin > cursor) parameter.padding.emplace_back(cursor * element_bytes, begin * element_bytes);
    cursor = end;
  }
  if (!covered.empty() && cursor < parameter.elements()) {
    parameter.padding.emplace_back(cursor * element_bytes, parameter.elements() * element_bytes);
  }
  if (parameter.processing == Processing::kNone) parameter.load_dtype = parameter.dtype;
  size_t index = parameters_.size();
  for (size_t part = 0; part < parameter.parts.size(); ++part) {
    by_tensor_.emplace(parameter.parts[part].tensor, std::make_pair(index, part));
  }
  by_name_->map.emplace(name, index);
  parameters_.push_back(std::move(parameter));
  bound_.push_back(false);
  return index;
}

void ModelLayout::set_layer_kind(int64_t layer, LayerKind kind) { layer_kinds_[layer] = kind; }

LayerKind ModelLayout::layer_kind(int64_t layer) const noexcept {
  if (layer < 0) return LayerKind::kGlobal;
  auto it = layer_kinds_.find(layer);
  return it == layer_kinds_.end() ? LayerKind::kDecoder : it->second;
}

void ModelLayout::add_ignore_rule(std::string pattern) { ignore_rules_.push_back(std::move(pattern)); }

void ModelLayout::add_skipped_tensor(std::string name, std::string reason) {
  skipped_.insert_or_assign(std::move(name), std::move(reason));
}

std::optional<size_t> ModelLayout::find(std::string_view name) const {
  if (!by_name_) return std::nullopt;  // a moved-from layout
  auto it = by_name_->map.find(name);
  if (it == by_name_->map.end()) return std::nullopt;
  return it->second;
}

const Parameter& ModelLayout::parameter(std::string_view name) const {
  auto index = find(name);
  WS_EXPECT(index.has_value(), ErrorCode::kNotFound,
            "parameter " + std::string(name) + " is not in " + description_);
  return parameters_[*index];
}

std::vector<size_t> ModelLayout::layer_parameters(int64_t layer) const {
  std::vector<size_t> indices;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (parameters_[i].layer == layer) indices.push_back(i);
  }
  return indices;
}

std::vector<int64_t> ModelLayout::layers() const {
  std::vector<int64_t> result;
  for (const Parameter& parameter : parameters_) result.push_back(parameter.layer);
  std::sort(result.begin(), result.end());
  result.erase(std::unique(result.begin(), result.end()), result.end());
  return result;
}

TensorRoute ModelLayout::route(std::string_view tensor) const {
  TensorRoute route;
  auto [begin, end] = by_tensor_.equal_range(tensor);
  for (auto it = begin; it != end; ++it) route.targets.push_back(it->second);
  if (!route.targets.empty()) {
    route.kind = TensorRoute::Kind::kParameter;
    return route;
  }
  if (auto it = skipped_.find(tensor); it != skipped_.end()) {
    route.kind = TensorRoute::Kind::kSkipped;
    route.reason = it->second;
    return route;
  }
  for (const std::string& rule : ignore_rules_) {
    if (glob_match(rule, tensor)) {
      route.kind = TensorRoute::Kind::kIgnored;
      route.reason = "ignore rule " + rule;
      return route;
    }
  }
  return route;
}

std::vector<std::string> ModelLayout::wanted_tensors() const {
  std::vector<std::string> names;
  for (auto it = by_tensor_.begin(); it != by_tensor_.end(); it = by_tensor_.upper_bound(it->first)) {
    names.push_back(it->first);
  }
  return names;
}

void ModelLayout::set_device(const Device& device) {
  WS_EXPECT(!device_fixed_ || device == device_, ErrorCode::kDevice,
            "cannot place the storage of " + description_ + " on " + device.name() + ": it already lives on " +
                device_.name() + " (set_device, allocate or bind)");
  device_ = device;
  device_fixed_ = true;
}

void ModelLayout::allocate(const Device& device, ArenaContents contents) {
  set_device(device);
  std::vector<size_t> unbound;
  uint64_t total = 0;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (parameters_[i].data != nullptr) continue;
    unbound.push_back(i);
    total += (std::max<uint64_t>(parameters_[i].bytes(), 1) + kParameterAlignment - 1) / kParameterAlignment *
             kParameterAlignment;
  }
  if (unbound.empty()) return;
  // One arena: one allocation (and one zeroing) however many parameters there are, where
  // a cudaMalloc each cost 10,000 driver calls for a layout of 10,000 tensors. A
  // zero-sized parameter still gets a distinct, stable address.
  Buffer arena(device, total);
  // Host memory comes zero-filled (page by page, as the load first touches it); device
  // memory does not.
  if (device.is_cuda() && contents == ArenaContents::kZeroed) fill_zero(arena.data(), device, arena.size());
  uint64_t offset = 0;
  for (size_t i : unbound) {
    Parameter& parameter = parameters_[i];
    parameter.data = arena.data() + offset;
    parameter.device = device;
    offset += (std::max<uint64_t>(parameter.bytes(), 1) + kParameterAlignment - 1) / kParameterAlignment * kParameterAlignment;
  }
  storage_.push_back(std::move(arena));
}

ModelLayout::ArenaContents ModelLayout::cold_load_contents() const {
  for (const Parameter& parameter : parameters_) {
    if (parameter.data == nullptr && parameter.parts.empty()) return ArenaContents::kZeroed;
  }
  return ArenaContents::kUnwritten;
}

namespace {

std::string address_text(const void* address) {
  char text[32];
  std::snprintf(text, sizeof(text), "%p", address);
  return text;
}

}  // namespace

void ModelLayout::bind(std::string_view name, const TensorView& tensor) {
  TensorView named = tensor;
  named.name = name;
  bind(std::span<const TensorView>(&named, 1));
}

void ModelLayout::bind(std::span<const TensorView> tensors) {
  // Every check runs before anything changes: a failed bind leaves the layout as it was.
  struct Range {
    uintptr_t begin = 0;
    uintptr_t end = 0;
    Device device;
    size_t index = 0;
    bool incoming = true;  ///< being bound now (false: bound before)
  };
  std::vector<Range> ranges;
  std::vector<size_t> indices;
  std::vector<bool> seen(parameters_.size());  // by parameter index
  std::optional<Device> device = device_fixed_ ? std::optional(device_) : std::nullopt;
  for (const TensorView& tensor : tensors) {
    const std::string name(tensor.name);
    auto index = find(name);
    WS_EXPECT(index.has_value(), ErrorCode::kNotFound,
              "cannot bind parameter " + name + ": it is not in " + description_);
    const Parameter& parameter = parameters_[*index];
    const std::string what = "cannot bind parameter " + name + " of " + description_ + ": ";
    WS_EXPECT(loads_finished_ == 0, ErrorCode::kModel,
              what + "the layout has been loaded, and storage never moves after the first load "
                     "(captured CUDA graphs would read freed memory)");
    WS_EXPECT(!seen[*index], ErrorCode::kModel, what + "two tensors are given for it");
    seen[*index] = true;
    WS_EXPECT(parameter.data == nullptr, ErrorCode::kModel,
              what + (bound(*index) ? "it is already bound (to memory at " + address_text(parameter.data) + ")"
                                    : std::string("it already has storage (allocated by the layout, or shared); "
                                                  "bind before allocate() and before the first load")));
    WS_EXPECT(tensor.dtype == parameter.dtype, ErrorCode::kModel,
              what + "expected dtype " + std::string(dtype_name(parameter.dtype)) + ", given " +
                  std::string(dtype_name(tensor.dtype)));
    WS_EXPECT(std::equal(tensor.shape.begin(), tensor.shape.end(), parameter.shape.begin(), parameter.shape.end()),
              ErrorCode::kModel,
              what + "expected shape " + shape_text(parameter.shape) + ", given " +
                  shape_text(tensor.shape));
    WS_EXPECT(tensor.offset == 0 && tensor.bytes == parameter.bytes(), ErrorCode::kModel,
              what + "expected " + std::to_string(parameter.bytes()) + " bytes from offset 0, given " +
                  std::to_string(tensor.bytes) + " bytes from offset " + std::to_string(tensor.offset));
    WS_EXPECT(tensor.data != nullptr, ErrorCode::kModel, what + "expected memory, given a null address");
    if (!device) device = tensor.device;
    WS_EXPECT(tensor.device == *device, ErrorCode::kModel,
              what + "expected memory on " + device->name() + " (where the layout's storage lives), given memory on " +
                  tensor.device.name());
    // The element size is the least alignment typed access needs (a CUDA kernel reading a
    // BF16 at an odd address faults); engine allocations are far more aligned than that.
    uint64_t alignment = std::max<uint64_t>(dtype_bits(parameter.dtype) / 8, 1);
    auto address = reinterpret_cast<uintptr_t>(tensor.data);
    WS_EXPECT(address % alignment == 0, ErrorCode::kModel,
              what + "expected an address aligned to " + std::to_string(alignment) + " bytes (" +
                  std::string(dtype_name(parameter.dtype)) + " elements), given " + address_text(tensor.data));
    indices.push_back(*index);
    if (tensor.bytes > 0) ranges.push_back({address, address + tensor.bytes, tensor.device, *index});
  }
  // Two parameters in one memory would overwrite each other's bytes on every load. Bound
  // memory never overlaps (this check keeps it so), so sorted by address, an overlap shows
  // between neighbours.
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const Parameter& parameter = parameters_[i];
    if (bound(i) && parameter.bytes() > 0) {
      auto address = reinterpret_cast<uintptr_t>(parameter.data);
      ranges.push_back({address, address + parameter.bytes(), parameter.device, i, false});
    }
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return std::tie(a.device.kind, a.device.index, a.begin) < std::tie(b.device.kind, b.device.index, b.begin);
  });
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i - 1].device != ranges[i].device || ranges[i].begin >= ranges[i - 1].end) continue;
    // Name the parameter being bound; the other may be one bound before.
    const Range& given = ranges[i].incoming ? ranges[i] : ranges[i - 1];
    const Range& owner = ranges[i].incoming ? ranges[i - 1] : ranges[i];
    WS_FAIL(ErrorCode::kModel, "cannot bind parameter " + parameters_[given.index].name + " of " + description_ +
                                   ": expected memory of its own, given memory at " +
                                   address_text(reinterpret_cast<void*>(given.begin)) + " that overlaps parameter " +
                                   parameters_[owner.index].name + "'s (" +
                                   address_text(reinterpret_cast<void*>(owner.begin)) + "+" +
                                   std::to_string(owner.end - owner.begin) + " bytes)");
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    Parameter& parameter = parameters_[indices[i]];
    // Written by every load: the view's const is the session's promise, not the memory's.
    parameter.data = const_cast<std::byte*>(tensors[i].data);
    parameter.device = tensors[i].device;
    bound_[indices[i]] = true;
  }
  if (device && !tensors.empty()) {
    device_ = *device;
    device_fixed_ = true;
  }
}

std::vector<std::string> ModelLayout::bound_names() const {
  std::vector<std::string> names;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (bound(i)) names.push_back(parameters_[i].name);
  }
  return names;
}

std::vector<std::string> ModelLayout::unbound_names() const {
  std::vector<std::string> names;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (!bound(i)) names.push_back(parameters_[i].name);
  }
  return names;
}

void ModelLayout::share_storage(std::string_view name, const Parameter& owner, const std::string& reason) {
  auto index = find(name);
  WS_EXPECT(index.has_value(), ErrorCode::kNotFound,
            "cannot share parameter " + std::string(name) + ": it is not in " + description_);
  Parameter& parameter = parameters_[*index];
  WS_EXPECT(loads_finished_ == 0, ErrorCode::kModel,
            "cannot share parameter " + parameter.name + " of " + description_ +
                " after it has been loaded: storage never moves");
  WS_EXPECT(owner.data != nullptr, ErrorCode::kModel,
            "cannot share parameter " + parameter.name + " with " + owner.name + ": " + owner.name + " has no storage");
  WS_EXPECT(owner.dtype == parameter.dtype && owner.shape == parameter.shape, ErrorCode::kModel,
            "cannot share parameter " + parameter.name + " (" + std::string(dtype_name(parameter.dtype)) + " " +
                shape_text(parameter.shape) + ") with " + owner.name + " (" + std::string(dtype_name(owner.dtype)) +
                " " + shape_text(owner.shape) + ")");
  // Its tensors are read by the owner's layout, not this one: route them as skipped.
  for (auto it = by_tensor_.begin(); it != by_tensor_.end();) {
    it = it->second.first == *index ? by_tensor_.erase(it) : std::next(it);
  }
  for (const ParameterPart& part : parameter.parts) skipped_.insert_or_assign(part.tensor, reason);
  parameter.parts.clear();
  parameter.padding.clear();
  bound_[*index] = false;
  parameter.data = owner.data;
  parameter.device = owner.device;
}

void ModelLayout::expect_untouched(const std::string& what) const {
  bool untouched = loads_finished_ == 0 && storage_.empty() && hooks_.empty() &&
                   std::none_of(bound_.begin(), bound_.end(), [](bool bound) { return bound; });
  WS_EXPECT(untouched, ErrorCode::kModel, what + ": storage was bound or allocated, a hook added or a load run already");
}

void ModelLayout::redeclare(std::vector<Parameter> parameters) {
  parameters_.clear();
  bound_.clear();
  by_tensor_.clear();
  by_name_->map.clear();
  for (Parameter& parameter : parameters) add_parameter(std::move(parameter));
}

void ModelLayout::remove_parameter(std::string_view name, const std::string& reason) {
  auto index = find(name);
  WS_EXPECT(index.has_value(), ErrorCode::kNotFound,
            "cannot remove parameter " + std::string(name) + ": it is not in " + description_);
  expect_untouched("cannot remove parameter " + std::string(name) + " from " + description_);
  std::vector<Parameter> kept;
  kept.reserve(parameters_.size() - 1);
  std::vector<std::string> orphans;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (i == *index) {
      for (const ParameterPart& part : parameters_[i].parts) orphans.push_back(part.tensor);
      continue;
    }
    kept.push_back(std::move(parameters_[i]));
  }
  redeclare(std::move(kept));
  for (std::string& tensor : orphans) {
    if (!by_tensor_.contains(tensor)) skipped_.insert_or_assign(std::move(tensor), reason);
  }
}

namespace {

/// The dtypes a load converts between as it writes (LoadSession's conversions).
bool converts_on_write(Dtype dtype) { return dtype == Dtype::kBF16 || dtype == Dtype::kF16 || dtype == Dtype::kF32; }

}  // namespace

void ModelLayout::hold_as(std::string_view name, Dtype dtype) {
  auto index = find(name);
  WS_EXPECT(index.has_value(), ErrorCode::kNotFound,
            "cannot hold parameter " + std::string(name) + " in another dtype: it is not in " + description_);
  expect_untouched("cannot hold parameter " + std::string(name) + " of " + description_ + " in " +
                   std::string(dtype_name(dtype)));
  const Parameter& parameter = parameters_[*index];
  bool scale = std::any_of(parameters_.begin(), parameters_.end(),
                           [&](const Parameter& other) { return other.block_scale == parameter.name; });
  WS_EXPECT(converts_on_write(dtype) && converts_on_write(parameter.dtype) &&
                parameter.processing == Processing::kNone && parameter.block_scale.empty() && !scale,
            ErrorCode::kModel,
            "cannot hold parameter " + std::string(name) + " of " + description_ + " (" +
                std::string(dtype_name(parameter.dtype)) + ") in " + std::string(dtype_name(dtype)) +
                ": only an unprocessed float parameter, neither FP8 block-scaled nor a block scale, is held in "
                "another of F16, BF16 and F32");
  std::vector<Parameter> parameters = std::move(parameters_);
  parameters[*index].dtype = dtype;
  parameters[*index].load_dtype = dtype;
  redeclare(std::move(parameters));
}

uint64_t ModelLayout::allocated_bytes() const noexcept {
  uint64_t total = 0;
  for (const Buffer& buffer : storage_) total += buffer.size();
  return total;
}

std::byte* ModelLayout::allocate_derived(uint64_t bytes) {
  Buffer buffer(device_, std::max<uint64_t>(bytes, 1));
  if (device_.is_cuda()) fill_zero(buffer.data(), device_, buffer.size());
  std::byte* data = buffer.data();
  storage_.push_back(std::move(buffer));
  return data;
}

void ModelLayout::add_hook(std::unique_ptr<ModelHook> hook) {
  WS_EXPECT(hook != nullptr, ErrorCode::kInvalidArgument, "add_hook: null hook for " + description_);
  hook->attach(*this);
  hooks_.push_back(std::move(hook));
}

std::vector<std::byte> parameter_bytes(const Parameter& parameter) {
  std::vector<std::byte> bytes(parameter.bytes());
  WS_EXPECT(parameter.data != nullptr || bytes.empty(), ErrorCode::kModel,
            "parameter " + parameter.name + " has no storage");
  if (!bytes.empty()) copy_bytes(bytes.data(), Device{}, parameter.data, parameter.device, bytes.size());
  return bytes;
}

namespace {

std::vector<std::byte> derived_bytes(const DerivedBuffer& buffer) {
  std::vector<std::byte> bytes(buffer.bytes);
  if (!bytes.empty()) copy_bytes(bytes.data(), Device{}, buffer.data, buffer.device, bytes.size());
  return bytes;
}

std::map<std::string, DerivedBuffer> derived_by_name(const ModelLayout& layout) {
  std::map<std::string, DerivedBuffer> result;
  for (const auto& hook : layout.hooks()) {
    for (DerivedBuffer& buffer : hook->derived_buffers()) result.emplace(buffer.name, buffer);
  }
  return result;
}

}  // namespace

LayoutComparison compare_layouts(const ModelLayout& a, const ModelLayout& b) {
  LayoutComparison result;
  auto mismatch = [&](const std::string& name) {
    ++result.mismatched;
    if (result.mismatches.size() < 20) result.mismatches.push_back(name);
  };
  for (const Parameter& parameter : a.parameters()) {
    ++result.compared;
    auto other = b.find(parameter.name);
    if (!other) {
      mismatch(parameter.name);
      continue;
    }
    const Parameter& twin = b.parameters()[*other];
    if (twin.dtype != parameter.dtype || twin.shape != parameter.shape ||
        parameter_bytes(parameter) != parameter_bytes(twin)) {
      mismatch(parameter.name);
    }
  }
  auto theirs = derived_by_name(b);
  for (const auto& [name, buffer] : derived_by_name(a)) {
    ++result.compared;
    auto it = theirs.find(name);
    if (it == theirs.end() || derived_bytes(buffer) != derived_bytes(it->second)) mismatch(name);
  }
  for (const Parameter& parameter : b.parameters()) {
    if (!a.find(parameter.name)) {
      ++result.compared;
      mismatch(parameter.name);
    }
  }
  return result;
}

std::map<std::string, const std::byte*> storage_addresses(const ModelLayout& layout) {
  std::map<std::string, const std::byte*> addresses;
  for (const Parameter& parameter : layout.parameters()) addresses.emplace(parameter.name, parameter.data);
  for (const auto& [name, buffer] : derived_by_name(layout)) addresses.emplace(name, buffer.data);
  return addresses;
}

}  // namespace weightstream
