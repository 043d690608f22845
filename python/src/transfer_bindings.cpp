// weightstream._core: bindings of the transfer layer (issue 8). A trainer pushes tensors
// with UpdateSender (DLPack arrays: torch, numpy, cupy, on the host or a GPU); an engine
// applies them with UpdateReceiver into its ModelLayout. The GIL is released while bytes
// move and while the receiver waits.
//
// Registered from module.cpp with `bind_transfer(m);`. The receiver needs the C++
// ModelLayout behind a Python ModelLayout: `python_layout()` (declared in bindings.hpp,
// defined in model_bindings.cpp beside LayoutHandle) hands it over.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "bindings.hpp"
#include "weightstream/error.hpp"
#include "weightstream/transfer.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace weightstream::python {

namespace {

// ---- interpreter exit while a thread waits in receive() --------------------------------
// An engine runs `receiver.receive()` in a daemon thread and exits without stopping it.
// Once finalization has begun, CPython ends a thread that asks for the GIL with
// pthread_exit(); asked for in a destructor (nanobind's gil_scoped_release), the forced
// unwind leaves a noexcept frame and std::terminate aborts the process. So: at exit (an
// atexit handler, while the interpreter still runs) every receiver is cancelled, and a
// thread that comes back from a blocking call after that never asks for the GIL again: it
// parks until the process ends. The exit waits for the threads inside receive() to park and
// for those already re-taking the GIL to hold it, so none is left asking during finalization.

class PyReceiver;

struct ExitState {
  std::mutex mutex;
  std::condition_variable changed;
  bool exiting = false;
  int receiving = 0;    // threads inside UpdateReceiver::receive()
  int reacquiring = 0;  // threads between a call's end and holding the GIL again
  std::set<PyReceiver*> receivers;
};

/// Never destroyed: threads parked in it outlive the static destructors that run at exit.
ExitState& exit_state() {
  static auto* state = new ExitState;
  return *state;
}

[[noreturn]] void park_until_the_process_ends() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(24));
}

/// Releases the GIL around a blocking call, like nb::gil_scoped_release, but once the
/// interpreter has begun to exit, the thread parks instead of taking it back.
class ReleasedGil {
 public:
  /// `receiving`: the call is UpdateReceiver::receive(), which the exit waits for.
  explicit ReleasedGil(bool receiving = false) : receiving_(receiving) {
    if (receiving_) {
      std::lock_guard lock(exit_state().mutex);
      ++exit_state().receiving;
    }
    saved_ = PyEval_SaveThread();
  }
  ReleasedGil(const ReleasedGil&) = delete;
  ReleasedGil& operator=(const ReleasedGil&) = delete;
  ~ReleasedGil() {
    ExitState& exit = exit_state();
    {
      std::lock_guard lock(exit.mutex);
      if (receiving_) --exit.receiving;
      exit.changed.notify_all();
      if (exit.exiting) {
        park_ = true;
      } else {
        ++exit.reacquiring;  // the exit waits until this thread holds the GIL
      }
    }
    if (park_) park_until_the_process_ends();
    PyEval_RestoreThread(saved_);
    std::lock_guard lock(exit.mutex);
    --exit.reacquiring;
    exit.changed.notify_all();
  }

 private:
  bool receiving_;
  bool park_ = false;
  PyThreadState* saved_ = nullptr;
};

std::chrono::milliseconds milliseconds(double seconds) {
  WS_EXPECT(seconds > 0, ErrorCode::kInvalidArgument, "timeout must be positive, got " + std::to_string(seconds));
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

TensorFormat format_of(const std::string& text) {
  if (text == "checkpoint") return TensorFormat::kCheckpoint;
  if (text == "engine") return TensorFormat::kEngine;
  WS_FAIL(ErrorCode::kInvalidArgument, "tensor format '" + text + "' is not one of checkpoint, engine");
}

/// The safetensors dtype of a DLPack array, or of `declared` (a safetensors name) when
/// given: needed for BF16 and F8 arrays that arrive as raw uint8 bytes.
Dtype dtype_of(const nb::ndarray<nb::ro>& array, const std::optional<std::string>& declared, const std::string& name) {
  if (declared) {
    auto dtype = dtype_from_name(*declared);
    WS_EXPECT(dtype.has_value(), ErrorCode::kInvalidArgument,
              "tensor '" + name + "': unknown safetensors dtype '" + *declared + "'");
    return *dtype;
  }
  using Code = nb::dlpack::dtype_code;
  auto dtype = array.dtype();
  auto code = static_cast<Code>(dtype.code);
  if (code == Code::Bfloat && dtype.bits == 16) return Dtype::kBF16;
  if (code == Code::Float && dtype.bits == 16) return Dtype::kF16;
  if (code == Code::Float && dtype.bits == 32) return Dtype::kF32;
  if (code == Code::Float && dtype.bits == 64) return Dtype::kF64;
  if (code == Code::Int && dtype.bits == 8) return Dtype::kI8;
  if (code == Code::Int && dtype.bits == 16) return Dtype::kI16;
  if (code == Code::Int && dtype.bits == 32) return Dtype::kI32;
  if (code == Code::Int && dtype.bits == 64) return Dtype::kI64;
  if (code == Code::UInt && dtype.bits == 8) return Dtype::kU8;
  if (code == Code::Bool) return Dtype::kBool;
  if (code == Code::Float8_E4M3FN) return Dtype::kF8E4M3;
  if (code == Code::Float8_E5M2) return Dtype::kF8E5M2;
  WS_FAIL(ErrorCode::kInvalidArgument, "tensor '" + name + "' has a dtype safetensors has no name for; pass dtype=");
}

/// The dtype of a manifest entry: a safetensors name ("BF16"), a torch dtype or its name
/// ("torch.bfloat16", "bfloat16").
Dtype declared_dtype(nb::handle dtype, const std::string& name) {
  std::string text = nb::cast<std::string>(nb::str(dtype));
  if (auto parsed = dtype_from_name(text)) return *parsed;
  std::string_view torch_name = text;
  if (torch_name.starts_with("torch.")) torch_name.remove_prefix(6);
  static const std::pair<std::string_view, Dtype> kTorchNames[] = {
      {"bfloat16", Dtype::kBF16},       {"float16", Dtype::kF16},       {"half", Dtype::kF16},
      {"float32", Dtype::kF32},         {"float", Dtype::kF32},         {"float64", Dtype::kF64},
      {"int8", Dtype::kI8},             {"int16", Dtype::kI16},         {"int32", Dtype::kI32},
      {"int64", Dtype::kI64},           {"uint8", Dtype::kU8},          {"bool", Dtype::kBool},
      {"float8_e4m3fn", Dtype::kF8E4M3}, {"float8_e5m2", Dtype::kF8E5M2},
  };
  for (const auto& [known, parsed] : kTorchNames) {
    if (torch_name == known) return parsed;
  }
  WS_FAIL(ErrorCode::kInvalidArgument, "update manifest: tensor '" + name + "' has dtype '" + text +
                                           "', neither a safetensors dtype name (BF16, F8_E4M3, ...) nor a torch dtype");
}

bool is_float(Dtype dtype) { return dtype == Dtype::kBF16 || dtype == Dtype::kF16 || dtype == Dtype::kF32; }

/// A DLPack array as the sender sends it: its safetensors dtype and shape, its bytes.
struct Described {
  std::string name;
  Dtype dtype = Dtype::kU8;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;
  uint64_t bytes = 0;
  Device device;
};

class PySender {
 public:
  PySender(const std::variant<std::string, std::vector<std::string>>& address, const std::string& transport,
           const std::string& token, uint64_t bucket_bytes, double timeout, const std::string& device,
           bool share_allocations, uint64_t share_minimum_bytes) {
    SenderOptions options;
    options.transport = parse_transport(transport);
    options.token = token;
    options.bucket_bytes = bucket_bytes;
    options.timeout = milliseconds(timeout);
    options.device = parse_device(device);
    options.share_allocations = share_allocations;
    options.share_minimum_bytes = share_minimum_bytes;
    options.ucx_path = environment_options().ucx_path;
    // One receiver, or several fed at once (tcp, nccl): the ranks of a tensor-parallel engine.
    std::vector<std::string> addresses = std::holds_alternative<std::string>(address)
                                             ? std::vector<std::string>{std::get<std::string>(address)}
                                             : std::get<std::vector<std::string>>(address);
    ReleasedGil release;
    sender_ = std::make_unique<UpdateSender>(addresses, options);
  }

  /// start(format, manifest): `manifest` lists (name, dtype, shape) of every tensor the
  /// update sends; dtype a safetensors name ("BF16") or a torch dtype (or its name).
  void start(const std::string& format, nb::handle manifest, const std::string& base, const std::string& target) {
    auto parsed = format_of(format);
    std::vector<DeclaredTensor> declared;
    for (nb::handle entry : manifest) {
      auto fields = nb::cast<nb::tuple>(nb::borrow(entry), false);
      WS_EXPECT(fields.size() == 3, ErrorCode::kInvalidArgument,
                "update manifest: each entry is (name, dtype, shape), got " + std::to_string(fields.size()) + " fields");
      std::string name = nb::cast<std::string>(fields[0]);
      std::vector<int64_t> shape;
      for (nb::handle dimension : fields[2]) shape.push_back(nb::cast<int64_t>(dimension));
      declared.push_back({name, declared_dtype(fields[1], name), std::move(shape)});
    }
    start_declared(parsed, declared, {base, target});
  }

  /// send_changes(name, base, tensor): in a delta update, the elements of `tensor` that differ
  /// from `base` (host arrays), or the whole tensor where that is cheaper. True: as changes.
  bool send_changes(const std::string& name, nb::handle base, nb::handle tensor, std::optional<std::string> dtype) {
    Described old = describe(name, base, dtype);
    Described next = describe(name, tensor, dtype);
    TensorView old_view{old.name, old.dtype, old.shape, old.data, old.device, 0, old.bytes};
    TensorView view{next.name, next.dtype, next.shape, next.data, next.device, 0, next.bytes};
    ReleasedGil release;  // the caller keeps both arrays referenced meanwhile
    return sender_->send_changes(old_view, view);
  }

  void send(const std::string& name, nb::handle tensor, std::optional<std::string> dtype) {
    send_described(describe(name, tensor, dtype), tensor);
  }

  /// One update of `tensors` (a dict of name -> tensor, or (name, tensor) pairs): declared
  /// whole, sent, finished.
  nb::dict update(nb::handle tensors, const std::string& format) {
    auto parsed = format_of(format);
    nb::object items = nb::isinstance<nb::dict>(tensors) ? nb::borrow<nb::dict>(tensors).attr("items")()
                                                         : nb::borrow(tensors);
    // Where the sender's own time goes, beside the receiver's phases in the report.
    using Clock = std::chrono::steady_clock;
    auto since = [](Clock::time_point begun) { return std::chrono::duration<double>(Clock::now() - begun).count(); };
    nb::dict phases;
    auto begun = Clock::now();
    std::vector<std::pair<Described, nb::object>> described;  // references to the caller's tensors, no copies
    std::vector<DeclaredTensor> declared;
    for (nb::handle item : items) {
      auto pair = nb::cast<nb::tuple>(nb::borrow(item), false);
      WS_EXPECT(pair.size() == 2, ErrorCode::kInvalidArgument,
                "update: each item is (name, tensor), got " + std::to_string(pair.size()) + " fields");
      std::string name = nb::cast<std::string>(pair[0]);
      Described tensor = describe(name, pair[1], std::nullopt);
      declared.push_back({tensor.name, tensor.dtype, tensor.shape});
      described.emplace_back(std::move(tensor), nb::borrow(pair[1]));
    }
    phases["describing"] = since(begun);
    begun = Clock::now();
    start_declared(parsed, declared);
    phases["starting"] = since(begun);
    begun = Clock::now();
    std::vector<TensorView> views;
    views.reserve(described.size());
    for (auto& [tensor, object] : described) views.push_back(view_to_send(tensor, object));
    {
      ReleasedGil release;  // `described` keeps every tensor referenced meanwhile
      for (const TensorView& view : views) sender_->send(view);
    }
    phases["sending"] = since(begun);
    begun = Clock::now();
    nb::dict report = finish();
    phases["finishing"] = since(begun);
    report["sender_phases"] = phases;
    return report;
  }

  /// One whole delta update: `tensors` (a dict of name -> tensor, or (name, tensor) pairs) sent
  /// as their changes since `base_tensors` (a dict of name -> tensor, the version `base` names),
  /// compared several at once; a tensor `base_tensors` lacks, or holds in another dtype or
  /// shape, goes whole; a floating-point weight it holds as FP8 codes with `_scale_inv` scales
  /// (and `tensors` does not) is quantized here and goes as the changes of its codes and scales.
  nb::dict update_changes(nb::handle base_tensors, nb::handle tensors, const std::string& base,
                          const std::string& target) {
    auto bases = nb::cast<nb::dict>(nb::borrow(base_tensors), false);
    nb::object items = nb::isinstance<nb::dict>(tensors) ? nb::borrow<nb::dict>(tensors).attr("items")()
                                                         : nb::borrow(tensors);
    std::vector<std::pair<std::string, nb::object>> pairs;
    std::set<std::string> names;
    for (nb::handle item : items) {
      auto pair = nb::cast<nb::tuple>(nb::borrow(item), false);
      WS_EXPECT(pair.size() == 2, ErrorCode::kInvalidArgument,
                "update_changes: each item is (name, tensor), got " + std::to_string(pair.size()) + " fields");
      pairs.emplace_back(nb::cast<std::string>(pair[0]), nb::borrow(pair[1]));
      names.insert(pairs.back().first);
    }
    enum class How { kWhole, kChanges, kQuantized };
    struct Planned {
      How how = How::kWhole;
      Described tensor, old, scales;
    };
    std::vector<Planned> planned;
    std::vector<DeclaredTensor> declared;
    for (const auto& [name, object] : pairs) {
      Planned& plan = planned.emplace_back();
      plan.tensor = describe(name, object, std::nullopt);
      const std::string scales = name + "_scale_inv";
      if (bases.contains(name)) plan.old = describe(name, bases[name.c_str()], std::nullopt);
      const bool same = bases.contains(name) && plan.old.dtype == plan.tensor.dtype && plan.old.shape == plan.tensor.shape;
      const bool quantized = bases.contains(name) && plan.old.dtype == Dtype::kF8E4M3 &&
                             plan.old.shape == plan.tensor.shape && is_float(plan.tensor.dtype) &&
                             bases.contains(scales) && !names.contains(scales);
      plan.how = same ? How::kChanges : quantized ? How::kQuantized : How::kWhole;
      declared.push_back({name, quantized ? Dtype::kF8E4M3 : plan.tensor.dtype, plan.tensor.shape});
      if (!quantized) continue;
      plan.scales = describe(scales, bases[scales.c_str()], std::nullopt);
      declared.push_back({scales, plan.scales.dtype, plan.scales.shape});
    }
    start_declared(TensorFormat::kCheckpoint, declared, {base, target});
    auto view_of = [](const Described& tensor) {
      return TensorView{tensor.name, tensor.dtype, tensor.shape, tensor.data, tensor.device, 0, tensor.bytes};
    };
    {
      ReleasedGil release;  // `tensors` and `base_tensors` keep every array referenced meanwhile
      // Compared a batch at a time: the encodings of a batch are held until it is queued.
      constexpr uint64_t kBatchBytes = 64ull << 20;
      std::vector<TensorView> base_views, views;
      uint64_t batch_bytes = 0;
      auto send_batch = [&] {
        if (!views.empty()) sender_->send_changes(base_views, views);
        base_views.clear(), views.clear();
        batch_bytes = 0;
      };
      for (const Planned& plan : planned) {
        if (plan.how == How::kChanges) {
          base_views.push_back(view_of(plan.old));
          views.push_back(view_of(plan.tensor));
          batch_bytes += plan.tensor.bytes;
          if (batch_bytes >= kBatchBytes) send_batch();
          continue;
        }
        send_batch();
        if (plan.how == How::kQuantized) {
          sender_->send_quantized_changes(view_of(plan.old), view_of(plan.scales), view_of(plan.tensor));
        } else {
          sender_->send(view_of(plan.tensor));
        }
      }
      send_batch();
    }
    return finish();
  }

  Described describe(const std::string& name, nb::handle tensor, const std::optional<std::string>& dtype) {
    if (!dtype) {
      if (auto facts = torch_tensor_facts(tensor)) {
        return {name, facts->dtype, std::move(facts->shape), facts->data, facts->bytes, facts->device};
      }
    }
    auto array = nb::cast<nb::ndarray<nb::ro>>(tensor, false);
    int64_t expected_stride = 1;
    for (size_t i = array.ndim(); i-- > 0;) {
      WS_EXPECT(array.shape(i) <= 1 || array.stride(i) == expected_stride, ErrorCode::kInvalidArgument,
                "tensor '" + name + "' is not contiguous (row-major); pass tensor.contiguous()");
      expected_stride *= static_cast<int64_t>(array.shape(i));
    }
    std::vector<int64_t> shape;
    for (size_t i = 0; i < array.ndim(); ++i) shape.push_back(static_cast<int64_t>(array.shape(i)));
    Dtype parsed = dtype_of(array, dtype, name);
    // Raw bytes weightstream itself gave (load() or stream() of BF16 or F8 without torch, as
    // numpy arrays too) carry their dtype, as LoadSession.load finds it: no need to name it.
    std::optional<Dtype> raw = dtype ? std::nullopt : raw_array_dtype(array.data(), array.nbytes());
    if (raw && parsed == Dtype::kU8) parsed = *raw;
    unsigned bits = dtype_bits(parsed);
    // Raw bytes of [*shape, itemsize] (how weightstream hands out BF16 and F8 without torch: an
    // F8 array weightstream gave ends in [1] too; one named F8 by the caller is taken as shaped).
    if ((dtype || raw) && array.dtype().bits == 8 && bits % 8 == 0 && (bits > 8 || raw) && !shape.empty() &&
        shape.back() == bits / 8) {
      shape.pop_back();
    }
    auto bytes = tensor_byte_size(parsed, shape);
    WS_EXPECT(bytes && *bytes == array.nbytes(), ErrorCode::kInvalidArgument,
              "tensor '" + name + "' holds " + std::to_string(array.nbytes()) + " bytes, not the " +
                  std::string(dtype_name(parsed)) + " " + shape_text(shape) + " it claims");
    Device device = array.device_type() == nb::device::cuda::value ? Device{Device::Kind::kCuda, array.device_id()}
                                                                   : Device{};
    return {name, parsed, std::move(shape), static_cast<const std::byte*>(array.data()), *bytes, device};
  }

  /// The view a described tensor is sent as; `tensor` is the Python object that holds its
  /// bytes. Device bytes are copied when their bucket is sealed or read in place by the
  /// receiver until finish(): the tensor is kept alive until then (a temporary such as
  /// p.to(bf16) would otherwise go back to the caching allocator and be overwritten). Valid
  /// until the update finishes, they may travel from where they lie (ucx: GPU to GPU).
  TensorView view_to_send(const Described& described, nb::handle tensor) {
    TensorView view{described.name, described.dtype, described.shape, described.data, described.device, 0,
                    described.bytes};
    if (described.device.is_cuda()) {
      kept_alive_.push_back(nb::borrow(tensor));
      view.lifetime = SourceLifetime::kLoad;
    }
    return view;
  }

  /// Sends a described tensor; `tensor` is the Python object that holds its bytes.
  void send_described(const Described& described, nb::handle tensor) {
    TensorView view = view_to_send(described, tensor);
    ReleasedGil release;  // the caller keeps the array referenced meanwhile
    sender_->send(view);
  }

  void start_declared(TensorFormat format, const std::vector<DeclaredTensor>& declared,
                      const UpdateVersions& versions = {}) {
    ReleasedGil release;
    sender_->start(format, declared, versions);
  }

  void flush() {
    ReleasedGil release;
    sender_->flush();
  }

  nb::dict finish() {
    UpdateReport report;
    try {
      ReleasedGil release;
      report = sender_->finish();
    } catch (...) {
      kept_alive_.clear();
      throw;
    }
    kept_alive_.clear();
    return report_dict(report);
  }

  static nb::dict report_dict(const UpdateReport& report) {
    nb::dict result;
    result["format"] = report.format == TensorFormat::kEngine ? "engine" : "checkpoint";
    result["buckets"] = report.buckets;
    result["tensors"] = report.tensors;
    result["bytes"] = report.bytes;
    result["shared_bytes"] = report.shared_bytes;
    result["placed_bytes"] = report.placed_bytes;
    result["sparse_tensors"] = report.sparse_tensors;
    result["dense_tensors"] = report.dense_tensors;
    result["checked_tensors"] = report.checked_tensors;
    result["regions"] = report.regions;
    result["seconds"] = report.seconds;
    result["connect_seconds"] = report.connect_seconds;
    result["gbps"] = report.gbps();
    nb::dict phases;
    for (const auto& [name, phase] : kUpdatePhases) phases[name] = report.phases.*phase;
    result["phases"] = phases;
    result["model_hook_runs"] = report.counters.model_hook_runs;
    result["parameters_completed"] = report.counters.parameters_completed;
    result["completed_layers"] = report.completed_layers;
    return result;
  }

 private:
  std::unique_ptr<UpdateSender> sender_;
  std::vector<nb::object> kept_alive_;  // device tensors of the open update
};

class PyReceiver {
 public:
  PyReceiver(nb::object layout, const std::string& transport, const std::string& listen, const std::string& token,
             double timeout, const std::string& device, double handshake_timeout, bool open_without_token)
      : layout_object_(std::move(layout)) {
    ReceiverOptions options;
    options.transport = parse_transport(transport);
    options.listen = listen;
    options.token = token;
    options.open_without_token = open_without_token;
    options.timeout = milliseconds(timeout);
    options.handshake_timeout = milliseconds(handshake_timeout);
    options.device = parse_device(device);
    receiver_ = std::make_unique<UpdateReceiver>(python_layout(layout_object_), options);
    std::lock_guard lock(exit_state().mutex);
    exit_state().receivers.insert(this);
    if (exit_state().exiting) receiver_->cancel();
  }
  ~PyReceiver() {
    std::lock_guard lock(exit_state().mutex);
    exit_state().receivers.erase(this);
  }
  PyReceiver(const PyReceiver&) = delete;
  PyReceiver& operator=(const PyReceiver&) = delete;

  void cancel() noexcept { receiver_->cancel(); }

  const std::string& address() const { return receiver_->address(); }

  nb::dict receive(double accept_timeout) {
    auto wait = milliseconds(accept_timeout);
    UpdateReport report;
    {
      // Python model hooks take the GIL back themselves.
      ReleasedGil release(/*receiving=*/true);
      report = receiver_->receive(wait);
    }
    return PySender::report_dict(report);
  }

  std::string version() const { return receiver_->version(); }

  /// The receiver's own counters (ReceiverStats), read at any time from any thread.
  nb::dict stats() const {
    const ReceiverStats stats = receiver_->stats();
    nb::dict result;
    result["senders_accepted"] = stats.senders_accepted;
    result["connections_refused"] = stats.connections_refused;
    result["updates_started"] = stats.updates_started;
    result["updates_completed"] = stats.updates_completed;
    result["updates_failed"] = stats.updates_failed;
    result["updating"] = stats.updating;
    return result;
  }
  void set_version(const std::string& content_digest) { receiver_->set_version(content_digest); }

  void refuse(const std::string& reason, double accept_timeout) {
    auto wait = milliseconds(accept_timeout);
    ReleasedGil release(/*receiving=*/true);
    receiver_->refuse(reason, wait);
  }

 private:
  nb::object layout_object_;  // keeps the layout (and its storage) alive
  std::unique_ptr<UpdateReceiver> receiver_;
};

/// The atexit handler: cancels every receiver, then waits (without the GIL) until each
/// thread inside receive() has parked and each thread re-taking the GIL holds it.
void stop_receivers_at_exit() {
  ExitState& exit = exit_state();
  {
    std::lock_guard lock(exit.mutex);
    exit.exiting = true;
    for (PyReceiver* receiver : exit.receivers) receiver->cancel();
  }
  nb::gil_scoped_release release;  // the interpreter is not finalizing yet: safe to take back
  std::unique_lock lock(exit.mutex);
  exit.changed.wait(lock, [&] { return exit.receiving == 0 && exit.reacquiring == 0; });
}

}  // namespace

void bind_transfer(nb::module_& m) {
  nb::class_<PySender>(m, "UpdateSender",
                       "Pushes tensors to an UpdateReceiver in buckets over one connection: for each update, "
                       "update(tensors, format), or start(format, manifest), send(name, tensor) for every declared "
                       "tensor, finish().")
      .def(nb::init<const std::variant<std::string, std::vector<std::string>>&, const std::string&, const std::string&,
                    uint64_t, double, const std::string&, bool, uint64_t>(),
           "address"_a, "transport"_a = "tcp", "token"_a = "", "bucket_bytes"_a = kDefaultBucketBytes,
           "timeout"_a = 30.0, "device"_a = "cpu", "share_allocations"_a = true,
           "share_minimum_bytes"_a = kDefaultShareMinimumBytes)
      .def("start", &PySender::start, "format"_a, "manifest"_a, nb::kw_only(), "base"_a = "", "target"_a = "",
           "Starts an update declaring every tensor it sends: manifest is a list of (name, dtype, shape), dtype a "
           "safetensors name (\"BF16\") or a torch dtype. Each receiver checks it against its model before any "
           "bucket; a refusal raises weightstream.Error with the receiver's reason, nothing applied. base (a content "
           "digest) makes it a delta update, refused by a receiver that holds another version; target names the "
           "version the receivers hold after it (docs/DELTA.md).")
      .def("send_changes", &PySender::send_changes, "name"_a, "base"_a, "tensor"_a, "dtype"_a = nb::none(),
           "In a delta update: sends the elements of tensor that differ from base (both host arrays of one dtype and "
           "shape), or the whole tensor where that is cheaper. Returns True when it went as changed elements.")
      .def("send", &PySender::send, "name"_a, "tensor"_a, "dtype"_a = nb::none(),
           "Sends a declared tensor; one the manifest does not declare, or declares otherwise, raises "
           "weightstream.Error before anything of it is sent.")
      .def("update", &PySender::update, "tensors"_a, "format"_a = "checkpoint",
           "One whole update: tensors is a dict of name -> tensor or (name, tensor) pairs (an iterator is taken "
           "into a list of references first); they are declared, sent and finished. Returns the report, with "
           "sender_phases: the sender's seconds describing the tensors, starting (until every receiver accepted), "
           "sending and finishing.")
      .def("update_changes", &PySender::update_changes, "base_tensors"_a, "tensors"_a, nb::kw_only(), "base"_a,
           "target"_a = "",
           "One whole delta update (docs/DELTA.md): tensors (a dict of name -> host tensor, or (name, tensor) "
           "pairs) sent as their changes since base_tensors (a dict of name -> host tensor, the version base "
           "names), whole where that is cheaper or base_tensors lacks one. Returns the report.")
      .def("flush", &PySender::flush)
      .def("finish", &PySender::finish);
  nb::class_<PyReceiver>(m, "UpdateReceiver",
                         "Listens (loopback by default) and applies pushed updates to a ModelLayout.")
      .def(nb::init<nb::object, const std::string&, const std::string&, const std::string&, double, const std::string&,
                    double, bool>(),
           "layout"_a, "transport"_a = "tcp", "listen"_a = "", "token"_a = "", "timeout"_a = 30.0, "device"_a = "cpu",
           "handshake_timeout"_a = 3.0, nb::kw_only(), "open_without_token"_a = false,
           "A non-empty token (which senders must prove, never sent) is required; open_without_token=True accepts "
           "any sender instead (warned about on stderr).")
      .def_prop_ro("address", &PyReceiver::address)
      .def_prop_rw("version", &PyReceiver::version, &PyReceiver::set_version,
                   "The content digest of the version the layout holds (set it after a load); a delta update must "
                   "name it as its base. Each update that lands sets it to its target; \"\": unknown.")
      .def_prop_ro("stats", &PyReceiver::stats,
                   "The receiver's counters: senders_accepted, connections_refused, updates_started, "
                   "updates_completed, updates_failed, and updating (an update under way); weightstream.metrics "
                   "shows them")
      .def("receive", &PyReceiver::receive, "accept_timeout"_a = 600.0)
      .def("refuse", &PyReceiver::refuse, "reason"_a, "accept_timeout"_a = 600.0,
           "Refuses the next update with reason (a check only the engine can make): waits for the sender and its "
           "start() as receive() does, tells it why (its start() raises weightstream.Error with the reason) and "
           "raises weightstream.Error (code \"model\") here. Nothing is applied.")
      .def("cancel", &PyReceiver::cancel,
           "Stops receive() in any thread: waiting, it raises weightstream.Error (code \"cancelled\") at once; "
           "mid-update, the connection is shut down and the update fails (layers not completed keep their old "
           "values). Every later receive() raises it too.");
  m.def("_stop_receivers_at_exit", &stop_receivers_at_exit,
        "Cancels every UpdateReceiver and parks the threads inside receive() (registered with atexit).");
}

}  // namespace weightstream::python
