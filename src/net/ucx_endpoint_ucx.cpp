// The endpoints of the UCX shim (ucx.hpp): reads, writes and messages to one peer.
#include <stdio.h>

#include <algorithm>
#include <cstring>
#include <string_view>

#include "net/ucx_detail.hpp"

namespace weightstream::transfer::ucx {

using namespace detail;

namespace detail {

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

}  // namespace detail

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

}  // namespace weightstream::transfer::ucx
