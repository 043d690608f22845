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

#include "transfer/ucx.hpp"
#include "weightstream/error.hpp"

namespace weightstream::transfer::ucx {
namespace {

using Clock = std::chrono::steady_clock;

/// Reads in flight on one endpoint before get() waits for the oldest: enough to keep a
/// link busy, few enough that cancelling them at a failure is quick.
constexpr size_t kMaxReadsInFlight = 64;

/// Active message ids: a puller's request that the peer send a range (answer_send_requests),
/// and a message whose payload the peer places (accept_messages).
constexpr unsigned kSendRequestId = 1;
constexpr unsigned kMessageId = 2;

/// Largest header of send_message (after the secret).
constexpr size_t kMaxMessageHeader = 64;

/// A send request's header: the secret, then the range and the tag to answer with.
struct SendRequest {
  Secret secret;
  uint64_t address = 0;
  uint64_t bytes = 0;
  uint64_t tag = 0;
};

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

/// What UCX selected for an endpoint, from its own description (ucp_ep_print_info). Each
/// lane line reads like `lane[0]:  1:tcp/eth0.0 md[0] -> md[0]/tcp/sysdev[255] am am_bw#0
/// keepalive wireup`: the transport and device, then what the lane is used for. A lane used
/// for "rma" or "rma_bw" moves gets and puts. ucp_ep_query names the transports only from
/// UCX 1.14, and not their uses.
struct Lanes {
  /// A lane moves gets and puts over an RDMA NIC (InfiniBand or RoCE: rc, dc), where a get
  /// is a one-sided read the serving peer's CPU takes no part in. Other rma lanes measured
  /// slower than UCX's tagged rendezvous over the same endpoint: tcp emulates gets with
  /// active messages (0.82 against 2.03 GB/s between two network namespaces), and a get
  /// between two processes on one GPU with cuda_ipc and tcp lanes ran at 0.86 GB/s against
  /// tag_bw's 1,070 GB/s (ucx_perftest -m cuda,cuda, UCX 1.22, H100; bench/HISTORY.md).
  bool rdma_rma = false;
  std::string transports;
};

Lanes describe_lanes(ucp_ep_h ep) {
  Lanes lanes;
  char* text = nullptr;
  size_t length = 0;
  FILE* stream = ::open_memstream(&text, &length);
  if (stream == nullptr) return lanes;
  ucp_ep_print_info(ep, stream);
  ::fclose(stream);
  std::string_view all(text, length);
  std::vector<std::string> seen;
  while (!all.empty()) {
    const size_t end = std::min(all.find('\n'), all.size());
    std::string_view line = all.substr(0, end);
    all.remove_prefix(std::min(end + 1, all.size()));
    const size_t lane = line.find("lane[");
    if (lane == std::string_view::npos) continue;
    line.remove_prefix(lane);
    const size_t colon = line.find("]:");
    if (colon == std::string_view::npos) continue;
    std::string_view rest = line.substr(colon + 2);
    rest.remove_prefix(std::min(rest.find_first_not_of(' '), rest.size()));
    std::string_view resource = rest.substr(0, rest.find(' '));      // "1:tcp/eth0.0"
    resource.remove_prefix(std::min(resource.find(':') + 1, resource.size()));
    const std::string name(resource.substr(0, resource.rfind('.') == std::string_view::npos
                                                  ? resource.size()
                                                  : resource.rfind('.')));
    if (!name.empty() && std::find(seen.begin(), seen.end(), name) == seen.end()) seen.push_back(name);
    const size_t arrow = rest.find("->");
    std::string_view uses = arrow == std::string_view::npos ? std::string_view() : rest.substr(arrow);
    for (size_t at = uses.find(" rma"); at != std::string_view::npos; at = uses.find(" rma", at + 1)) {
      const char next = at + 4 < uses.size() ? uses[at + 4] : ' ';
      const bool rdma = name.starts_with("rc") || name.starts_with("dc");  // rc_verbs, rc_mlx5, dc_mlx5
      if (rdma && (next == ' ' || next == '#' || next == '_')) lanes.rdma_rma = true;  // "rma", "rma#0", "rma_bw#0"
    }
  }
  ::free(text);
  for (const std::string& name : seen) lanes.transports += (lanes.transports.empty() ? "" : ",") + name;
  return lanes;
}

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
  // (64 KiB by default): updates moved in 1 MiB fragments cross two network namespaces at
  // about 1.45 times the rate (bench/RESULTS.md). The size handshakes compare, set here.
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

struct Endpoint::State {
  ucp_worker_h worker = nullptr;
  int efd = -1;
  ucp_ep_h ep = nullptr;
  Path path = Path::kRma;
  std::string transports;
  Secret secret{};
  uint64_t* next_tag = nullptr;  // the worker's
  std::vector<ucp_rkey_h> keys;
  /// What a read's completion callback reads: at a stable address while UCX holds the read.
  struct Completion {
    Landed landed;
    uint64_t bytes = 0;
    bool abandoned = false;  // cancelled by its owner, who may be gone

    void ended(ucs_status_t status, uint64_t length) const {
      if (status == UCS_OK && length == bytes && !abandoned && landed) landed();
    }
  };
  struct InFlight {
    void* request = nullptr;
    bool receive = false;  // a tagged receive of `bytes` (a rendezvous read)
    uint64_t bytes = 0;
    uint64_t remote_address = 0;
    std::unique_ptr<std::byte[]> header;     // an active message's header, read by UCX until it ends (UCX 1.13)
    std::unique_ptr<Completion> completion;  // a read's Landed (get())
  };
  std::vector<InFlight> in_flight;
  ucs_status_t failure = UCS_OK;  // set by the error handler (the peer died or reset)
  ucs_status_t first_error = UCS_OK;
  std::string refusal;  // a rendezvous read the peer answered with nothing

  static void on_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* state = static_cast<State*>(arg);
    if (state->failure == UCS_OK) state->failure = status;
  }

  /// Frees the operations that have ended; true when at least one did.
  bool reap() {
    bool ended = false;
    std::erase_if(in_flight, [&](InFlight& operation) {
      ucs_status_t status = UCS_INPROGRESS;
      ucp_tag_recv_info_t info{};
      if (operation.receive) {
        status = ucp_tag_recv_request_test(operation.request, &info);
      } else {
        status = ucp_request_check_status(operation.request);
      }
      if (status == UCS_INPROGRESS) return false;
      if (status != UCS_OK && first_error == UCS_OK) first_error = status;
      if (status == UCS_OK && operation.receive && info.length != operation.bytes && refusal.empty()) {
        refusal = "sent " + std::to_string(info.length) + " of the " + std::to_string(operation.bytes) +
                  " bytes asked for at remote address " + std::to_string(operation.remote_address) +
                  " (a range outside the memory it serves)";
      }
      ucp_request_free(operation.request);
      ended = true;
      return true;
    });
    return ended;
  }

  /// One round of the worker's progress; frees what ended (true when something did) and
  /// throws, after cancelling the rest, when an operation failed or the peer refused a read.
  bool progress_once(const std::string& peer) {
    while (ucp_worker_progress(worker) != 0) {
    }
    const bool ended = reap();
    if (!refusal.empty()) {
      cancel_all();
      WS_FAIL(ErrorCode::kProtocol, "UCX read from " + peer + " failed: it " + refusal);
    }
    if (first_error != UCS_OK || failure != UCS_OK) {
      // An operation that failed (a reset, an unreachable peer) is a failed peer, whose
      // endpoint is closed by force (see ~Endpoint).
      if (failure == UCS_OK) failure = first_error;
      cancel_all();
      ucs_status_t status = first_error != UCS_OK ? first_error : failure;
      WS_FAIL(ErrorCode::kNetwork, "UCX " + std::string(path == Path::kRma ? "read" : "transfer") + " from " + peer +
                                       " failed: " + status_text(status));
    }
    return ended;
  }

  /// Progresses until at most `keep` operations are in flight; one failing, or none ending
  /// for `timeout`, throws (after cancelling the others).
  void drain(size_t keep, std::chrono::milliseconds timeout, const std::string& peer) {
    drain_until([&] { return in_flight.size() <= keep; }, timeout, peer);
  }

  /// Progresses until `done()`, with drain()'s errors.
  template <typename Done>
  void drain_until(Done&& done, std::chrono::milliseconds timeout, const std::string& peer) {
    auto last_progress = Clock::now();
    while (!done() || !refusal.empty()) {
      if (progress_once(peer)) last_progress = Clock::now();
      if (done()) break;
      if (Clock::now() - last_progress > timeout) {
        size_t pending = in_flight.size();
        // A peer that stopped answering (frozen, unplugged: its TCP connection may still
        // look open) is a failed peer: its endpoint is closed by force, which ends the
        // requests it still tracks. A flushed close would wait on them, and the worker's
        // destruction would then find them and abort the process (ucp_ep.c proto_reqs).
        if (failure == UCS_OK) failure = UCS_ERR_TIMED_OUT;
        cancel_all();
        WS_FAIL(ErrorCode::kTimeout, "UCX transfers with " + peer + ": " + std::to_string(pending) +
                                         " still in flight after " + std::to_string(timeout.count()) +
                                         " ms without progress (is the peer alive and reachable?)");
      }
      wait_for_events(worker, efd, 50);
    }
  }

  void cancel_all() {
    for (InFlight& operation : in_flight) {
      if (operation.completion) operation.completion->abandoned = true;  // its owner is giving up on it
      ucp_request_cancel(worker, operation.request);
    }
    auto until = Clock::now() + std::chrono::seconds(2);
    while (!in_flight.empty() && Clock::now() < until) {
      ucp_worker_progress(worker);
      reap();
    }
    // Requests UCX did not end in time stay with it; they are freed, not waited for.
    for (InFlight& operation : in_flight) {
      ucp_request_free(operation.request);
      (void)operation.header.release();  // UCX may still read them: leaked, not freed under it
      (void)operation.completion.release();
    }
    in_flight.clear();
  }

  void check_alive(const std::string& peer) const {
    if (failure != UCS_OK) WS_FAIL(ErrorCode::kNetwork, "UCX endpoint to " + peer + " failed: " + status_text(failure));
  }

  void track(ucs_status_ptr_t request, InFlight operation, std::chrono::milliseconds timeout, const std::string& peer) {
    if (request == nullptr) {  // ended at once: a message, or a read of a UCX that ignored NO_IMM_CMPL
      if (operation.completion) operation.completion->ended(UCS_OK, operation.bytes);
      return;
    }
    operation.request = request;
    in_flight.push_back(std::move(operation));
    if (in_flight.size() >= kMaxReadsInFlight) drain(kMaxReadsInFlight / 2, timeout, peer);
  }
};

Endpoint::Endpoint(std::unique_ptr<State> state, std::string peer) : state_(std::move(state)), peer_(std::move(peer)) {}

Endpoint::~Endpoint() {
  State& state = *state_;
  if (!state.in_flight.empty()) state.cancel_all();
  for (ucp_rkey_h key : state.keys) ucp_rkey_destroy(key);
  // A live peer gets a flushed close: forced, its worker may tear down its end of the
  // connection while it still tracks a request of ours, and UCX 1.13 aborts the process
  // there (ucp_ep_destroy_base's proto_reqs assertion: the serving peer died, and the next
  // puller met "Connection refused"). A failed peer's endpoint is forced: a flush would stall.
  // So is one whose flush does not end in time (a peer that stopped turning its worker: a
  // puller paused, or frozen, while its server shuts down): closed unflushed, its requests
  // would stay with the worker, whose destruction then aborts on the same assertion.
  auto wait_for = [&](ucs_status_ptr_t request) {
    if (!UCS_PTR_IS_PTR(request)) return !UCS_PTR_IS_ERR(request);
    auto until = Clock::now() + std::chrono::seconds(2);
    while (ucp_request_check_status(request) == UCS_INPROGRESS && Clock::now() < until) ucp_worker_progress(state.worker);
    const bool ended = ucp_request_check_status(request) == UCS_OK;
    ucp_request_free(request);
    return ended;
  };
  ucp_request_param_t param{};
  bool flushed = false;
  if (state.failure == UCS_OK) flushed = wait_for(ucp_ep_flush_nbx(state.ep, &param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = flushed ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
  wait_for(ucp_ep_close_nbx(state.ep, &param));
}

Path Endpoint::path() const noexcept { return state_->path; }

const std::string& Endpoint::transports() const noexcept { return state_->transports; }

uint32_t Endpoint::add_remote_key(std::span<const std::byte> packed) {
  ucp_rkey_h key = nullptr;
  ucs_status_t status = ucp_ep_rkey_unpack(state_->ep, packed.data(), &key);
  if (status != UCS_OK) fail(ErrorCode::kProtocol, "unpacking a remote key of " + peer_ + " (ucp_ep_rkey_unpack)", status);
  state_->keys.push_back(key);
  return static_cast<uint32_t>(state_->keys.size() - 1);
}

void Endpoint::get(std::byte* destination, uint64_t remote_address, uint32_t key, uint64_t bytes,
                   std::chrono::milliseconds timeout, Memory destination_memory, Landed landed) {
  State& state = *state_;
  if (bytes == 0) return;
  state.check_alive(peer_);
  // Every read ends in its callback (never at once), which runs Landed where UCX finished it.
  auto completion = std::make_unique<State::Completion>(State::Completion{std::move(landed), bytes});
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.user_data = completion.get();
  if (destination_memory == Memory::kCuda) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  if (state.path == Path::kRma) {
    param.cb.send = [](void*, ucs_status_t status, void* user) {
      const auto* read = static_cast<const State::Completion*>(user);
      read->ended(status, read->bytes);
    };
    WS_EXPECT(key < state.keys.size(), ErrorCode::kInternal, "UCX read with an unknown remote key");
    ucs_status_ptr_t request = ucp_get_nbx(state.ep, destination, bytes, remote_address, state.keys[key], &param);
    if (UCS_PTR_IS_ERR(request)) {
      fail(ErrorCode::kNetwork,
           "reading " + std::to_string(bytes) + " bytes at remote address " + std::to_string(remote_address) + " of " +
               peer_ + " (ucp_get_nbx)",
           UCS_PTR_STATUS(request));
    }
    state.track(request, State::InFlight{nullptr, false, bytes, remote_address, nullptr, std::move(completion)}, timeout,
                peer_);
    return;
  }
  param.cb.recv = [](void*, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user) {
    static_cast<const State::Completion*>(user)->ended(status, info->length);
  };
  // Rendezvous: the receive is posted before the request leaves, so the answer always
  // finds it (never an unexpected message buffered by UCX).
  const uint64_t tag = (*state.next_tag)++;
  ucs_status_ptr_t receive = ucp_tag_recv_nbx(state.worker, destination, bytes, tag, ~uint64_t{0}, &param);
  if (UCS_PTR_IS_ERR(receive)) {
    fail(ErrorCode::kNetwork, "posting a receive of " + std::to_string(bytes) + " bytes from " + peer_ + " (ucp_tag_recv_nbx)",
         UCS_PTR_STATUS(receive));
  }
  state.track(receive, State::InFlight{nullptr, true, bytes, remote_address, nullptr, std::move(completion)}, timeout,
              peer_);
  auto header = std::make_unique<std::byte[]>(sizeof(SendRequest));
  const SendRequest request{state.secret, remote_address, bytes, tag};
  std::memcpy(header.get(), &request, sizeof(request));
  ucp_request_param_t send{};
  send.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  send.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t asking = ucp_am_send_nbx(state.ep, kSendRequestId, header.get(), sizeof(SendRequest), nullptr, 0, &send);
  if (UCS_PTR_IS_ERR(asking)) {
    fail(ErrorCode::kNetwork, "asking " + peer_ + " to send " + std::to_string(bytes) + " bytes (ucp_am_send_nbx)",
         UCS_PTR_STATUS(asking));
  }
  state.track(asking, State::InFlight{nullptr, false, 0, 0, std::move(header)}, timeout, peer_);
}

void Endpoint::put(const std::byte* source, uint64_t remote_address, uint32_t key, uint64_t bytes,
                   std::chrono::milliseconds timeout) {
  State& state = *state_;
  WS_EXPECT(key < state.keys.size(), ErrorCode::kInternal, "UCX write with an unknown remote key");
  if (bytes == 0) return;
  state.check_alive(peer_);
  ucp_request_param_t param{};
  ucs_status_ptr_t request = ucp_put_nbx(state.ep, source, bytes, remote_address, state.keys[key], &param);
  if (UCS_PTR_IS_ERR(request)) {
    fail(ErrorCode::kNetwork, "writing " + std::to_string(bytes) + " bytes to " + peer_ + " (ucp_put_nbx)",
         UCS_PTR_STATUS(request));
  }
  state.track(request, State::InFlight{}, timeout, peer_);
}

void Endpoint::send_message(std::span<const std::byte> header, const std::byte* source, uint64_t bytes,
                            const Registration* source_registration, std::chrono::milliseconds timeout,
                            Memory source_memory) {
  State& state = *state_;
  WS_EXPECT(header.size() <= kMaxMessageHeader, ErrorCode::kInternal, "UCX message header over 64 bytes");
  state.check_alive(peer_);
  const size_t header_bytes = sizeof(Secret) + header.size();
  auto copy = std::make_unique<std::byte[]>(header_bytes);
  std::memcpy(copy.get(), state.secret.data(), sizeof(Secret));
  if (!header.empty()) std::memcpy(copy.get() + sizeof(Secret), header.data(), header.size());
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_RNDV;  // zero-copy: the payload moves once the peer has placed it
  if (source_registration != nullptr) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = static_cast<ucp_mem_h>(source_registration->handle_);
  }
  if (source_memory == Memory::kCuda) {  // GPU to GPU: cuda_ipc on one host, RDMA where UCX has it
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  ucs_status_ptr_t request = ucp_am_send_nbx(state.ep, kMessageId, copy.get(), header_bytes, source, bytes, &param);
  if (UCS_PTR_IS_ERR(request)) {
    fail(ErrorCode::kNetwork, "sending " + std::to_string(bytes) + " bytes to " + peer_ + " (ucp_am_send_nbx)",
         UCS_PTR_STATUS(request));
  }
  state.track(request, State::InFlight{nullptr, false, 0, 0, std::move(copy)}, timeout, peer_);
}

void Endpoint::flush(std::chrono::milliseconds timeout) {
  State& state = *state_;
  state.drain(0, timeout, peer_);
  ucp_request_param_t param{};
  ucs_status_ptr_t request = ucp_ep_flush_nbx(state.ep, &param);
  if (UCS_PTR_IS_ERR(request)) fail(ErrorCode::kNetwork, "flushing the endpoint to " + peer_, UCS_PTR_STATUS(request));
  if (request != nullptr) {
    state.in_flight.push_back(State::InFlight{request, false, 0, 0, nullptr});
    state.drain(0, timeout, peer_);
  }
  state.check_alive(peer_);
}

void Endpoint::cancel() noexcept {
  if (!state_->in_flight.empty()) state_->cancel_all();
}

void Endpoint::wait_until(const uint64_t& counter, uint64_t value, std::chrono::milliseconds timeout) {
  State& state = *state_;
  state.drain_until([&] { return counter >= value; }, timeout, peer_);
  state.check_alive(peer_);
}

void Endpoint::progress() {
  State& state = *state_;
  if (!state.in_flight.empty()) state.progress_once(peer_);  // throws, as wait() does, on a failure
}

bool Endpoint::busy() const noexcept { return !state_->in_flight.empty(); }

void Endpoint::wait(std::chrono::milliseconds timeout) {
  State& state = *state_;
  state.drain(0, timeout, peer_);
  state.check_alive(peer_);
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
