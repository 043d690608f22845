// weightstream._core's LoadSession: one load of a ModelLayout (model_bindings.cpp), fed
// batches of DLPack tensors, a checkpoint, or any source the library opens (source.hpp).
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "weightstream/error.hpp"
#include "weightstream/load.hpp"
#include "weightstream/source.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace weightstream::python {
namespace {

/// A batch entry after its DLPack array was checked: the view LoadSession::load takes,
/// and the storage the view points into.
struct BatchTensor {
  std::string name;
  std::vector<int64_t> shape;
  nb::ndarray<nb::ro> array;  // keeps the memory alive for the call
  TensorView view;
  /// uint8 with a trailing axis of 1 or 2 and no dtype named: perhaps the raw bytes of a
  /// BF16 or F8 tensor from elsewhere, which the error of a failed load then says.
  bool maybe_raw = false;
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
  auto dtype = dlpack_dtype(array.dtype());
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
  } else if (dtype == Dtype::kU8) {
    // Raw bytes weightstream itself gave (stream(), load() or layout.tensor() of BF16 or F8
    // without torch) carry their dtype here: no need to name it.
    if (auto raw = raw_array_dtype(array.data(), array.nbytes())) {
      unsigned bits = dtype_bits(*raw);
      if (bits % 8 == 0 && !tensor.shape.empty() && tensor.shape.back() == static_cast<int64_t>(bits / 8)) {
        tensor.shape.pop_back();
        dtype = raw;
      }
    } else if (tensor.shape.size() >= 2 && (tensor.shape.back() == 1 || tensor.shape.back() == 2)) {
      tensor.maybe_raw = true;
    }
  }
  WS_EXPECT(dtype.has_value(), ErrorCode::kInvalidArgument,
            "tensor '" + tensor.name + "' has a dtype safetensors has no name for; pass (name, tensor, dtype)");
  auto bytes = tensor_byte_size(*dtype, tensor.shape);
  WS_EXPECT(bytes && *bytes == array.nbytes(), ErrorCode::kInvalidArgument,
            "tensor '" + tensor.name + "' holds " + std::to_string(array.nbytes()) + " bytes, not the " +
                std::string(dtype_name(*dtype)) + " " + shape_text(tensor.shape) + " it claims");
  tensor.view.dtype = *dtype;
  tensor.view.data = static_cast<const std::byte*>(array.data());
  tensor.view.device = dlpack_device(array.device_type(), array.device_id());
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

/// A LoadSession and the Python layout object it writes into.
class SessionHandle {
 public:
  explicit SessionHandle(nb::object layout)
      : layout_object_(std::move(layout)), session_(python_layout(layout_object_)) {}

  /// `commit` absent: the mode's default (default_layer_commit).
  void begin(const std::string& mode, const std::string& format, const std::optional<std::string>& commit) {
    auto parsed_mode = parse_mode(mode);
    auto parsed_format = parse_format(format);
    std::optional<LayerCommit> parsed_commit;
    if (commit) {
      WS_EXPECT(*commit == "arrival" || *commit == "layer", ErrorCode::kInvalidArgument,
                "commit '" + *commit + "' is not one of arrival (write each tensor as it arrives) and layer (write a "
                "layer once all of it has arrived)");
      parsed_commit = *commit == "layer" ? LayerCommit::kWholeLayer : LayerCommit::kAsArrived;
    }
    ModelLayout& layout = python_layout(layout_object_);
    nb::gil_scoped_release release;
    ensure_python_storage(layout_object_, parsed_mode == LoadMode::kCold);
    session_.begin(parsed_mode, parsed_format, parsed_commit);
  }

  void load(nb::iterable batch) {
    std::vector<BatchTensor> tensors;
    for (nb::handle entry : batch) tensors.push_back(batch_tensor(entry));
    std::vector<TensorView> views = views_of(tensors);
    std::string raw_hint;
    for (const auto& tensor : tensors) {
      if (tensor.maybe_raw && raw_hint.empty()) {
        raw_hint = "; tensor '" + tensor.name + "' came as uint8 " + shape_text(tensor.shape) +
                   ": if that is the raw bytes of a BF16 or F8 tensor (its last axis the item size), "
                   "name its dtype: (name, tensor, \"BF16\")";
      }
    }
    try {
      nb::gil_scoped_release release;
      session_.load(views);
    } catch (const Error& error) {
      if (raw_hint.empty()) throw;
      throw Error(error.code(), error.what() + raw_hint);
    }
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
    return stats_dict(stat_fields(stats));
  }

  /// Loads this layout's parameters from the source `uri` names (open_source: a checkpoint,
  /// or serving peers) with load_checkpoint's keyword options.
  nb::dict load_source(const std::string& uri, nb::dict options) {
    std::unique_ptr<Source> source = open_source(uri, python_source_options(options));
    SourceLoad load = call_interruptibly([&](const ProgressCallback& progress) {
      return source->load_into(session_, progress);
    });
    return source_load_dict(load);
  }

  nb::dict counters() const { return stats_dict(stat_fields(session_.counters())); }
  std::string mode() const { return std::string(load_mode_name(session_.mode())); }
  std::string commit() const { return session_.commit() == LayerCommit::kWholeLayer ? "layer" : "arrival"; }
  std::vector<int64_t> completed_layers() const { return session_.completed_layers(); }

 private:
  ModelLayout& layout() { return python_layout(layout_object_); }
  nb::object layout_object_;
  LoadSession session_;
};

}  // namespace

/// LoadSession: one load of a layout.
void bind_session(nb::module_& m) {
  nb::class_<SessionHandle>(m, "LoadSession")
      .def(nb::init<nb::object>(), "layout"_a)
      .def("begin", &SessionHandle::begin, "mode"_a = "cold", "format"_a = "checkpoint", "commit"_a.none() = nb::none())
      .def("load", &SessionHandle::load, "batch"_a)
      .def("finish", &SessionHandle::finish)
      .def("stream_checkpoint", &SessionHandle::stream_checkpoint, "checkpoint"_a, "options"_a)
      .def("load_source", &SessionHandle::load_source, "uri"_a, "options"_a)
      .def_prop_ro("counters", &SessionHandle::counters)
      .def_prop_ro("mode", &SessionHandle::mode)
      .def_prop_ro("commit", &SessionHandle::commit)
      .def_prop_ro("completed_layers", &SessionHandle::completed_layers);
}

}  // namespace weightstream::python
