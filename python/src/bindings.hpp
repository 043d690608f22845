#pragma once
// Pieces shared by the translation units of weightstream._core (module.cpp binds the
// stream layer, model_bindings.cpp the model layer). Not an installed header.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "weightstream/device.hpp"
#include "weightstream/model.hpp"
#include "weightstream/options.hpp"
#include "weightstream/source.hpp"
#include "weightstream/stream.hpp"

namespace weightstream::python {

/// The environment's options (WEIGHTSTREAM_*, read now).
Options environment_options();

/// `base` with keyword overrides applied, checked as the command's flags are.
/// `overrides` holds only options the caller set; an unknown name raises TypeError.
Options resolve_options(const Options& base, nanobind::dict overrides);

/// A framework-less nanobind array (DLPack and, on the host, the buffer protocol) over
/// `data`, shaped and typed as `tensor`, kept alive by `owner`. Dtypes numpy lacks become
/// uint8 of shape [*shape, itemsize], or flat bytes for sub-byte dtypes (F4, F6).
nanobind::object tensor_array(std::byte* data, const CheckpointTensor& tensor, const Device& device, nanobind::handle owner);

/// Which tensors the core hands over as torch.Tensor itself instead of as an array for
/// Python to import: each is made from a DLPack capsule in one call into torch, with
/// BF16 in torch's own dtype, where the array path costs torch.from_dlpack's protocol calls
/// (device query, current stream, __dlpack__) and, for BF16, a view and a reshape per tensor.
/// The F8, F6 and F4 kinds always cross as raw bytes (python/weightstream/_tensors.py views them).
enum class TorchTensors {
  kNone,  ///< every tensor as an array (framework="numpy", or no torch)
  kBf16,  ///< BF16 tensors as torch tensors, the rest as arrays (the default framework with torch)
  kAll,   ///< every tensor torch can import directly (framework="torch")
};

/// TorchTensors from its Python spelling: "none", "bf16" or "all".
TorchTensors parse_torch_tensors(const std::string& text);

/// What Python receives for one tensor: a torch.Tensor where `torch` says so, else
/// tensor_array(); both hold `owner`.
nanobind::object tensor_object(std::byte* data, const CheckpointTensor& tensor, const Device& device,
                               nanobind::handle owner, TorchTensors torch);

/// A report's named counters as a dict, named as `weightstream load --json` names them.
nanobind::dict stats_dict(const std::vector<StatField>& fields);

/// The safetensors dtype of raw uint8 bytes at `data` (`bytes` long) that tensor_array()
/// made for a dtype numpy lacks and that are still alive: LoadSession.load takes them
/// without the caller naming the dtype. nullopt for any other memory.
std::optional<Dtype> raw_array_dtype(const void* data, uint64_t bytes);

/// What weightstream reads of a torch.Tensor: its bytes, safetensors dtype, shape and device.
struct TorchTensorFacts {
  const std::byte* data = nullptr;
  Dtype dtype = Dtype::kU8;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  Device device;
};

/// The facts of `object` when it is a contiguous torch.Tensor (or subclass, e.g. a
/// Parameter) on the CPU or a CUDA device, in a dtype safetensors names other than uint8,
/// read from its attributes (data_ptr, shape, dtype, device): about a microsecond a tensor,
/// where importing it through __dlpack__ costs several in torch's Python code, which bounds
/// an update of thousands of tensors. nullopt for anything else (torch never imported, a
/// view that is not contiguous, uint8 bytes that may be weightstream's raw arrays, another
/// device): the caller takes the DLPack path, with its checks and error texts.
std::optional<TorchTensorFacts> torch_tensor_facts(nanobind::handle object);

/// The views of imported tensors (each with a `name`, a `shape` and a `view`), named and
/// shaped, for one call into the library; the tensors must outlive the views.
template <typename Imported>
std::vector<TensorView> views_of(std::vector<Imported>& tensors) {
  std::vector<TensorView> views;
  views.reserve(tensors.size());
  for (auto& tensor : tensors) {
    tensor.view.name = tensor.name;
    tensor.view.shape = tensor.shape;
    views.push_back(tensor.view);
  }
  return views;
}

/// What Python sees of one checkpoint tensor.
struct TensorEntry {
  std::string name;
  std::string dtype;  ///< safetensors spelling, e.g. "BF16"
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  std::string shard;  ///< shard file name
  uint64_t offset = 0;
};

/// An open checkpoint and the options it was opened with.
class CheckpointHandle {
 public:
  CheckpointHandle(const std::string& uri, nanobind::dict overrides) : options_(resolve_options(environment_options(), overrides)) {
    nanobind::gil_scoped_release release;
    checkpoint_ = std::make_shared<const Checkpoint>(Checkpoint::open(uri, options_));
  }

  /// A checkpoint opened elsewhere (by source resolution), streamed with `options`.
  CheckpointHandle(std::shared_ptr<const Checkpoint> checkpoint, Options options)
      : options_(std::move(options)), checkpoint_(std::move(checkpoint)) {}

  const Checkpoint& checkpoint() const { return *checkpoint_; }
  const std::shared_ptr<const Checkpoint>& shared() const { return checkpoint_; }
  Options options(nanobind::dict overrides) const { return resolve_options(options_, overrides); }
  const Options& options() const { return options_; }

  TensorEntry info(size_t index) const {
    const auto& tensor = checkpoint_->tensors().at(index);
    return {tensor.name, std::string(dtype_name(tensor.dtype)), tensor.shape, tensor.bytes,
            checkpoint_->shards()[tensor.shard].name, tensor.offset};
  }

 private:
  Options options_;
  std::shared_ptr<const Checkpoint> checkpoint_;
};

/// Adds ModelLayout and LoadSession to the module.
void bind_model(nanobind::module_& m);

/// The C++ layout behind a Python ModelLayout (defined beside LayoutHandle).
ModelLayout& python_layout(nanobind::handle layout);

/// Allocates what a layout made with a device left unbound, once (model_layout(device=...)):
/// `for_cold_load` when a cold load is about to write it (LayoutHandle::ensure_storage).
void ensure_python_storage(nanobind::handle layout, bool for_cold_load);

/// The safetensors dtype of a DLPack dtype; nullopt for one safetensors lacks.
std::optional<Dtype> dlpack_dtype(const nanobind::dlpack::dtype& dtype);

/// The device of a DLPack device type and id.
Device dlpack_device(int device_type, int device_id);

/// Adds LoadSession (session_bindings.cpp).
void bind_session(nanobind::module_& m);

/// What from_config built the layout with (parallel ranks, quantize), for a peer server's manifest.
const LayoutOptions& python_layout_options(nanobind::handle layout);

/// The Python exception class weightstream.Error (module.cpp).
PyObject* python_error_type();

/// The options of a source from load_checkpoint's keyword arguments: the peers' token,
/// timeout (seconds) and expect_digest, the rest stream options (source_bindings.cpp).
SourceOptions python_source_options(nanobind::dict given);

/// What a load from a source did, as load_checkpoint returns it: a checkpoint's stream
/// counters, or a pull's report with bytes_from_peers, peers and digest_failures.
nanobind::dict source_load_dict(const SourceLoad& load);

/// The config.json a source publishes (`peer_config`: the serving peers', or a checkpoint's).
std::string peer_config_json(const std::string& uri, const std::optional<std::string>& token, double timeout_seconds);

/// Adds peer_config, source_kind, load_with_fallback and PeerServer (source_bindings.cpp).
void bind_sources(nanobind::module_& m);

/// Adds UpdateSender and UpdateReceiver (transfer_bindings.cpp).
void bind_transfer(nanobind::module_& m);

/// Adds resolve_source (resolve_bindings.cpp).
void bind_resolve(nanobind::module_& m);

/// Thrown by interruptible_progress() once Python's signal handlers raised (Ctrl-C); the
/// Python error stays set on the calling thread until the binding raises it.
struct InterruptRequested {};

/// A progress callback for a long call made without the GIL: about every 100 ms, on the
/// calling thread, it takes the GIL and runs Python's signal handlers, so Ctrl-C cancels
/// the load (the library stops its readers when a progress callback throws).
ProgressCallback interruptible_progress();

/// Runs `call(progress)` without the GIL, with interruptible_progress(), and raises the
/// KeyboardInterrupt (or whatever a signal handler raised) that cancelled it.
template <typename Call>
auto call_interruptibly(Call&& call) {
  try {
    nanobind::gil_scoped_release release;
    return call(interruptible_progress());
  } catch (const InterruptRequested&) {
    throw nanobind::python_error();
  }
}

}  // namespace weightstream::python
