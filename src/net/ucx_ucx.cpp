// The UCX shim (ucx.hpp) over the ucp API.
#include <poll.h>
#include <stdio.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>

#include "net/ucx.hpp"
#include "net/ucx_detail.hpp"
#include "weightstream/error.hpp"

namespace weightstream::transfer::ucx {

using namespace detail;

namespace {

/// Compares secrets in time independent of where they differ.
bool same_secret(const Secret& a, const Secret& b) {
  unsigned char difference = 0;
  for (size_t i = 0; i < a.size(); ++i) difference |= static_cast<unsigned char>(a[i] ^ b[i]);
  return difference == 0;
}

/// The memory registered with one worker: a send request is answered only from inside it.
struct RegionTable {
  struct Region {
    uint64_t address = 0;
    uint64_t bytes = 0;
    ucp_mem_h handle = nullptr;
    Memory memory = Memory::kHost;
  };
  std::mutex mutex;
  std::vector<Region> regions;

  std::optional<Region> containing(uint64_t address, uint64_t bytes) {
    std::lock_guard lock(mutex);
    for (const Region& region : regions) {
      if (address >= region.address && bytes <= region.bytes && address - region.address <= region.bytes - bytes) {
        return region;
      }
    }
    return std::nullopt;
  }
};

}  // namespace

bool compiled() noexcept { return true; }

std::string library_version() { return ucp_get_version_string(); }

std::string_view path_name(Path path) noexcept { return path == Path::kRma ? "rma" : "rendezvous"; }

Secret random_secret() {
  std::random_device device;  // getrandom(2) on Linux
  Secret secret;
  for (size_t i = 0; i < secret.size(); i += 4) {
    const uint32_t word = device();
    std::memcpy(secret.data() + i, &word, 4);
  }
  return secret;
}

Registration::~Registration() {
  if (handle_ == nullptr) return;
  if (table_ != nullptr) {
    auto* table = static_cast<RegionTable*>(table_);
    std::lock_guard lock(table->mutex);
    std::erase_if(table->regions, [&](const RegionTable::Region& region) { return region.handle == handle_; });
  }
  ucp_mem_unmap(static_cast<ucp_context_h>(context_), static_cast<ucp_mem_h>(handle_));
}

struct Worker::State {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int efd = -1;
  std::thread progress;
  std::atomic<bool> stop{false};
  RegionTable table;
  uint64_t next_tag = 1;  // tags of this worker's rendezvous reads
  // Serving side: send requests answered, and their sends not yet ended.
  Secret request_secret{};
  std::atomic<uint64_t> sends_in_flight{0};
  /// Each send not yet ended and the endpoint (back to its puller) it went on: the progress
  /// thread's. An endpoint that holds one is alive (UCX ends an endpoint's requests before
  /// it destroys one that failed), so stop_progress() can close it by force.
  std::unordered_map<void*, ucp_ep_h> sends;
  std::atomic<uint64_t> sends_ended_at_stop{0};
  std::atomic<uint64_t> bytes_sent_on_request{0};  // the ranges those sends carried
  // Receiving side of send_message.
  Secret message_secret{};
  Place place;
  Landed landed;

  struct Arrival {
    State* state = nullptr;
    std::vector<std::byte> header;
    uint64_t bytes = 0;
    std::unique_ptr<std::byte[]> discarded;  // a refused payload's landing place: it is received, then dropped
  };
  /// A message whose place was not known yet (Landing::later), until it is: the progress
  /// thread's alone.
  struct Kept {
    std::vector<std::byte> header;   // the caller's part of the header
    uint64_t bytes = 0;
    void* data = nullptr;            // rendezvous: UCX's descriptor of the payload
    std::vector<std::byte> payload;  // eager: the payload, copied
  };
  std::vector<Kept> kept;
  uint64_t receives_in_flight = 0;  // payloads being received: the progress thread's
  std::atomic<bool> woken{false};  // wake() was called: ask place() again for the kept messages

  static void on_sent(void* request, ucs_status_t, void* user_data) {
    auto* state = static_cast<State*>(user_data);
    state->sends.erase(request);
    state->sends_in_flight.fetch_sub(1, std::memory_order_relaxed);
    ucp_request_free(request);
  }

  /// A puller asks for a range: send it with its tag from registered memory, on the
  /// endpoint back to the puller. A request without the secret gets nothing; a range
  /// outside every registration gets an empty message, which fails the puller's read.
  static ucs_status_t on_send_request(void* arg, const void* header, size_t header_length, void*, size_t,
                                      const ucp_am_recv_param_t* param) {
    auto* state = static_cast<State*>(arg);
    if (header_length != sizeof(SendRequest) || (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
      return UCS_OK;
    }
    SendRequest request;
    std::memcpy(&request, header, sizeof(request));
    if (!same_secret(request.secret, state->request_secret)) return UCS_OK;
    std::optional<RegionTable::Region> region = state->table.containing(request.address, request.bytes);
    ucp_request_param_t send{};
    send.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    send.cb.send = &State::on_sent;
    send.user_data = state;
    const void* source = nullptr;
    size_t bytes = 0;
    if (region && request.bytes > 0) {
      source = reinterpret_cast<const void*>(request.address);
      bytes = request.bytes;
      send.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;  // registered already: no registration per send
      send.memh = region->handle;
      if (region->memory == Memory::kCuda) {
        send.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
        send.memory_type = UCS_MEMORY_TYPE_CUDA;
      }
    }
    ucs_status_ptr_t sending = ucp_tag_send_nbx(param->reply_ep, source, bytes, request.tag, &send);
    if (UCS_PTR_IS_PTR(sending)) {
      state->sends.emplace(sending, param->reply_ep);
      state->sends_in_flight.fetch_add(1, std::memory_order_relaxed);
    }
    if (!UCS_PTR_IS_ERR(sending)) state->bytes_sent_on_request.fetch_add(bytes, std::memory_order_relaxed);
    return UCS_OK;
  }

  static void on_arrived(void* request, ucs_status_t status, size_t, void* user_data) {
    std::unique_ptr<Arrival> arrival(static_cast<Arrival*>(user_data));
    --arrival->state->receives_in_flight;
    arrival->state->landed(arrival->header, arrival->bytes, status == UCS_OK && !arrival->discarded);
    ucp_request_free(request);
  }

  /// Starts the landing of a rendezvous message's payload (UCX's descriptor `data`) at
  /// `destination`; `landed` runs once it is there.
  void receive_into(std::byte* destination, std::span<const std::byte> header, void* data, uint64_t bytes,
                    const Device& device = {}) {
    auto arrival = std::make_unique<Arrival>(Arrival{this, {header.begin(), header.end()}, bytes, nullptr});
    if (destination == nullptr) {  // refused after it was kept: received, so that its sender's request ends
      arrival->discarded = std::make_unique<std::byte[]>(std::max<uint64_t>(bytes, 1));
      destination = arrival->discarded.get();
    }
    ucp_request_param_t receive{};
    receive.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    receive.cb.recv_am = &State::on_arrived;
    receive.user_data = arrival.get();
    if (device.is_cuda() && !arrival->discarded) {
      receive.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
      receive.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    ucs_status_ptr_t receiving = ucp_am_recv_data_nbx(worker, data, destination, bytes, &receive);
    if (UCS_PTR_IS_PTR(receiving)) {
      arrival.release();  // on_arrived owns it
      ++receives_in_flight;
    } else {
      landed(header, bytes, !UCS_PTR_IS_ERR(receiving) && !arrival->discarded);
    }
  }

  /// A message for accept_messages: its payload lands where `place` says, or waits for it.
  static ucs_status_t on_message(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                 const ucp_am_recv_param_t* param) {
    auto* state = static_cast<State*>(arg);
    const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    // Refusing a rendezvous message with an error status fails the sender's request with it.
    const ucs_status_t refused = rendezvous ? UCS_ERR_INVALID_PARAM : UCS_OK;
    if (header_length < sizeof(Secret) || header_length > sizeof(Secret) + kMaxMessageHeader) return refused;
    Secret secret;
    std::memcpy(secret.data(), header, secret.size());
    if (!same_secret(secret, state->message_secret)) return refused;
    std::span<const std::byte> user_header(static_cast<const std::byte*>(header) + secret.size(),
                                           header_length - secret.size());
    const Landing landing = state->place(user_header, length);
    if (landing.later) {
      Kept message{{user_header.begin(), user_header.end()}, length};
      if (rendezvous) {
        message.data = data;  // UCX keeps the payload at the sender until it is received
      } else {
        const auto* bytes = static_cast<const std::byte*>(data);
        message.payload.assign(bytes, bytes + length);
      }
      state->kept.push_back(std::move(message));
      return rendezvous ? UCS_INPROGRESS : UCS_OK;
    }
    if (landing.destination == nullptr) return refused;
    if (!rendezvous) {  // eager: the payload is here already
      state->landed(user_header, length, copy_eager(landing, data, length));
      return UCS_OK;
    }
    state->receive_into(landing.destination, user_header, data, length, landing.device);
    return UCS_INPROGRESS;  // the receive was started: UCX owns the descriptor
  }

  /// After wake(): asks `place` again for each kept message, and lands those it now places.
  /// True when it was woken (receives may have started: progress the worker).
  bool retry_kept() {
    if (!woken.exchange(false, std::memory_order_acq_rel)) return false;
    std::vector<Kept> waiting;
    waiting.swap(kept);
    for (Kept& message : waiting) {
      const Landing landing = place(message.header, message.bytes);
      if (landing.later) {
        kept.push_back(std::move(message));
      } else {
        land_kept(message, landing);
      }
    }
    return true;
  }

  /// Lands a kept message at `destination`; null: refused, its payload received and dropped.
  void land_kept(Kept& message, const Landing& landing) {
    if (message.data != nullptr) {
      return receive_into(landing.destination, message.header, message.data, message.bytes, landing.device);
    }
    landed(message.header, message.bytes,
           landing.destination != nullptr && copy_eager(landing, message.payload.data(), message.bytes));
  }

  /// Copies an eager payload to where it lands (a GPU's memory by a copy to the device).
  /// False when that copy failed: the piece did not land.
  static bool copy_eager(const Landing& landing, const void* data, uint64_t bytes) {
    if (!landing.device.is_cuda()) {
      std::memcpy(landing.destination, data, bytes);
      return true;
    }
    try {
      copy_bytes(landing.destination, landing.device, data, Device{}, bytes);
      return true;
    } catch (const Error&) {
      return false;
    }
  }

  /// Refuses the messages still kept (the worker stops): each is received and dropped, so
  /// that its sender's request ends (UCX 1.13 asserts when an endpoint with a rendezvous
  /// still pending goes).
  void drop_kept() {
    for (Kept& message : kept) land_kept(message, Landing{});
    kept.clear();
  }

  /// Sends a puller never took (paused or frozen with its reads posted, it turns no worker)
  /// would stay on their endpoints, and UCX 1.13 aborts the process at ucp_worker_destroy on
  /// an endpoint that still holds a request (ucp_ep.c, the proto_reqs assertion; ucp_request_cancel
  /// ends tagged receives only): the endpoints that hold such sends are closed by force,
  /// which ends them (cancelled), before the worker goes. Progress thread, at its end.
  void end_sends_by_force() {
    if (sends.empty()) return;
    sends_ended_at_stop.store(sends.size(), std::memory_order_relaxed);
    std::vector<ucp_ep_h> endpoints;
    for (const auto& [request, ep] : sends) {
      if (std::find(endpoints.begin(), endpoints.end(), ep) == endpoints.end()) endpoints.push_back(ep);
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    std::vector<ucs_status_ptr_t> closing;
    for (ucp_ep_h ep : endpoints) {
      ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
      if (UCS_PTR_IS_PTR(request)) closing.push_back(request);
    }
    const auto until = Clock::now() + std::chrono::seconds(2);
    auto open = [&] {
      return std::any_of(closing.begin(), closing.end(),
                         [](ucs_status_ptr_t request) { return ucp_request_check_status(request) == UCS_INPROGRESS; });
    };
    while ((open() || !sends.empty()) && Clock::now() < until) ucp_worker_progress(worker);
    for (ucs_status_ptr_t request : closing) ucp_request_free(request);
  }

  void set_handler(unsigned id, ucp_am_recv_callback_t callback) {
    ucp_am_handler_param_t handler{};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    handler.id = id;
    handler.cb = callback;
    handler.arg = this;
    ucs_status_t status = ucp_worker_set_am_recv_handler(worker, &handler);
    if (status != UCS_OK) fail(ErrorCode::kNetwork, "setting an active message handler (ucp_worker_set_am_recv_handler)", status);
  }
};

namespace {

constexpr const char* kSegmentVariable = "UCX_TCP_RX_SEG_SIZE";
constexpr uint64_t kDefaultSegmentBytes = 1ull << 20;

/// UCX's memory units: a number, then optionally k, m or g (any case) and a b, all powers
/// of two ("1mb" is 1 MiB: parse_size reads it as 10^6, so it does not serve here).
std::optional<uint64_t> parse_memory_units(std::string_view text) {
  uint64_t value = 0;
  size_t at = 0;
  for (; at < text.size() && text[at] >= '0' && text[at] <= '9'; ++at) {
    if (value > (UINT64_MAX - 9) / 10) return std::nullopt;
    value = value * 10 + static_cast<uint64_t>(text[at] - '0');
  }
  if (at == 0) return std::nullopt;
  std::string_view suffix = text.substr(at);
  unsigned shift = 0;
  if (!suffix.empty() && std::string_view("kKmMgG").find(suffix[0]) != std::string_view::npos) {
    shift = suffix[0] == 'k' || suffix[0] == 'K' ? 10 : suffix[0] == 'm' || suffix[0] == 'M' ? 20 : 30;
    suffix.remove_prefix(1);
  }
  if (suffix == "b" || suffix == "B") suffix.remove_prefix(1);
  if (!suffix.empty() || value > (UINT64_MAX >> shift)) return std::nullopt;
  return value << shift;
}

}  // namespace

uint64_t receive_segment_bytes() {
  const Environment environment = process_environment();
  auto found = environment.find(kSegmentVariable);
  if (found == environment.end()) return kDefaultSegmentBytes;
  std::optional<uint64_t> bytes = parse_memory_units(found->second);
  WS_EXPECT(bytes.has_value(), ErrorCode::kConfig,
            std::string(kSegmentVariable) + "=" + found->second + " is not a size UCX reads (a number, then k, m or g)");
  return *bytes;
}

void check_receive_segments(uint64_t theirs, const std::string& peer) {
  const uint64_t ours = receive_segment_bytes();
  WS_EXPECT(theirs == ours, ErrorCode::kConfig,
            peer + " receives UCX tcp segments of " + std::to_string(theirs) + " bytes and this process " +
                std::to_string(ours) + ": UCX aborts a process sent fragments larger than its segments, so both ends need "
                "the same " + kSegmentVariable + " (weightstream's default is 1m)");
}

Worker::Worker() : state_(std::make_unique<State>()) {
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) fail(ErrorCode::kConfig, "reading the UCX_* configuration (ucp_config_read)", status);
  // UCX's tcp carries a rendezvous active message in fragments of its receive segment
  // (64 KiB by default): larger fragments cost fewer messages per byte (bench/RESULTS.md
  // measures it). The size handshakes compare, set here.
  (void)ucp_config_modify(config, "RX_SEG_SIZE", std::to_string(receive_segment_bytes()).c_str());
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_TAG | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
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

void Worker::wake() {
  state_->woken.store(true, std::memory_order_release);
  ucp_worker_signal(state_->worker);
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
  {
    std::lock_guard lock(state_->table.mutex);
    state_->table.regions.push_back({registration->address_, bytes, handle, memory});
  }
  registration->table_ = &state_->table;
  return registration;
}

uint64_t Worker::bytes_sent_on_request() const noexcept {
  return state_->bytes_sent_on_request.load(std::memory_order_relaxed);
}

uint64_t Worker::sends_in_flight() const noexcept { return state_->sends_in_flight.load(std::memory_order_relaxed); }

uint64_t Worker::sends_ended_at_stop() const noexcept {
  return state_->sends_ended_at_stop.load(std::memory_order_relaxed);
}

bool Worker::moves_cuda_memory() const {
  ucp_context_attr_t attributes{};
  attributes.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(state_->context, &attributes) != UCS_OK) return false;
  return (attributes.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

void Worker::answer_send_requests(const Secret& secret) {
  WS_EXPECT(!state_->progress.joinable(), ErrorCode::kInternal, "UCX: answer_send_requests after start_progress");
  state_->request_secret = secret;
  state_->set_handler(kSendRequestId, &State::on_send_request);
}

void Worker::accept_messages(const Secret& secret, Place place, Landed landed) {
  WS_EXPECT(!state_->progress.joinable(), ErrorCode::kInternal, "UCX: accept_messages after start_progress");
  state_->message_secret = secret;
  state_->place = std::move(place);
  state_->landed = std::move(landed);
  state_->set_handler(kMessageId, &State::on_message);
}

void Worker::start_progress() {
  if (state_->progress.joinable()) return;
  State* state = state_.get();
  state->progress = std::thread([state] {
    while (!state->stop.load(std::memory_order_relaxed)) {
      while (ucp_worker_progress(state->worker) != 0) {
      }
      if (state->retry_kept()) continue;
      // Sleeps until traffic arrives; ucp_worker_signal (wake(), the destructor) wakes it.
      wait_for_events(state->worker, state->efd, 200);
    }
    state->drop_kept();
    // Sends answering requests read registered memory until they end, and a rendezvous
    // this worker received (or is receiving) may still owe its sender an acknowledgement
    // (UCX 1.13 asserts at ucp_worker_destroy on an endpoint with such a request): flush the
    // worker, and let those end (a dead peer's fail at once), before the caller deregisters
    // the memory.
    const auto until = Clock::now() + std::chrono::seconds(2);
    ucp_request_param_t param{};
    ucs_status_ptr_t flush = ucp_worker_flush_nbx(state->worker, &param);
    auto pending = [&] {
      if (UCS_PTR_IS_PTR(flush) && ucp_request_check_status(flush) == UCS_INPROGRESS) return true;
      return state->sends_in_flight.load(std::memory_order_relaxed) > 0 || state->receives_in_flight > 0;
    };
    while (pending() && Clock::now() < until) {
      while (ucp_worker_progress(state->worker) != 0) {
      }
      wait_for_events(state->worker, state->efd, 10);
    }
    if (UCS_PTR_IS_PTR(flush)) {
      if (ucp_request_check_status(flush) == UCS_INPROGRESS) ucp_request_cancel(state->worker, flush);
      ucp_request_free(flush);
    }
    state->end_sends_by_force();
  });
}

std::unique_ptr<Endpoint> Worker::connect(std::span<const std::byte> address, const std::string& peer, UcxPath path,
                                          const Secret& secret) {
  auto state = std::make_unique<Endpoint::State>();
  state->worker = state_->worker;
  state->efd = state_->efd;
  state->secret = secret;
  state->next_tag = &state_->next_tag;
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Endpoint::State::on_error;
  params.err_handler.arg = state.get();
  ucs_status_t status = ucp_ep_create(state_->worker, &params, &state->ep);
  if (status != UCS_OK) fail(ErrorCode::kNetwork, "connecting to " + peer + " (ucp_ep_create)", status);
  const Lanes lanes = describe_lanes(state->ep);
  state->transports = lanes.transports;
  switch (path) {
    case UcxPath::kRma:
      state->path = Path::kRma;
      break;
    case UcxPath::kRendezvous:
      state->path = Path::kRendezvous;
      break;
    case UcxPath::kAuto:
      state->path = lanes.rdma_rma ? Path::kRma : Path::kRendezvous;
      break;
  }
  return std::unique_ptr<Endpoint>(new Endpoint(std::move(state), peer));
}

}  // namespace weightstream::transfer::ucx
