// weightstream._core: bindings of the model layer (ModelLayout, LoadSession) for engines
// that apply loads, reloads and updates from Python. Tensors come in through DLPack.
#include "bindings.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "weightstream/error.hpp"
#include "weightstream/load.hpp"
#include "weightstream/model.hpp"
#include "weightstream/source.hpp"
#include "weightstream/stream.hpp"
#include "weightstream/transfer.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace weightstream::python {
namespace {

using Code = nb::dlpack::dtype_code;

}  // namespace

std::optional<Dtype> dlpack_dtype(const nb::dlpack::dtype& dtype) {
  if (dtype.lanes != 1) return std::nullopt;
  switch (static_cast<Code>(dtype.code)) {
    case Code::Bool: return dtype.bits == 8 ? std::optional(Dtype::kBool) : std::nullopt;
    case Code::Int:
      switch (dtype.bits) {
        case 8: return Dtype::kI8;
        case 16: return Dtype::kI16;
        case 32: return Dtype::kI32;
        case 64: return Dtype::kI64;
      }
      return std::nullopt;
    case Code::UInt:
      switch (dtype.bits) {
        case 8: return Dtype::kU8;
        case 16: return Dtype::kU16;
        case 32: return Dtype::kU32;
        case 64: return Dtype::kU64;
      }
      return std::nullopt;
    case Code::Float:
      switch (dtype.bits) {
        case 16: return Dtype::kF16;
        case 32: return Dtype::kF32;
        case 64: return Dtype::kF64;
      }
      return std::nullopt;
    case Code::Bfloat: return dtype.bits == 16 ? std::optional(Dtype::kBF16) : std::nullopt;
    case Code::Complex: return dtype.bits == 64 ? std::optional(Dtype::kC64) : std::nullopt;
    case Code::Float8_E4M3FN: return Dtype::kF8E4M3;
    case Code::Float8_E5M2: return Dtype::kF8E5M2;
    case Code::Float8_E4M3FNUZ: return Dtype::kF8E4M3Fnuz;
    case Code::Float8_E5M2FNUZ: return Dtype::kF8E5M2Fnuz;
    case Code::Float8_E8M0FNU: return Dtype::kF8E8M0;
    default: return std::nullopt;
  }
}

Device dlpack_device(int device_type, int device_id) {
  if (device_type == nb::device::cuda::value) return Device{Device::Kind::kCuda, device_id};
  return Device{};
}

namespace {

struct LayoutHandle;

/// Every live layout that holds Python hooks (touched only with the GIL).
std::set<LayoutHandle*>& layouts_with_hooks() {
  static auto* layouts = new std::set<LayoutHandle*>();  // never freed: used until the very end
  return *layouts;
}

/// A ModelLayout owned by Python; sessions and parameter views keep it alive.
struct LayoutHandle {
  ModelLayout layout;
  /// Python callables of hooks added with add_hook. The layout's hooks hold them; they
  /// are listed here so the garbage collector sees them (a hook closing over its own
  /// layout is a cycle that only tp_traverse/tp_clear can break).
  std::vector<std::shared_ptr<nb::object>> python_hooks;
  /// The Python tensors bound to parameters, held so they outlive the layout, and the
  /// DLPack imports of them: those hold the memory itself, even if the engine later points
  /// its tensor elsewhere (torch's `param.data = ...`).
  std::vector<nb::object> bound_objects;
  std::vector<nb::ndarray<>> bound_arrays;
  /// Set by model_layout(device=...): what is left unbound is allocated on the layout's
  /// device at the first load (or the first tensor() view), so binds may come first.
  bool allocate_at_first_load = false;
  /// What from_config built it with (parallel ranks, quantize), for a peer server's manifest.
  LayoutOptions options;

  ~LayoutHandle() { layouts_with_hooks().erase(this); }
  /// Drops the Python callables; a cleared hook does nothing if it runs again.
  void release_python_hooks() {
    for (auto& hook : python_hooks) *hook = nb::none();
  }

  /// Allocates what is left unbound when a device was given and that has not happened yet.
  /// Allocates the storage deferred by allocate_at_first_load: for a cold load, unzeroed
  /// where the load writes every byte or throws (ModelLayout::cold_load_contents); zeroed
  /// for anything else (a reload, an update, a parameter read before any load).
  void ensure_storage(bool for_cold_load = false) {
    if (!allocate_at_first_load) return;
    layout.allocate(layout.device(),
                    for_cold_load ? layout.cold_load_contents() : ModelLayout::ArenaContents::kZeroed);
    allocate_at_first_load = false;
  }
};

/// Drops the Python callables of every layout's hooks. Run at interpreter exit (atexit):
/// a module-level layout whose hook refers to the module's globals is a cycle through the
/// module, which nothing frees before nanobind counts what is still alive (and prints
/// "leaked N instances"); without the hooks the module's teardown frees the layout.
void release_all_python_hooks() {
  for (LayoutHandle* layout : layouts_with_hooks()) layout->release_python_hooks();
}

int layout_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  auto* handle = nb::inst_ptr<LayoutHandle>(self);
  for (const auto& hook : handle->python_hooks) Py_VISIT(hook->ptr());
  for (const auto& object : handle->bound_objects) Py_VISIT(object.ptr());
  return 0;
}

int layout_clear(PyObject* self) {
  if (!nb::inst_ready(self)) return 0;
  auto* handle = nb::inst_ptr<LayoutHandle>(self);
  handle->release_python_hooks();
  // The DLPack imports in bound_arrays still hold the bound memory.
  handle->bound_objects.clear();
  return 0;
}

/// One tensor to bind, after its DLPack import was checked.
struct BindingTensor {
  std::string name;  ///< the parameter
  nb::object object;  ///< what the caller passed (a torch Parameter, a numpy array, ...)
  nb::ndarray<> array;
  std::vector<int64_t> shape;
  TensorView view;
};

/// Imports `object` (any DLPack tensor, or a buffer-protocol object) for binding to
/// parameter `name`, with the checks only the Python side can make: a writable tensor,
/// contiguous, on a device weightstream writes, of a dtype safetensors names. A uint8 array
/// of shape [*shape, itemsize] stands for the raw bytes of a BF16 or F8 parameter (numpy
/// has no such dtype; layout.tensor() gives the same). The layout checks the rest.
BindingTensor binding_tensor(const ModelLayout& layout, const std::string& name, nb::handle object) {
  auto index = layout.find(name);
  WS_EXPECT(index.has_value(), ErrorCode::kNotFound,
            "cannot bind parameter " + name + ": it is not in " + layout.description());
  const Parameter& parameter = layout.parameters()[*index];
  const std::string what = "cannot bind parameter " + name + " of " + layout.description() + ": ";
  BindingTensor tensor;
  tensor.name = name;
  tensor.object = nb::borrow(object);
  nb::object source = tensor.object;
  // torch refuses to export a tensor that requires grad; its detached view is the same memory.
  if (nb::hasattr(source, "requires_grad") && nb::hasattr(source, "detach") &&
      nb::cast<bool>(source.attr("requires_grad"))) {
    source = source.attr("detach")();
  }
  if (!nb::try_cast(source, tensor.array, false)) {
    nb::ndarray<nb::ro> read_only;
    WS_EXPECT(!nb::try_cast(source, read_only, false), ErrorCode::kModel,
              what + "expected a writable tensor (every load writes into it), given a read-only " +
                  std::string(nb::type_name(source.type()).c_str()));
    WS_FAIL(ErrorCode::kModel, what + "expected a DLPack tensor (torch, numpy, cupy), given " +
                                   std::string(nb::type_name(source.type()).c_str()));
  }
  const auto& array = tensor.array;
  for (size_t i = 0; i < array.ndim(); ++i) tensor.shape.push_back(static_cast<int64_t>(array.shape(i)));
  int device_type = array.device_type();
  WS_EXPECT(device_type == nb::device::cpu::value || device_type == nb::device::cuda::value ||
                device_type == nb::device::cuda_host::value,
            ErrorCode::kModel,
            what + "expected memory on the host or a CUDA device, given memory on DLPack device type " +
                std::to_string(device_type));
  // Loads write row-major bytes: a transposed or sliced view would receive them scrambled.
  int64_t expected_stride = 1;
  for (size_t i = array.ndim(); i-- > 0;) {
    if (array.shape(i) > 1 && array.stride(i) != expected_stride) {
      std::vector<int64_t> strides;
      for (size_t j = 0; j < array.ndim(); ++j) strides.push_back(array.stride(j));
      WS_FAIL(ErrorCode::kModel, what + "expected a contiguous (row-major) tensor, given shape " +
                                     shape_text(tensor.shape) + " with strides " + shape_text(strides) +
                                     " (in elements); bind the tensor itself, not a transposed or sliced view");
    }
    expected_stride *= static_cast<int64_t>(array.shape(i));
  }
  auto dtype = dlpack_dtype(array.dtype());
  uint64_t itemsize = dtype_bits(parameter.dtype) / 8;
  if (dtype == Dtype::kU8 && parameter.dtype != Dtype::kU8 && tensor.shape.size() == parameter.shape.size() + 1 &&
      tensor.shape.back() == static_cast<int64_t>(itemsize)) {
    tensor.shape.pop_back();  // raw bytes of [*shape, itemsize]
    dtype = parameter.dtype;
  }
  WS_EXPECT(dtype.has_value(), ErrorCode::kModel,
            what + "expected dtype " + std::string(dtype_name(parameter.dtype)) +
                ", given a DLPack dtype safetensors has no name for (code " + std::to_string(array.dtype().code) +
                ", " + std::to_string(array.dtype().bits) + " bits, " + std::to_string(array.dtype().lanes) +
                " lanes)");
  tensor.view.dtype = *dtype;
  tensor.view.data = static_cast<const std::byte*>(array.data());
  tensor.view.device = dlpack_device(device_type, array.device_id());
  tensor.view.offset = 0;
  tensor.view.bytes = array.nbytes();
  return tensor;
}

/// Binds the tensors (checked all together first), then holds them for the layout.
void bind_tensors(LayoutHandle& handle, std::vector<BindingTensor>& tensors) {
  handle.layout.bind(views_of(tensors));
  for (auto& tensor : tensors) {
    handle.bound_objects.push_back(std::move(tensor.object));
    handle.bound_arrays.push_back(std::move(tensor.array));
  }
}

/// layout.bind_many, and layout.bind with one pair: checks every (name, tensor) pair, then
/// binds them all at once (nothing is bound when one is refused).
void bind_pairs(LayoutHandle& handle, nb::iterable pairs) {
  std::vector<BindingTensor> tensors;
  for (nb::handle entry : pairs) {
    if (!nb::isinstance<nb::tuple>(entry) || nb::len(entry) != 2) {
      throw nb::type_error("bind_many: expected (name, tensor) pairs");
    }
    nb::tuple pair = nb::borrow<nb::tuple>(entry);
    tensors.push_back(binding_tensor(handle.layout, nb::cast<std::string>(pair[0]), pair[1]));
  }
  bind_tensors(handle, tensors);
}

/// "a, b, c, d, e (and 12 more)".
std::string first_names(const std::vector<std::string>& names, size_t count = 5) {
  std::string text;
  for (size_t i = 0; i < names.size() && i < count; ++i) text += (i ? ", " : "") + names[i];
  if (names.empty()) text = "(none)";
  if (names.size() > count) text += " (and " + std::to_string(names.size() - count) + " more)";
  return text;
}

/// layout.bind_module: binds every parameter and buffer of `module` whose prefixed name is
/// a layout parameter; returns their names, in the module's order.
std::vector<std::string> bind_module(LayoutHandle& handle, nb::handle module, std::string prefix) {
  const ModelLayout& layout = handle.layout;
  std::string type = nb::type_name(module.type()).c_str();
  WS_EXPECT(nb::hasattr(module, "named_parameters") && nb::hasattr(module, "named_buffers"),
            ErrorCode::kInvalidArgument,
            "bind_module: expected a module with named_parameters() and named_buffers() (a torch.nn.Module), given " +
                type);
  if (!prefix.empty() && prefix.back() != '.') prefix += '.';  // as torch joins names
  std::vector<std::string> module_names;
  std::vector<BindingTensor> tensors;
  for (const char* method : {"named_parameters", "named_buffers"}) {
    for (nb::handle item : module.attr(method)()) {
      nb::tuple pair = nb::cast<nb::tuple>(item);
      std::string name = prefix + nb::cast<std::string>(pair[0]);
      module_names.push_back(name);
      if (layout.find(name)) tensors.push_back(binding_tensor(layout, name, pair[1]));
    }
  }
  if (tensors.empty()) {
    std::vector<std::string> layout_names;
    for (const Parameter& parameter : layout.parameters()) layout_names.push_back(parameter.name);
    WS_FAIL(ErrorCode::kModel, "bind_module: none of the " + std::to_string(module_names.size()) +
                                   " parameters and buffers of " + type + " (with prefix '" + prefix +
                                   "') is one of the " + std::to_string(layout_names.size()) + " parameters of " +
                                   layout.description() + ": the module has " + first_names(module_names) +
                                   "; the layout has " + first_names(layout_names));
  }
  bind_tensors(handle, tensors);
  std::vector<std::string> names;
  for (const auto& tensor : tensors) names.push_back(tensor.name);
  return names;
}

PyType_Slot layout_slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(layout_traverse)},
                              {Py_tp_clear, reinterpret_cast<void*>(layout_clear)},
                              {0, nullptr}};


/// A view of parameter `name`'s storage: a DLPack array, or a torch.Tensor made by the core
/// where `torch` asks and the dtype allows (tensor_object).
nb::object parameter_array(nb::handle layout_object, const std::string& name, TorchTensors torch) {
  auto& handle = nb::cast<LayoutHandle&>(layout_object);
  auto& layout = handle.layout;
  const auto& parameter = layout.parameter(name);
  if (parameter.data == nullptr) handle.ensure_storage();
  WS_EXPECT(parameter.data != nullptr, ErrorCode::kModel,
            "parameter '" + name + "' of " + layout.description() + " has no storage yet: call allocate() or bind()");
  CheckpointTensor shape_only;
  shape_only.name = parameter.name;
  shape_only.dtype = parameter.dtype;
  shape_only.shape = parameter.shape;
  shape_only.bytes = parameter.bytes();
  // The view holds the layout object: the storage lives as long as the layout does.
  return tensor_object(parameter.data, shape_only, parameter.device, layout_object, torch);
}

}  // namespace

nb::dict stats_dict(const std::vector<StatField>& fields) {
  nb::dict result;
  for (const StatField& field : fields) {
    std::visit([&](auto value) { result[nb::str(field.name.data(), field.name.size())] = value; }, field.value);
  }
  return result;
}

ModelLayout& python_layout(nb::handle layout) { return nb::cast<LayoutHandle&>(layout).layout; }

void ensure_python_storage(nb::handle layout, bool for_cold_load) {
  nb::cast<LayoutHandle&>(layout).ensure_storage(for_cold_load);
}

const LayoutOptions& python_layout_options(nb::handle layout) { return nb::cast<LayoutHandle&>(layout).options; }

namespace {

/// The layout options of from_config's arguments.
LayoutOptions layout_options(int64_t tp_size, int64_t tp_rank, int64_t ep_size, int64_t ep_rank,
                             const std::optional<std::string>& dtype, const std::string& quantize,
                             const std::string& modules) {
  LayoutOptions options;
  options.parallel = {tp_size, tp_rank, ep_size, ep_rank};
  if (dtype) {
    auto parsed = dtype_from_name(*dtype);
    WS_EXPECT(parsed.has_value(), ErrorCode::kInvalidArgument, "unknown safetensors dtype '" + *dtype + "'");
    options.dtype = parsed;
  }
  if (quantize == "fp8") options.quantize = Processing::kFp8PerTensor;
  else WS_EXPECT(quantize == "none", ErrorCode::kInvalidArgument, "quantize '" + quantize + "' is not one of none, fp8");
  // "all" is two modules, two layouts: python/weightstream/_model.py builds both.
  if (modules == "draft") options.modules = LayoutModules::kDraft;
  else WS_EXPECT(modules == "target", ErrorCode::kInvalidArgument, "modules '" + modules + "' is not one of target, draft");
  return options;
}

/// The engine_layout options of from_config's and from_source's arguments.
EngineLayoutOptions engine_options(int64_t tp_size, int64_t tp_rank, int64_t ep_size, int64_t ep_rank,
                                   const std::optional<std::string>& dtype, const std::string& quantize,
                                   const std::string& modules, const std::optional<std::string>& device, bool hooks) {
  EngineLayoutOptions options;
  options.layout = layout_options(tp_size, tp_rank, ep_size, ep_rank, dtype, quantize, modules);
  WS_EXPECT(!hooks || device, ErrorCode::kInvalidArgument,
            "model hooks allocate their derived buffers when they attach: hooks=True needs a device");
  if (hooks) {
    options.device = parse_device(*device);
    require_device(*options.device);
  }
  return options;
}

nb::object layout_object(ModelLayout layout, const LayoutOptions& options) {
  auto handle = std::make_unique<LayoutHandle>();
  handle->layout = std::move(layout);
  handle->options = options;
  return nb::cast(handle.release(), nb::rv_policy::take_ownership);
}

/// ModelLayout.from_config: the library's engine_layout of a config.json, as the command builds it.
nb::object layout_from_config(const std::string& config_json, int64_t tp_size, int64_t tp_rank, int64_t ep_size,
                              int64_t ep_rank, const std::optional<std::string>& dtype, const std::string& quantize,
                              const std::string& modules, const CheckpointHandle* checkpoint,
                              const std::optional<std::string>& device, bool hooks) {
  EngineLayoutOptions options =
      engine_options(tp_size, tp_rank, ep_size, ep_rank, dtype, quantize, modules, device, hooks);
  std::vector<std::string_view> names;
  std::string object = "config.json";
  if (checkpoint != nullptr) {
    for (const CheckpointTensor& tensor : checkpoint->checkpoint().tensors()) names.push_back(tensor.name);
    object = checkpoint->checkpoint().uri() + "/config.json";
  }
  return layout_object(engine_layout(parse_model_config(object, config_json), object, names, options), options.layout);
}

/// ModelLayout.from_source: the engine_layout of each of `modules` of the source `uri` names
/// (open_source: a checkpoint, or serving peers, asked for their config.json once).
nb::list layouts_from_source(const std::string& uri, int64_t tp_size, int64_t tp_rank, int64_t ep_size,
                             int64_t ep_rank, const std::optional<std::string>& dtype, const std::string& quantize,
                             const std::vector<std::string>& modules, const std::optional<std::string>& device,
                             bool hooks) {
  std::unique_ptr<Source> source = open_source(uri, source_options(environment_options()));
  nb::list layouts;
  for (const std::string& module : modules) {
    EngineLayoutOptions options =
        engine_options(tp_size, tp_rank, ep_size, ep_rank, dtype, quantize, module, device, hooks);
    ModelLayout layout;
    {
      nb::gil_scoped_release release;
      layout = source->layout(options);
    }
    layouts.append(layout_object(std::move(layout), options.layout));
  }
  return layouts;
}

}  // namespace

namespace {

using LayoutClass = nb::class_<LayoutHandle>;

/// ModelLayout.from_config, from_source and identity: the library's layouts.
void bind_layout_construction(LayoutClass& layout) {
  layout
      .def_static("from_config", &layout_from_config, "config_json"_a, "tp_size"_a = 1, "tp_rank"_a = 0,
                  "ep_size"_a = 1, "ep_rank"_a = 0, "dtype"_a = nb::none(), "quantize"_a = "none",
                  "modules"_a = "target", nb::kw_only(), "checkpoint"_a.none() = nb::none(), "device"_a = nb::none(),
                  "hooks"_a = false,
                  "engine_layout of a config.json: checked against `checkpoint`'s tensors when given; with "
                  "`hooks` (which needs `device`) allocated there with the engine's model hooks.")
      .def_static("from_source", &layouts_from_source, "uri"_a, "tp_size"_a = 1, "tp_rank"_a = 0, "ep_size"_a = 1,
                  "ep_rank"_a = 0, "dtype"_a = nb::none(), "quantize"_a = "none",
                  "modules"_a = std::vector<std::string>{"target"}, nb::kw_only(), "device"_a = nb::none(),
                  "hooks"_a = false,
                  "engine_layout of each of `modules` of the source `uri` names (a checkpoint directory or URI, or "
                  "serving peers), as from_config builds it.")
      .def_static(
          "identity",
          [](const CheckpointHandle& checkpoint) {
            auto* handle = new LayoutHandle();
            handle->layout = identity_layout(checkpoint.checkpoint());
            return handle;
          },
          "checkpoint"_a, nb::rv_policy::take_ownership);
}

/// What a layout holds: its parameters, where a tensor goes, its loads and hooks.
void bind_layout_inspection(LayoutClass& layout) {
  layout
      .def_prop_ro("description", [](const LayoutHandle& handle) { return handle.layout.description(); })
      .def_prop_ro("parameter_names",
                   [](const LayoutHandle& handle) {
                     std::vector<std::string> names;
                     for (const auto& parameter : handle.layout.parameters()) names.push_back(parameter.name);
                     return names;
                   })
      .def_prop_ro("parameters",
                   [](const LayoutHandle& handle) {
                     nb::list table;
                     for (const auto& parameter : handle.layout.parameters()) {
                       nb::list shape;
                       for (int64_t extent : parameter.shape) shape.append(extent);
                       table.append(nb::make_tuple(parameter.name, std::string(dtype_name(parameter.dtype)),
                                                   nb::tuple(shape)));
                     }
                     return table;
                   },
                   "(name, safetensors dtype, shape tuple) of every parameter, in layout order.")
      .def("parameter_info",
           [](const LayoutHandle& handle, const std::string& name) {
             const auto& parameter = handle.layout.parameter(name);
             nb::dict info;
             info["name"] = parameter.name;
             info["dtype"] = std::string(dtype_name(parameter.dtype));
             info["shape"] = parameter.shape;
             info["layer"] = parameter.layer;
             info["bytes"] = parameter.bytes();
             info["device"] = parameter.device.name();
             nb::list parts;
             for (const ParameterPart& part : parameter.parts) {
               nb::dict entry;
               entry["tensor"] = part.tensor;
               entry["id"] = part.id;
               entry["row_begin"] = part.row_begin;
               entry["rows"] = part.rows;
               entry["column_begin"] = part.column_begin;
               entry["columns"] = part.columns;
               parts.append(entry);
             }
             // The checkpoint slices that fill it (tensor, its rows and columns on this rank).
             info["parts"] = parts;
             return info;
           },
           "name"_a)
      .def("route",
           [](const LayoutHandle& handle, const std::string& tensor) {
             TensorRoute route = handle.layout.route(tensor);
             const char* kind = "unmatched";
             switch (route.kind) {
               case TensorRoute::Kind::kParameter: kind = "parameter"; break;
               case TensorRoute::Kind::kIgnored: kind = "ignored"; break;
               case TensorRoute::Kind::kSkipped: kind = "skipped"; break;
               case TensorRoute::Kind::kUnmatched: break;
             }
             std::vector<std::string> parameters;
             for (const auto& [parameter, part] : route.targets) {
               const std::string& name = handle.layout.parameters()[parameter].name;
               if (parameters.empty() || parameters.back() != name) parameters.push_back(name);
             }
             return nb::make_tuple(kind, parameters, route.reason);
           },
           "tensor"_a,
           "Where a checkpoint tensor goes: (kind, parameter names, reason), kind one of parameter, ignored, "
           "skipped, unmatched.")
      .def_prop_ro("loads_finished", [](const LayoutHandle& handle) { return handle.layout.loads_finished(); })
      .def_prop_ro("model_hook_runs", [](const LayoutHandle& handle) { return handle.layout.model_hook_runs(); })
      .def_prop_ro("allocated_bytes", [](const LayoutHandle& handle) { return handle.layout.allocated_bytes(); })
      .def_prop_ro(
          "hooks",
          [](const LayoutHandle& handle) {
            std::vector<std::string> names;
            for (const auto& hook : handle.layout.hooks()) names.push_back(hook->name());
            return names;
          },
          "The names of the layout's model hooks, in the order they run.");
}

/// What an engine changes before it binds: tensors left to it, shared, removed or held wider.
void bind_layout_shaping(LayoutClass& layout) {
  layout
      .def("skip_unmatched",
           [](LayoutHandle& handle, const CheckpointHandle& checkpoint, const std::string& reason) {
             // One pass in C++ over every tensor of the checkpoint (thousands for a MoE model).
             std::vector<std::string> names;
             for (const CheckpointTensor& tensor : checkpoint.checkpoint().tensors()) {
               TensorRoute route = handle.layout.route(tensor.name);
               if (route.kind == TensorRoute::Kind::kUnmatched) {
                 handle.layout.add_skipped_tensor(tensor.name, reason);
                 names.push_back(tensor.name);
               } else if (route.kind == TensorRoute::Kind::kSkipped && route.reason == reason) {
                 names.push_back(tensor.name);
               }
             }
             return names;
           },
           "checkpoint"_a, "reason"_a,
           "Declares every tensor of `checkpoint` that the layout has no parameter or rule for as skipped "
           "with `reason` (add_skipped_tensor), and returns, in file order, those and the tensors skipped "
           "with `reason` before: the tensors a load leaves to the caller for that reason.")
      .def("add_skipped_tensor",
           [](LayoutHandle& handle, const std::string& tensor, const std::string& reason) {
             handle.layout.add_skipped_tensor(tensor, reason);
           },
           "tensor"_a, "reason"_a,
           "Declares a checkpoint tensor this layout never reads (loads leave it to the caller).")
      .def("share_storage",
           [](LayoutHandle& handle, const std::string& name, const std::string& owner, const std::string& reason) {
             handle.layout.share_storage(name, handle.layout.parameter(owner), reason);
           },
           "name"_a, "owner"_a, "reason"_a,
           "Makes parameter `name` a reference to parameter `owner`'s storage (a tied lm_head bound to the "
           "engine's embedding): loads no longer fill it or check it.")
      .def("remove_parameter",
           [](LayoutHandle& handle, const std::string& name, const std::string& reason) {
             handle.layout.remove_parameter(name, reason);
           },
           "name"_a, "reason"_a,
           "Removes parameter `name` (the engine fills it by other means): the layout never allocates, fills "
           "or checks it, and its checkpoint tensors that fill no other parameter are skipped with `reason`. "
           "Only before anything is bound or allocated.")
      .def("hold_as",
           [](LayoutHandle& handle, const std::string& name, const std::string& dtype) {
             auto parsed = dtype_from_name(dtype);
             WS_EXPECT(parsed.has_value(), ErrorCode::kInvalidArgument,
                       "cannot hold parameter " + name + " in '" + dtype + "': not a safetensors dtype");
             handle.layout.hold_as(name, *parsed);
           },
           "name"_a, "dtype"_a,
           "Holds parameter `name` in `dtype` (\"F32\", \"BF16\", \"F16\"), another float dtype than its "
           "rule's (an engine that keeps a BF16 checkpoint's MoE router in F32): its parts convert as they are "
           "written. Only an unprocessed float parameter, not FP8 block-scaled, before anything is bound or "
           "allocated.");
}

/// Storage: allocated by the layout, or the engine's own tensors bound; views of it.
void bind_layout_storage(LayoutClass& layout) {
  layout
      .def("allocate",
           [](LayoutHandle& handle, const std::string& device) {
             auto parsed = parse_device(device);
             nb::gil_scoped_release release;
             handle.layout.allocate(parsed);
           },
           "device"_a = "cpu")
      .def("allocate_at_first_load",
           [](LayoutHandle& handle, const std::string& device) {
             auto parsed = parse_device(device);
             require_device(parsed);
             handle.layout.set_device(parsed);
             handle.allocate_at_first_load = true;
           },
           "device"_a,
           "Fixes the layout's device; what is left unbound is allocated there at the first load "
           "(model_layout(device=...) calls this).")
      .def("bind",
           [](LayoutHandle& handle, const std::string& name, nb::handle tensor) {
             bind_pairs(handle, nb::borrow<nb::iterable>(nb::make_tuple(nb::make_tuple(name, tensor))));
           },
           "name"_a, "tensor"_a,
           "Binds an engine's tensor (any writable, contiguous DLPack tensor: torch, numpy, cupy; host or "
           "CUDA) to parameter `name`: every load writes into it in place.")
      .def("bind_many", &bind_pairs, "pairs"_a,
           "Binds every (name, tensor) pair as bind() does, in one call: all are checked first, and "
           "nothing is bound when one is refused (its error names it).")
      .def("bind_module", &bind_module, "module"_a, "prefix"_a = "",
           "Binds every parameter and buffer of `module` (named_parameters(), named_buffers()) whose "
           "prefixed name is a parameter of the layout; returns the names bound.")
      .def_prop_ro("bound_names", [](const LayoutHandle& handle) { return handle.layout.bound_names(); })
      .def_prop_ro("unbound_names", [](const LayoutHandle& handle) { return handle.layout.unbound_names(); })
      .def(
          "_view",
          [](nb::handle layout, const std::string& name, const std::string& torch) {
            return parameter_array(layout, name, parse_torch_tensors(torch));
          },
          "name"_a, "torch"_a = "none",
          "A view of a parameter's storage (valid while the layout lives): a DLPack array, or with torch='all' a "
          "torch.Tensor where the core makes one (ModelLayout.tensor wraps it).")
      .def(
          "_views",
          [](nb::handle layout, const std::string& torch) {
            const TorchTensors parsed = parse_torch_tensors(torch);
            nb::dict views;
            for (const Parameter& parameter : python_layout(layout).parameters()) {
              views[nb::str(parameter.name.c_str())] = parameter_array(layout, parameter.name, parsed);
            }
            return views;
          },
          "torch"_a = "none", "Every parameter's view (see _view), by name, in layout order.");
}

/// Model hooks: the tied lm_head, and hooks written in Python.
void bind_layout_hooks(LayoutClass& layout) {
  layout
      .def("add_tied_lm_head_hook", [](LayoutHandle& handle) { handle.layout.add_hook(make_tied_lm_head_hook()); })
      .def("add_hook",
           [](LayoutHandle& handle, const std::string& name, nb::callable run, bool rerunnable) {
             // The session calls hooks with the GIL released; a Python hook takes it back,
             // and its exception becomes a weightstream error with the Python message.
             auto function = std::make_shared<nb::object>(std::move(run));
             handle.python_hooks.push_back(function);
             layouts_with_hooks().insert(&handle);
             handle.layout.add_hook(make_model_hook(
                 name,
                 [function, name](ModelLayout&) {
                   nb::gil_scoped_acquire acquire;
                   if (function->is_none()) return;
                   try {
                     (*function)();
                   } catch (nb::python_error& error) {
                     // The type and message, not what(): that is the whole traceback.
                     std::string raised = nb::type_name(error.type()).c_str();
                     raised += ": " + std::string(nb::str(error.value()).c_str());
                     WS_FAIL(ErrorCode::kModel, "model hook '" + name + "' raised " + raised);
                   }
                 },
                 rerunnable));
           },
           "name"_a, "run"_a, "rerunnable"_a = true);
}


}  // namespace

void bind_model(nb::module_& m) {
  LayoutClass layout(m, "ModelLayout", nb::type_slots(layout_slots));
  bind_layout_construction(layout);
  bind_layout_inspection(layout);
  bind_layout_shaping(layout);
  bind_layout_storage(layout);
  bind_layout_hooks(layout);
  m.def("supported_model_types", &supported_model_types,
        "The model_types weightstream has mapping tables for, comma-separated.");
  m.def("_release_python_hooks", &release_all_python_hooks,
        "Drops the Python callables of every layout's model hooks (registered with atexit).");
}

}  // namespace weightstream::python
