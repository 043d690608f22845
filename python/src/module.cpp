// weightstream._core: the nanobind module behind the weightstream Python package. It binds
// the public C++ API only (Checkpoint, stream_tensors through TensorStream, load_checkpoint,
// digest_checkpoint); python/weightstream/*.py shape it into the documented Python API.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "tensor_stream.hpp"
#include "weightstream/device.hpp"
#include "weightstream/error.hpp"
#include "weightstream/options.hpp"
#include "weightstream/load.hpp"
#include "weightstream/peer.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace weightstream::python {
namespace {

// The Python exception class weightstream.Error, created at import. Owned by the module
// (as its attribute) for the life of the interpreter.
PyObject* error_type = nullptr;

/// Raises weightstream.Error with the library's message and its code's name as `.code`.
void raise_python_error(const Error& error) {
  nb::object instance = nb::steal(PyObject_CallFunction(error_type, "s", error.what()));
  if (!instance.is_valid()) return;  // the constructor itself failed and set an exception
  instance.attr("code") = std::string(error_code_name(error.code()));
  PyErr_SetObject(error_type, instance.ptr());
}

// ---- options ----------------------------------------------------------------------------

constexpr const char* kOptionNames = "concurrency, memory_limit, chunk_size, io, gpu_path, mapped_share, prefetchers";

/// A byte size given as an int or as text such as "64MiB".
uint64_t size_argument(nb::handle value, const char* name) {
  if (nb::isinstance<nb::str>(value)) return parse_size(nb::cast<std::string>(value), name);
  if (nb::isinstance<nb::int_>(value) && !nb::isinstance<nb::bool_>(value)) {
    WS_EXPECT(nb::cast<long long>(value) >= 0, ErrorCode::kInvalidArgument,
              std::string(name) + " must not be negative, got " + nb::cast<std::string>(nb::str(value)));
    return nb::cast<uint64_t>(value);
  }
  throw nb::type_error((std::string(name) + " must be an int (bytes) or a string such as \"64MiB\", not " +
                        nb::cast<std::string>(nb::str(value.type().attr("__name__"))))
                           .c_str());
}

std::string text_argument(nb::handle value, const char* name) {
  if (!nb::isinstance<nb::str>(value)) throw nb::type_error((std::string(name) + " must be a string").c_str());
  return nb::cast<std::string>(value);
}

}  // namespace

PyObject* python_error_type() { return error_type; }

Options resolve_options(const Options& base, nb::dict overrides) {
  Options options = base;
  auto& stream = options.stream;
  for (auto [key, value] : overrides) {
    std::string name = nb::cast<std::string>(key);
    if (value.is_none()) continue;
    if (name == "concurrency") {
      if (!nb::isinstance<nb::int_>(value) || nb::isinstance<nb::bool_>(value)) throw nb::type_error("concurrency must be an int");
      long long concurrency = nb::cast<long long>(value);
      WS_EXPECT(concurrency >= 1 && concurrency <= 1024, ErrorCode::kInvalidArgument,
                "concurrency " + std::to_string(concurrency) + " is out of range: expected 1 to 1024");
      stream.concurrency = static_cast<unsigned>(concurrency);
    } else if (name == "memory_limit") {
      stream.memory_limit = size_argument(value, "memory_limit");
    } else if (name == "chunk_size") {
      stream.chunk_bytes = size_argument(value, "chunk_size");
    } else if (name == "io") {
      stream.local_io = parse_local_io(text_argument(value, "io"), "io");
    } else if (name == "gpu_path") {
      stream.gpu_path = parse_gpu_path(text_argument(value, "gpu_path"), "gpu_path");
    } else if (name == "mapped_share") {
      if (nb::isinstance<nb::bool_>(value) || !(nb::isinstance<nb::float_>(value) || nb::isinstance<nb::int_>(value)))
        throw nb::type_error("mapped_share must be a number from 0 to 1");
      stream.mapped_share = parse_share(std::to_string(nb::cast<double>(value)), "mapped_share");
    } else if (name == "prefetchers") {
      if (!nb::isinstance<nb::int_>(value) || nb::isinstance<nb::bool_>(value)) throw nb::type_error("prefetchers must be an int");
      long long prefetchers = nb::cast<long long>(value);
      WS_EXPECT(prefetchers >= 0 && prefetchers <= 1024, ErrorCode::kInvalidArgument,
                "prefetchers " + std::to_string(prefetchers) + " is out of range: expected 0 to 1024");
      stream.prefetchers = static_cast<unsigned>(prefetchers);
    } else {
      throw nb::type_error(("unknown option '" + name + "' (options are " + kOptionNames + ")").c_str());
    }
  }
  check_stream_options(stream, {"concurrency", "memory_limit", "chunk_size"});
  return options;
}

Options environment_options() { return options_from_environment(process_environment()); }

namespace {

nb::dict options_dict(const Options& options) {
  const auto& stream = options.stream;
  nb::dict result;
  result["concurrency"] = stream.concurrency;
  result["memory_limit"] = stream.memory_limit;
  result["chunk_size"] = stream.chunk_bytes;
  result["io"] = std::string(local_io_name(stream.local_io));
  result["gpu_path"] = std::string(gpu_path_name(stream.gpu_path));
  result["mapped_share"] = stream.mapped_share;
  result["prefetchers"] = stream.prefetchers ? nb::cast(*stream.prefetchers) : nb::none();
  return result;
}

// ---- tensors as DLPack arrays -----------------------------------------------------------

/// The DLPack dtype of a safetensors dtype numpy can hold; nullopt for the others (BF16,
/// the F8, F6 and F4 kinds), which cross as raw bytes and are viewed in Python.
std::optional<nb::dlpack::dtype> numpy_dtype(Dtype dtype) {
  using Code = nb::dlpack::dtype_code;
  auto make = [](Code code, uint8_t bits) { return nb::dlpack::dtype{static_cast<uint8_t>(code), bits, 1}; };
  switch (dtype) {
    case Dtype::kBool: return make(Code::Bool, 8);
    case Dtype::kU8: return make(Code::UInt, 8);
    case Dtype::kI8: return make(Code::Int, 8);
    case Dtype::kI16: return make(Code::Int, 16);
    case Dtype::kU16: return make(Code::UInt, 16);
    case Dtype::kF16: return make(Code::Float, 16);
    case Dtype::kI32: return make(Code::Int, 32);
    case Dtype::kU32: return make(Code::UInt, 32);
    case Dtype::kF32: return make(Code::Float, 32);
    case Dtype::kF64: return make(Code::Float, 64);
    case Dtype::kI64: return make(Code::Int, 64);
    case Dtype::kU64: return make(Code::UInt, 64);
    case Dtype::kC64: return make(Code::Complex, 64);
    default: return std::nullopt;
  }
}

/// Raw-byte arrays alive now, by address: their dtype and size. Touched only with the GIL.
struct RawArray {
  Dtype dtype;
  uint64_t bytes = 0;
  unsigned arrays = 0;  ///< arrays over this memory alive (views of one parameter, made twice)
};
std::map<const void*, RawArray>& raw_arrays() {
  static auto* arrays = new std::map<const void*, RawArray>();  // never freed: outlives every array
  return *arrays;
}

/// The owner of a raw-byte array: the real owner, and the registry entry it drops when the
/// last view of it is gone (the capsule is freed with the GIL held).
struct RawArrayOwner {
  const void* data;
  PyObject* owner;
};

nb::object raw_array_owner(const void* data, const CheckpointTensor& tensor, nb::handle owner) {
  RawArray& entry = raw_arrays()[data];
  if (entry.arrays == 0 || entry.dtype != tensor.dtype || entry.bytes != tensor.bytes) {
    entry = RawArray{tensor.dtype, tensor.bytes, 0};
  }
  ++entry.arrays;
  return nb::capsule(new RawArrayOwner{data, owner.inc_ref().ptr()}, [](void* pointer) noexcept {
    auto* raw = static_cast<RawArrayOwner*>(pointer);
    auto found = raw_arrays().find(raw->data);
    if (found != raw_arrays().end() && --found->second.arrays == 0) raw_arrays().erase(found);
    Py_XDECREF(raw->owner);
    delete raw;
  });
}

}  // namespace

std::optional<TorchTensorFacts> torch_tensor_facts(nb::handle object) {
  // torch's Tensor type and its dtypes, looked up once torch has been imported by someone
  // (never imported here: without torch there is no torch tensor to describe).
  struct Torch {
    nb::object tensor_type;
    std::vector<std::pair<nb::object, Dtype>> dtypes;
  };
  static std::optional<Torch> torch;
  if (!torch) {
    nb::dict modules = nb::borrow<nb::dict>(PySys_GetObject("modules"));
    if (!modules.contains("torch")) return std::nullopt;
    nb::object module = modules["torch"];
    if (!nb::hasattr(module, "Tensor")) return std::nullopt;  // torch still importing
    Torch found{module.attr("Tensor"), {}};
    static const std::pair<const char*, Dtype> kDtypes[] = {
        {"bfloat16", Dtype::kBF16}, {"float16", Dtype::kF16}, {"float32", Dtype::kF32}, {"float64", Dtype::kF64},
        {"int8", Dtype::kI8},       {"int16", Dtype::kI16},   {"int32", Dtype::kI32},   {"int64", Dtype::kI64},
        {"bool", Dtype::kBool},     {"float8_e4m3fn", Dtype::kF8E4M3}, {"float8_e5m2", Dtype::kF8E5M2},
    };
    for (const auto& [name, dtype] : kDtypes) {
      if (nb::hasattr(module, name)) found.dtypes.emplace_back(module.attr(name), dtype);
    }
    torch = std::move(found);
  }
  int is_tensor = PyObject_IsInstance(object.ptr(), torch->tensor_type.ptr());
  if (is_tensor < 0) PyErr_Clear();
  if (is_tensor != 1) return std::nullopt;
  nb::object dtype_object = object.attr("dtype");
  std::optional<Dtype> dtype;
  for (const auto& [known, parsed] : torch->dtypes) {
    if (known.is(dtype_object)) dtype = parsed;
  }
  if (!dtype) return std::nullopt;
  Device device;
  if (nb::cast<bool>(object.attr("is_cuda"))) {
    device = Device{Device::Kind::kCuda, nb::cast<int>(object.attr("get_device")())};
  } else if (!nb::cast<bool>(object.attr("is_cpu"))) {
    return std::nullopt;
  }
  if (!nb::cast<bool>(object.attr("is_contiguous")())) return std::nullopt;
  TorchTensorFacts facts;
  facts.dtype = *dtype;
  facts.device = device;
  for (nb::handle dimension : object.attr("shape")) facts.shape.push_back(nb::cast<int64_t>(dimension));
  auto bytes = tensor_byte_size(facts.dtype, facts.shape);
  if (!bytes) return std::nullopt;
  facts.bytes = *bytes;
  facts.data = reinterpret_cast<const std::byte*>(nb::cast<uintptr_t>(object.attr("data_ptr")()));
  return facts;
}

std::optional<Dtype> raw_array_dtype(const void* data, uint64_t bytes) {
  auto found = raw_arrays().find(data);
  if (found == raw_arrays().end() || found->second.bytes != bytes) return std::nullopt;
  return found->second.dtype;
}

nb::object tensor_array(std::byte* data, const CheckpointTensor& tensor, const Device& device, nb::handle owner) {
  // DLPack consumers dereference nothing for an empty tensor, but some reject a null pointer.
  alignas(256) static std::byte empty_tensor[1];
  if (tensor.bytes == 0) data = empty_tensor;
  std::vector<size_t> shape(tensor.shape.begin(), tensor.shape.end());
  auto dtype = numpy_dtype(tensor.dtype);
  if (!dtype) {
    dtype = nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::UInt), 8, 1};
    unsigned bits = dtype_bits(tensor.dtype);
    if (bits % 8 == 0) {
      shape.push_back(bits / 8);
    } else {
      shape.assign(1, tensor.bytes);
    }
  }
  nb::object raw_owner;
  if (numpy_dtype(tensor.dtype) == std::nullopt && tensor.bytes > 0) {
    // Remembered, so that LoadSession.load knows these bytes' dtype without being told.
    raw_owner = raw_array_owner(data, tensor, owner);
    owner = raw_owner;
  }
  int device_type = device.is_cuda() ? nb::device::cuda::value : nb::device::cpu::value;
  // array_api: an object with __dlpack__, __dlpack_device__ and the buffer protocol
  // (no_framework would give a bare, single-use DLPack capsule).
  nb::ndarray<nb::array_api> array(data, shape.size(), shape.data(), owner, nullptr, *dtype, device_type, device.index);
  return array.cast();
}

TorchTensors parse_torch_tensors(const std::string& text) {
  if (text == "none") return TorchTensors::kNone;
  if (text == "bf16") return TorchTensors::kBf16;
  if (text == "all") return TorchTensors::kAll;
  WS_FAIL(ErrorCode::kInvalidArgument, "torch tensors '" + text + "' is not one of none, bf16, all");
}

nb::object tensor_object(std::byte* data, const CheckpointTensor& tensor, const Device& device, nb::handle owner,
                         TorchTensors torch) {
  bool bf16 = tensor.dtype == Dtype::kBF16;
  bool as_torch = torch == TorchTensors::kAll ? bf16 || numpy_dtype(tensor.dtype).has_value()
                                              : torch == TorchTensors::kBf16 && bf16;
  if (!as_torch) return tensor_array(data, tensor, device, owner);
  alignas(256) static std::byte empty_tensor[1];
  if (tensor.bytes == 0) data = empty_tensor;
  std::vector<size_t> shape(tensor.shape.begin(), tensor.shape.end());
  auto dtype = bf16 ? nb::dlpack::dtype{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1}
                    : *numpy_dtype(tensor.dtype);
  int device_type = device.is_cuda() ? nb::device::cuda::value : nb::device::cpu::value;
  // A bare DLPack capsule, which torch imports without the __dlpack__ protocol's calls: the
  // bytes are complete (a load returns, and a stream hands out a tensor, only once every
  // copy to the device landed), so there is no stream to order against.
  nb::ndarray<nb::no_framework> array(data, shape.size(), shape.data(), owner, nullptr, dtype, device_type, device.index);
  // Looked up once, and never released: it outlives every call (as the module does).
  static PyObject* from_dlpack = nb::object(nb::module_::import_("torch.utils.dlpack").attr("from_dlpack")).release().ptr();
  return nb::handle(from_dlpack)(array.cast());
}

ProgressCallback interruptible_progress() {
  return [](uint64_t, uint64_t) {
    nb::gil_scoped_acquire acquire;
    if (PyErr_CheckSignals() != 0) throw InterruptRequested{};
  };
}

namespace {

// ---- bound types --------------------------------------------------------------------------


/// Python face of TensorStream: an iterator of (tensor index, array).
class StreamIterator {
 public:
  StreamIterator(const CheckpointHandle& checkpoint, const std::string& device, nb::dict overrides,
                 std::vector<size_t> selection, const std::string& torch)
      : torch_(parse_torch_tensors(torch)) {
    auto options = checkpoint.options(overrides);
    auto parsed = parse_device(device);
    nb::gil_scoped_release release;
    stream_ = std::make_unique<TensorStream>(checkpoint.shared(), parsed, options.stream, std::move(selection));
  }

  nb::tuple next() {
    std::optional<StreamedTensor> tensor;
    {
      nb::gil_scoped_release release;
      tensor = stream_->next();
    }
    if (!tensor) throw nb::stop_iteration();
    const auto& info = stream_->checkpoint().tensors()[tensor->tensor];
    std::byte* data = tensor->buffer ? tensor->buffer->data() : nullptr;
    nb::capsule owner(tensor->buffer.release(), [](void* buffer) noexcept { delete static_cast<Buffer*>(buffer); });
    return nb::make_tuple(tensor->tensor, tensor_object(data, info, stream_->device(), owner, torch_));
  }

  void close() {
    nb::gil_scoped_release release;
    stream_->cancel();
  }

  uint64_t queued_bytes() const { return stream_->queued_bytes(); }
  uint64_t peak_queued_bytes() const { return stream_->peak_queued_bytes(); }

 private:
  TorchTensors torch_;
  std::unique_ptr<TensorStream> stream_;
};

/// (list of (name, tensor) in file order, the load's counters as `weightstream load --json`
/// reports them: "seconds" is the library's own time, from the arena's allocation to the
/// last byte landed).
nb::tuple load(const CheckpointHandle& checkpoint, const std::string& device, nb::dict overrides,
               const std::string& torch) {
  auto torch_tensors = parse_torch_tensors(torch);
  auto options = checkpoint.options(overrides);
  auto parsed = parse_device(device);
  auto loaded = call_interruptibly([&](const ProgressCallback& progress) {
    return std::make_shared<LoadedCheckpoint>(load_checkpoint(checkpoint.checkpoint(), parsed, options.stream, progress));
  });
  // Every array holds a reference to the one arena; it is freed with the last of them.
  nb::list result;
  for (const auto& tensor : loaded->tensors) {
    nb::capsule owner(new std::shared_ptr<LoadedCheckpoint>(loaded),
                      [](void* arena) noexcept { delete static_cast<std::shared_ptr<LoadedCheckpoint>*>(arena); });
    const auto& info = checkpoint.checkpoint().tensors()[tensor.tensor];
    result.append(nb::make_tuple(info.name, tensor_object(tensor.data, info, parsed, owner, torch_tensors)));
  }
  return nb::make_tuple(result, stats_dict(stat_fields(loaded->stats)));
}

std::vector<std::pair<std::string, std::string>> digest(const CheckpointHandle& checkpoint, const std::string& hash,
                                                        const std::string& device, nb::dict overrides) {
  auto options = checkpoint.options(overrides);
  auto kind = parse_hash(hash);
  auto parsed = parse_device(device);
  auto digests = call_interruptibly([&](const ProgressCallback& progress) {
    return digest_checkpoint(checkpoint.checkpoint(), kind, parsed, options.stream, nullptr, progress);
  });
  std::vector<std::pair<std::string, std::string>> result;
  result.reserve(digests.size());
  for (auto& entry : digests) result.emplace_back(std::move(entry.name), std::move(entry.hex));
  return result;
}

}  // namespace
}  // namespace weightstream::python

NB_MODULE(_core, m) {
  using namespace weightstream;
  using namespace weightstream::python;
  m.doc() = "Compiled core of weightstream; use the functions of the weightstream package.";
  // Objects held by a daemon thread when the process exits (an update receiver parked at
  // exit, its layout) are alive at finalization by design; nanobind would list each as a leak.
  nb::set_leak_warnings(false);

  error_type = PyErr_NewExceptionWithDoc(
      "weightstream.Error",
      "A failure reported by weightstream. The message names the object, the range, the operation and the "
      "cause; .code is the kind of failure (\"not_found\", \"format\", \"invalid_argument\", \"io\", ...).",
      PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::handle(error_type);
  nb::register_exception_translator([](const std::exception_ptr& exception, void*) {
    try {
      std::rethrow_exception(exception);
    } catch (const Error& error) {
      raise_python_error(error);
    }
  });

  m.def("environment_options", [] { return options_dict(environment_options()); },
        "The options as the WEIGHTSTREAM_* environment variables set them (defaults otherwise).");
  m.def("resolve_options",
        [](nb::dict overrides) { return options_dict(resolve_options(environment_options(), overrides)); },
        "overrides"_a, "The environment's options with `overrides` applied and checked.");
  bind_model(m);
  bind_session(m);
  bind_transfer(m);
  bind_resolve(m);
  bind_sources(m);
  m.def("peer_addresses", [](const std::string& uri) { return peer_addresses(uri); }, "uri"_a,
        "The HOST:PORT addresses of a peer:// URI; weightstream.Error for a malformed one.");
  m.def("cuda_device_count", &cuda_device_count, "CUDA devices visible to this build (0 without CUDA support).");
  m.def("cuda_compiled", &cuda_compiled, "Whether this build has CUDA support compiled in.");

  nb::class_<TensorEntry>(m, "TensorInfo", "One tensor of a checkpoint: name, dtype, shape, bytes and where it lies.")
      .def_ro("name", &TensorEntry::name)
      .def_ro("dtype", &TensorEntry::dtype, "safetensors dtype name, e.g. \"BF16\"")
      .def_prop_ro("shape", [](const TensorEntry& info) {
        nb::list shape;
        for (int64_t dimension : info.shape) shape.append(dimension);
        return nb::tuple(shape);
      })
      .def_ro("bytes", &TensorEntry::bytes)
      .def_ro("shard", &TensorEntry::shard, "shard file name")
      .def_ro("offset", &TensorEntry::offset, "absolute byte offset in the shard file")
      .def("__repr__", [](const TensorEntry& info) {
        return "TensorInfo(name='" + info.name + "', dtype='" + info.dtype + "', shape=" + shape_text(info.shape) +
               ", bytes=" + std::to_string(info.bytes) + ", shard='" + info.shard + "')";
      });

  nb::class_<CheckpointHandle>(m, "Checkpoint")
      .def(nb::init<const std::string&, nb::dict>(), "uri"_a, "options"_a)
      .def_prop_ro("uri", [](const CheckpointHandle& handle) { return handle.checkpoint().uri(); })
      .def_prop_ro("options", [](const CheckpointHandle& handle) { return options_dict(handle.options()); })
      .def("__len__", [](const CheckpointHandle& handle) { return handle.checkpoint().tensors().size(); })
      .def("info", &CheckpointHandle::info, "index"_a)
      .def("find", [](const CheckpointHandle& handle, const std::string& name) { return handle.checkpoint().find(name); },
           "name"_a)
      .def_prop_ro("shards",
                   [](const CheckpointHandle& handle) {
                     std::vector<std::pair<std::string, uint64_t>> shards;
                     for (const auto& shard : handle.checkpoint().shards()) shards.emplace_back(shard.name, shard.size);
                     return shards;
                   })
      .def_prop_ro("tensor_bytes", [](const CheckpointHandle& handle) { return handle.checkpoint().tensor_bytes(); })
      .def_prop_ro("config_json", [](const CheckpointHandle& handle) { return handle.checkpoint().config_json(); })
      .def("load", &load, "device"_a, "options"_a, "torch"_a = "none")
      .def("digest", &digest, "hash"_a, "device"_a, "options"_a);

  nb::class_<StreamIterator>(m, "TensorStream")
      .def(nb::init<const CheckpointHandle&, const std::string&, nb::dict, std::vector<size_t>, const std::string&>(),
           "checkpoint"_a, "device"_a, "options"_a, "selection"_a = std::vector<size_t>{}, "torch"_a = "none")
      .def("__iter__", [](nb::handle self) { return self; })
      .def("__next__", &StreamIterator::next)
      .def("close", &StreamIterator::close, "Stops the stream and waits for its reader thread.")
      .def_prop_ro("queued_bytes", &StreamIterator::queued_bytes)
      .def_prop_ro("peak_queued_bytes", &StreamIterator::peak_queued_bytes);
}
