// The UCX shim (ucx.hpp) over the ucp API.
#include <poll.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "transfer/ucx.hpp"
#include "weightstream/error.hpp"

namespace weightstream::transfer::ucx {
namespace {

using Clock = std::chrono::steady_clock;

/// Reads in flight on one endpoint before get() waits for the oldest: enough to keep a
/// link busy, few enough that cancelling them at a failure is quick.
constexpr size_t kMaxReadsInFlight = 64;

std::string status_text(ucs_status_t status) { return ucs_status_string(status); }

[[noreturn]] void fail(ErrorCode code, const std::string& operation, ucs_status_t status) {
  WS_FAIL(code, "UCX: " + operation + " failed: " + status_text(status));
}

/// Waits up to `milliseconds` for the worker's event descriptor, after arming it; returns
/// at once when events are already pending (ucp_worker_arm says UCS_ERR_BUSY).
void wait_for_events(ucp_worker_h worker, int efd, int milliseconds) {
  if (ucp_worker_arm(worker) != UCS_OK) return;
  pollfd descriptor{efd, POLLIN, 0};
  (void)::poll(&descriptor, 1, milliseconds);
}

}  // namespace

bool compiled() noexcept { return true; }

std::string library_version() { return ucp_get_version_string(); }

Registration::~Registration() {
  if (handle_ != nullptr) ucp_mem_unmap(static_cast<ucp_context_h>(context_), static_cast<ucp_mem_h>(handle_));
}

struct Worker::State {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int efd = -1;
  std::thread progress;
  std::atomic<bool> stop{false};
};

Worker::Worker() : state_(std::make_unique<State>()) {
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) fail(ErrorCode::kConfig, "reading the UCX_* configuration (ucp_config_read)", status);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  status = ucp_init(&params, config, &state_->context);
  ucp_config_release(config);
  if (status != UCS_OK) fail(ErrorCode::kNetwork, "starting a context (ucp_init)", status);
  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  status = ucp_worker_create(state_->context, &worker_params, &state_->worker);
  if (status != UCS_OK) {
    ucp_cleanup(state_->context);
    fail(ErrorCode::kNetwork, "creating a worker (ucp_worker_create)", status);
  }
  status = ucp_worker_get_efd(state_->worker, &state_->efd);
  if (status != UCS_OK) {
    ucp_worker_destroy(state_->worker);
    ucp_cleanup(state_->context);
    fail(ErrorCode::kNetwork, "getting the worker's event descriptor (ucp_worker_get_efd)", status);
  }
}

void Worker::stop_progress() {
  if (state_->progress.joinable()) {
    state_->stop = true;
    ucp_worker_signal(state_->worker);
    state_->progress.join();
  }
}

Worker::~Worker() {
  stop_progress();
  ucp_worker_destroy(state_->worker);
  ucp_cleanup(state_->context);
}

std::vector<std::byte> Worker::address() const {
  ucp_address_t* address = nullptr;
  size_t length = 0;
  ucs_status_t status = ucp_worker_get_address(state_->worker, &address, &length);
  if (status != UCS_OK) fail(ErrorCode::kNetwork, "getting the worker address (ucp_worker_get_address)", status);
  std::vector<std::byte> bytes(length);
  std::memcpy(bytes.data(), address, length);
  ucp_worker_release_address(state_->worker, address);
  return bytes;
}

std::unique_ptr<Registration> Worker::register_memory(const std::byte* data, uint64_t bytes, Memory memory) {
  std::unique_ptr<Registration> registration(new Registration());
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  params.address = const_cast<std::byte*>(data);
  params.length = bytes;
  if (memory == Memory::kCuda) {
    WS_EXPECT(moves_cuda_memory(), ErrorCode::kUnsupported,
              "registering GPU memory with UCX " + library_version() +
                  ": this UCX is not CUDA-aware (a CUDA-aware build, e.g. the libucx-cu13 wheel's, moves GPU memory)");
    params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    params.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  ucp_mem_h handle = nullptr;
  ucs_status_t status = ucp_mem_map(state_->context, &params, &handle);
  if (status != UCS_OK) {
    fail(ErrorCode::kNetwork, "registering " + std::to_string(bytes) + " bytes for remote reads (ucp_mem_map)", status);
  }
  registration->context_ = state_->context;
  registration->handle_ = handle;
  registration->address_ = reinterpret_cast<uint64_t>(data);
  registration->bytes_ = bytes;
  void* packed = nullptr;
  size_t packed_bytes = 0;
  status = ucp_rkey_pack(state_->context, handle, &packed, &packed_bytes);
  if (status != UCS_OK) fail(ErrorCode::kNetwork, "packing a remote key (ucp_rkey_pack)", status);
  registration->remote_key_.resize(packed_bytes);
  std::memcpy(registration->remote_key_.data(), packed, packed_bytes);
  ucp_rkey_buffer_release(packed);
  return registration;
}

bool Worker::moves_cuda_memory() const {
  ucp_context_attr_t attributes{};
  attributes.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(state_->context, &attributes) != UCS_OK) return false;
  return (attributes.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

void Worker::start_progress() {
  if (state_->progress.joinable()) return;
  State* state = state_.get();
  state->progress = std::thread([state] {
    while (!state->stop.load(std::memory_order_relaxed)) {
      while (ucp_worker_progress(state->worker) != 0) {
      }
      // Sleeps until traffic arrives; ucp_worker_signal (the destructor) wakes it to stop.
      wait_for_events(state->worker, state->efd, 200);
    }
  });
}

struct Endpoint::State {
  ucp_worker_h worker = nullptr;
  int efd = -1;
  ucp_ep_h ep = nullptr;
  std::vector<ucp_rkey_h> keys;
  std::vector<void*> in_flight;
  ucs_status_t failure = UCS_OK;  // set by the error handler (the peer died or reset)
  ucs_status_t first_error = UCS_OK;

  static void on_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* state = static_cast<State*>(arg);
    if (state->failure == UCS_OK) state->failure = status;
  }

  /// Frees the reads that have ended; true when at least one did.
  bool reap() {
    bool ended = false;
    std::erase_if(in_flight, [&](void* request) {
      ucs_status_t status = ucp_request_check_status(request);
      if (status == UCS_INPROGRESS) return false;
      if (status != UCS_OK && first_error == UCS_OK) first_error = status;
      ucp_request_free(request);
      ended = true;
      return true;
    });
    return ended;
  }

  /// Progresses until at most `keep` reads are in flight; a read failing, or none ending
  /// for `timeout`, throws (after cancelling the others).
  void drain(size_t keep, std::chrono::milliseconds timeout, const std::string& peer) {
    auto last_progress = Clock::now();
    while (in_flight.size() > keep) {
      while (ucp_worker_progress(worker) != 0) {
      }
      if (reap()) last_progress = Clock::now();
      if (first_error != UCS_OK || failure != UCS_OK) {
        cancel_all();
        ucs_status_t status = first_error != UCS_OK ? first_error : failure;
        WS_FAIL(ErrorCode::kNetwork, "UCX read from " + peer + " failed: " + status_text(status));
      }
      if (in_flight.size() <= keep) break;
      if (Clock::now() - last_progress > timeout) {
        size_t pending = in_flight.size();
        cancel_all();
        WS_FAIL(ErrorCode::kTimeout, "UCX reads from " + peer + ": " + std::to_string(pending) +
                                         " still in flight after " + std::to_string(timeout.count()) +
                                         " ms without progress (is the peer alive and reachable?)");
      }
      wait_for_events(worker, efd, 50);
    }
  }

  void cancel_all() {
    for (void* request : in_flight) ucp_request_cancel(worker, request);
    auto until = Clock::now() + std::chrono::seconds(2);
    while (!in_flight.empty() && Clock::now() < until) {
      ucp_worker_progress(worker);
      reap();
    }
    // Requests UCX did not end in time stay with it; they are freed, not waited for.
    for (void* request : in_flight) ucp_request_free(request);
    in_flight.clear();
  }
};

Endpoint::Endpoint(std::unique_ptr<State> state, std::string peer) : state_(std::move(state)), peer_(std::move(peer)) {}

Endpoint::~Endpoint() {
  State& state = *state_;
  if (!state.in_flight.empty()) state.cancel_all();
  for (ucp_rkey_h key : state.keys) ucp_rkey_destroy(key);
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;  // no flush: a dead peer would stall it
  ucs_status_ptr_t request = ucp_ep_close_nbx(state.ep, &param);
  if (UCS_PTR_IS_PTR(request)) {
    auto until = Clock::now() + std::chrono::seconds(2);
    while (ucp_request_check_status(request) == UCS_INPROGRESS && Clock::now() < until) ucp_worker_progress(state.worker);
    ucp_request_free(request);
  }
}

uint32_t Endpoint::add_remote_key(std::span<const std::byte> packed) {
  ucp_rkey_h key = nullptr;
  ucs_status_t status = ucp_ep_rkey_unpack(state_->ep, packed.data(), &key);
  if (status != UCS_OK) fail(ErrorCode::kProtocol, "unpacking a remote key of " + peer_ + " (ucp_ep_rkey_unpack)", status);
  state_->keys.push_back(key);
  return static_cast<uint32_t>(state_->keys.size() - 1);
}

void Endpoint::get(std::byte* destination, uint64_t remote_address, uint32_t key, uint64_t bytes,
                   std::chrono::milliseconds timeout, Memory destination_memory) {
  State& state = *state_;
  WS_EXPECT(key < state.keys.size(), ErrorCode::kInternal, "UCX read with an unknown remote key");
  if (bytes == 0) return;
  if (state.failure != UCS_OK) {
    WS_FAIL(ErrorCode::kNetwork, "UCX endpoint to " + peer_ + " failed: " + status_text(state.failure));
  }
  ucp_request_param_t param{};
  if (destination_memory == Memory::kCuda) {
    param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  ucs_status_ptr_t request = ucp_get_nbx(state.ep, destination, bytes, remote_address, state.keys[key], &param);
  if (UCS_PTR_IS_ERR(request)) {
    fail(ErrorCode::kNetwork,
         "reading " + std::to_string(bytes) + " bytes at remote address " + std::to_string(remote_address) + " of " + peer_ +
             " (ucp_get_nbx)",
         UCS_PTR_STATUS(request));
  }
  if (request != nullptr) state.in_flight.push_back(request);
  if (state.in_flight.size() >= kMaxReadsInFlight) state.drain(kMaxReadsInFlight / 2, timeout, peer_);
}

void Endpoint::put(const std::byte* source, uint64_t remote_address, uint32_t key, uint64_t bytes,
                   std::chrono::milliseconds timeout) {
  State& state = *state_;
  WS_EXPECT(key < state.keys.size(), ErrorCode::kInternal, "UCX write with an unknown remote key");
  if (bytes == 0) return;
  if (state.failure != UCS_OK) {
    WS_FAIL(ErrorCode::kNetwork, "UCX endpoint to " + peer_ + " failed: " + status_text(state.failure));
  }
  ucp_request_param_t param{};
  ucs_status_ptr_t request = ucp_put_nbx(state.ep, source, bytes, remote_address, state.keys[key], &param);
  if (UCS_PTR_IS_ERR(request)) {
    fail(ErrorCode::kNetwork, "writing " + std::to_string(bytes) + " bytes to " + peer_ + " (ucp_put_nbx)",
         UCS_PTR_STATUS(request));
  }
  if (request != nullptr) state.in_flight.push_back(request);
  if (state.in_flight.size() >= kMaxReadsInFlight) state.drain(kMaxReadsInFlight / 2, timeout, peer_);
}

void Endpoint::flush(std::chrono::milliseconds timeout) {
  State& state = *state_;
  state.drain(0, timeout, peer_);
  ucp_request_param_t param{};
  ucs_status_ptr_t request = ucp_ep_flush_nbx(state.ep, &param);
  if (UCS_PTR_IS_ERR(request)) fail(ErrorCode::kNetwork, "flushing the endpoint to " + peer_, UCS_PTR_STATUS(request));
  if (request != nullptr) {
    state.in_flight.push_back(request);
    state.drain(0, timeout, peer_);
  }
  if (state.failure != UCS_OK) {
    WS_FAIL(ErrorCode::kNetwork, "UCX endpoint to " + peer_ + " failed: " + status_text(state.failure));
  }
}

void Endpoint::wait(std::chrono::milliseconds timeout) {
  State& state = *state_;
  state.drain(0, timeout, peer_);
  // Reads that completed inline are done; a flush makes sure of the rest of the endpoint.
  if (state.failure != UCS_OK) {
    WS_FAIL(ErrorCode::kNetwork, "UCX endpoint to " + peer_ + " failed: " + status_text(state.failure));
  }
}

std::unique_ptr<Endpoint> Worker::connect(std::span<const std::byte> address, const std::string& peer) {
  auto state = std::make_unique<Endpoint::State>();
  state->worker = state_->worker;
  state->efd = state_->efd;
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Endpoint::State::on_error;
  params.err_handler.arg = state.get();
  ucs_status_t status = ucp_ep_create(state_->worker, &params, &state->ep);
  if (status != UCS_OK) fail(ErrorCode::kNetwork, "connecting to " + peer + " (ucp_ep_create)", status);
  return std::unique_ptr<Endpoint>(new Endpoint(std::move(state), peer));
}

}  // namespace weightstream::transfer::ucx
