// weightstream._core: bindings of the model layer (ModelLayout, LoadSession) for engines
// that apply loads, reloads and updates from Python. Tensors come in through DLPack.
#include "bindings.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <vector>

#include "weightstream/error.hpp"
#include "weightstream/load.hpp"
#include "weightstream/model.hpp"
#include "weightstream/stream.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace weightstream::python {
namespace {

using Code = nb::dlpack::dtype_code;

/// The safetensors dtype of a DLPack dtype; nullopt for one safetensors lacks.
std::optional<Dtype> dtype_of(const nb::dlpack::dtype& dtype) {
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

Device device_of(int device_type, int device_id) {
  if (device_type == nb::device::cuda::value) return Device{Device::Kind::kCuda, device_id};
  return Device{};
}

/// A batch entry after its DLPack array was checked: the view LoadSession::load takes,
/// and the storage the view points into.
struct BatchTensor {
  std::string name;
  std::vector<int64_t> shape;
  nb::ndarray<nb::ro> array;  // keeps the memory alive for the call
  TensorView view;
};

/// Checks one (name, tensor[, dtype]) entry. `dtype` (a safetensors name) reinterprets the
/// bytes: needed for the raw uint8 [*shape, itemsize] arrays weightstream gives for BF16 and
/// F8 without torch, whose trailing itemsize axis is dropped.
BatchTensor batch_tensor(nb::handle entry) {
  nb::tuple tuple = nb::cast<nb::tuple>(entry);
  if (tuple.size() != 2 && tuple.size() != 3) throw nb::type_error("batch entries are (name, tensor) or (name, tensor, dtype)");
  BatchTensor tensor;
  tensor.name = nb::cast<std::string>(tuple[0]);
  tensor.array = nb::cast<nb::ndarray<nb::ro>>(tuple[1], false);
  const auto& array = tensor.array;
  // Bytes are read in row-major order: a transposed or sliced view would be read wrongly.
  int64_t expected_stride = 1;
  for (size_t i = array.ndim(); i-- > 0;) {
    WS_EXPECT(array.shape(i) <= 1 || array.stride(i) == expected_stride, ErrorCode::kInvalidArgument,
              "tensor '" + tensor.name + "' is not contiguous (row-major); pass tensor.contiguous()");
    expected_stride *= static_cast<int64_t>(array.shape(i));
  }
  for (size_t i = 0; i < array.ndim(); ++i) tensor.shape.push_back(static_cast<int64_t>(array.shape(i)));
  auto dtype = dtype_of(array.dtype());
  if (tuple.size() == 3 && !tuple[2].is_none()) {
    auto name = nb::cast<std::string>(tuple[2]);
    auto declared = dtype_from_name(name);
    WS_EXPECT(declared.has_value(), ErrorCode::kInvalidArgument,
              "tensor '" + tensor.name + "': unknown safetensors dtype '" + name + "'");
    unsigned bits = dtype_bits(*declared);
    if (dtype != declared && bits % 8 == 0 && bits > 8 && dtype == Dtype::kU8 && !tensor.shape.empty() &&
        tensor.shape.back() == static_cast<int64_t>(bits / 8)) {
      tensor.shape.pop_back();  // raw bytes of [*shape, itemsize]
    }
    dtype = declared;
  }
  WS_EXPECT(dtype.has_value(), ErrorCode::kInvalidArgument,
            "tensor '" + tensor.name + "' has a dtype safetensors has no name for; pass (name, tensor, dtype)");
  auto bytes = tensor_byte_size(*dtype, tensor.shape);
  WS_EXPECT(bytes && *bytes == array.nbytes(), ErrorCode::kInvalidArgument,
            "tensor '" + tensor.name + "' holds " + std::to_string(array.nbytes()) + " bytes, not the " +
                std::string(dtype_name(*dtype)) + " " + shape_text(tensor.shape) + " it claims");
  tensor.view.dtype = *dtype;
  tensor.view.data = static_cast<const std::byte*>(array.data());
  tensor.view.device = device_of(array.device_type(), array.device_id());
  tensor.view.offset = 0;
  tensor.view.bytes = array.nbytes();
  return tensor;
}

LoadMode parse_mode(const std::string& text) {
  if (text == "cold") return LoadMode::kCold;
  if (text == "reload") return LoadMode::kReload;
  if (text == "update") return LoadMode::kUpdate;
  WS_FAIL(ErrorCode::kInvalidArgument, "load mode '" + text + "' is not one of cold, reload, update");
}

TensorFormat parse_format(const std::string& text) {
  if (text == "checkpoint") return TensorFormat::kCheckpoint;
  if (text == "engine") return TensorFormat::kEngine;
  WS_FAIL(ErrorCode::kInvalidArgument, "tensor format '" + text + "' is not one of checkpoint, engine");
}

nb::dict counters_dict(const LoadCounters& counters) {
  nb::dict result;
  result["tensors_applied"] = counters.tensors_applied;
  result["bytes_applied"] = counters.bytes_applied;
  result["tensors_skipped"] = counters.tensors_skipped;
  result["parameters_completed"] = counters.parameters_completed;
  result["layer_processing_runs"] = counters.layer_processing_runs;
  result["model_hook_runs"] = counters.model_hook_runs;
  return result;
}

/// A ModelLayout owned by Python; sessions and parameter views keep it alive.
struct LayoutHandle {
  ModelLayout layout;
  /// Python callables of hooks added with add_hook. The layout's hooks hold them; they
  /// are listed here so the garbage collector sees them (a hook closing over its own
  /// layout is a cycle that only tp_traverse/tp_clear can break).
  std::vector<std::shared_ptr<nb::object>> python_hooks;
};

int layout_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  if (!nb::inst_ready(self)) return 0;
  for (const auto& hook : nb::inst_ptr<LayoutHandle>(self)->python_hooks) Py_VISIT(hook->ptr());
  return 0;
}

int layout_clear(PyObject* self) {
  if (!nb::inst_ready(self)) return 0;
  // A cleared hook does nothing if it runs again.
  for (auto& hook : nb::inst_ptr<LayoutHandle>(self)->python_hooks) *hook = nb::none();
  return 0;
}

PyType_Slot layout_slots[] = {{Py_tp_traverse, reinterpret_cast<void*>(layout_traverse)},
                              {Py_tp_clear, reinterpret_cast<void*>(layout_clear)},
                              {0, nullptr}};

/// A LoadSession and the Python layout object it writes into.
class SessionHandle {
 public:
  explicit SessionHandle(nb::object layout)
      : layout_object_(std::move(layout)), session_(nb::cast<LayoutHandle&>(layout_object_).layout) {}

  void begin(const std::string& mode, const std::string& format) {
    auto parsed_mode = parse_mode(mode);
    auto parsed_format = parse_format(format);
    nb::gil_scoped_release release;
    session_.begin(parsed_mode, parsed_format);
  }

  void load(nb::iterable batch) {
    std::vector<BatchTensor> tensors;
    for (nb::handle entry : batch) tensors.push_back(batch_tensor(entry));
    std::vector<TensorView> views;
    views.reserve(tensors.size());
    for (auto& tensor : tensors) {
      tensor.view.name = tensor.name;
      tensor.view.shape = tensor.shape;
      views.push_back(tensor.view);
    }
    nb::gil_scoped_release release;
    session_.load(views);
  }

  void finish() {
    // Hooks written in Python take the GIL back themselves.
    nb::gil_scoped_release release;
    session_.finish();
  }

  nb::dict stream_checkpoint(const CheckpointHandle& checkpoint, nb::dict overrides) {
    auto options = checkpoint.options(overrides);
    StreamStats stats = call_interruptibly([&](const ProgressCallback& progress) {
      auto plan = plan_layout_load(layout(), checkpoint.checkpoint());
      return stream_into_session(checkpoint.checkpoint(), plan, session_, options.stream, progress);
    });
    nb::dict result;
    result["tensors"] = stats.tensors;
    result["bytes"] = stats.bytes;
    result["seconds"] = stats.seconds;
    result["peak_staging_bytes"] = stats.peak_staging_bytes;
    return result;
  }

  nb::dict counters() const { return counters_dict(session_.counters()); }
  std::string mode() const { return std::string(load_mode_name(session_.mode())); }
  std::vector<int64_t> completed_layers() const { return session_.completed_layers(); }

 private:
  ModelLayout& layout() { return nb::cast<LayoutHandle&>(layout_object_).layout; }
  nb::object layout_object_;
  LoadSession session_;
};

nb::object parameter_array(nb::handle layout_object, const std::string& name) {
  auto& layout = nb::cast<LayoutHandle&>(layout_object).layout;
  const auto& parameter = layout.parameter(name);
  WS_EXPECT(parameter.data != nullptr, ErrorCode::kModel,
            "parameter '" + name + "' of " + layout.description() + " has no storage yet: call allocate() or bind()");
  CheckpointTensor shape_only;
  shape_only.name = parameter.name;
  shape_only.dtype = parameter.dtype;
  shape_only.shape = parameter.shape;
  shape_only.bytes = parameter.bytes();
  // The view holds the layout object: the storage lives as long as the layout does.
  return tensor_array(parameter.data, shape_only, parameter.device, layout_object);
}

}  // namespace

ModelLayout& python_layout(nb::handle layout) { return nb::cast<LayoutHandle&>(layout).layout; }

void bind_model(nb::module_& m) {
  nb::class_<LayoutHandle>(m, "ModelLayout", nb::type_slots(layout_slots))
      .def_static(
          "from_config",
          [](const std::string& config_json, int64_t tp_size, int64_t tp_rank, int64_t ep_size, int64_t ep_rank,
             std::optional<std::string> dtype, const std::string& quantize, const std::string& modules) {
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
            auto config = parse_model_config("config.json", config_json);
            return new LayoutHandle{build_model_layout(config, options)};
          },
          "config_json"_a, "tp_size"_a = 1, "tp_rank"_a = 0, "ep_size"_a = 1, "ep_rank"_a = 0, "dtype"_a = nb::none(),
          "quantize"_a = "none", "modules"_a = "target", nb::rv_policy::take_ownership)
      .def_prop_ro("description", [](const LayoutHandle& handle) { return handle.layout.description(); })
      .def_prop_ro("parameter_names",
                   [](const LayoutHandle& handle) {
                     std::vector<std::string> names;
                     for (const auto& parameter : handle.layout.parameters()) names.push_back(parameter.name);
                     return names;
                   })
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
             return info;
           },
           "name"_a)
      .def("allocate",
           [](LayoutHandle& handle, const std::string& device) {
             auto parsed = parse_device(device);
             nb::gil_scoped_release release;
             handle.layout.allocate(parsed);
           },
           "device"_a = "cpu")
      .def("tensor", &parameter_array, "name"_a,
           "A DLPack view of a parameter's storage (valid while the layout lives).")
      .def("add_tied_lm_head_hook", [](LayoutHandle& handle) { handle.layout.add_hook(make_tied_lm_head_hook()); })
      .def("add_hook",
           [](LayoutHandle& handle, const std::string& name, nb::callable run, bool rerunnable) {
             // The session calls hooks with the GIL released; a Python hook takes it back,
             // and its exception becomes a weightstream error with the Python message.
             auto function = std::make_shared<nb::object>(std::move(run));
             handle.python_hooks.push_back(function);
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
           "name"_a, "run"_a, "rerunnable"_a = true)
      .def_prop_ro("loads_finished", [](const LayoutHandle& handle) { return handle.layout.loads_finished(); })
      .def_prop_ro("model_hook_runs", [](const LayoutHandle& handle) { return handle.layout.model_hook_runs(); })
      .def_prop_ro("allocated_bytes", [](const LayoutHandle& handle) { return handle.layout.allocated_bytes(); });

  nb::class_<SessionHandle>(m, "LoadSession")
      .def(nb::init<nb::object>(), "layout"_a)
      .def("begin", &SessionHandle::begin, "mode"_a = "cold", "format"_a = "checkpoint")
      .def("load", &SessionHandle::load, "batch"_a)
      .def("finish", &SessionHandle::finish)
      .def("stream_checkpoint", &SessionHandle::stream_checkpoint, "checkpoint"_a, "options"_a)
      .def_prop_ro("counters", &SessionHandle::counters)
      .def_prop_ro("mode", &SessionHandle::mode)
      .def_prop_ro("completed_layers", &SessionHandle::completed_layers);
}

}  // namespace weightstream::python
