#pragma once
// Internals of the UCX shim (ucx.hpp) that its two sources share: ucx_ucx.cpp (the worker,
// registrations, the progress thread) and ucx_endpoint_ucx.cpp (endpoints: reads, writes,
// messages). Built only with UCX, as they are.
#include <poll.h>
#include <ucp/api/ucp.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <string>
#include <vector>

#include "net/ucx.hpp"
#include "weightstream/error.hpp"

namespace weightstream::transfer::ucx {
namespace detail {

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

inline std::string status_text(ucs_status_t status) { return ucs_status_string(status); }

[[noreturn]] inline void fail(ErrorCode code, const std::string& operation, ucs_status_t status) {
  WS_FAIL(code, "UCX: " + operation + " failed: " + status_text(status));
}

/// Waits up to `milliseconds` for the worker's event descriptor, after arming it; returns
/// at once when events are already pending (ucp_worker_arm says UCS_ERR_BUSY).
inline void wait_for_events(ucp_worker_h worker, int efd, int milliseconds) {
  if (ucp_worker_arm(worker) != UCS_OK) return;
  pollfd descriptor{efd, POLLIN, 0};
  (void)::poll(&descriptor, 1, milliseconds);
}

/// What UCX selected for an endpoint, from its own description (ucp_ep_print_info). Each
/// lane line reads like `lane[0]:  1:tcp/eth0.0 md[0] -> md[0]/tcp/sysdev[255] am am_bw#0
/// keepalive wireup`: the transport and device, then what the lane is used for. A lane used
/// for "rma" or "rma_bw" moves gets and puts. ucp_ep_query names the transports only from
/// UCX 1.14, and not their uses.
struct Lanes {
  /// A lane moves gets and puts over an RDMA NIC (InfiniBand or RoCE: rc, dc), where a get
  /// is a one-sided read the serving peer's CPU takes no part in. Other rma lanes are slower
  /// than UCX's tagged rendezvous over the same endpoint: tcp emulates gets with active
  /// messages, and a get between two processes on one GPU goes over its cuda_ipc and tcp
  /// lanes, not the GPU's own copy path (bench/HISTORY.md has the measurements).
  bool rdma_rma = false;
  std::string transports;
};

/// The lanes of `ep`, read from ucp_ep_print_info.
Lanes describe_lanes(ucp_ep_h ep);

}  // namespace detail

/// An endpoint's state: what its reads' callbacks and its error handler reach.
struct Endpoint::State {
  using Clock = detail::Clock;
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
                                       " failed: " + detail::status_text(status));
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
      detail::wait_for_events(worker, efd, 50);
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
    if (failure != UCS_OK) WS_FAIL(ErrorCode::kNetwork, "UCX endpoint to " + peer + " failed: " + detail::status_text(failure));
  }

  void track(ucs_status_ptr_t request, InFlight operation, std::chrono::milliseconds timeout, const std::string& peer) {
    if (request == nullptr) {  // ended at once: a message, or a read of a UCX that ignored NO_IMM_CMPL
      if (operation.completion) operation.completion->ended(UCS_OK, operation.bytes);
      return;
    }
    operation.request = request;
    in_flight.push_back(std::move(operation));
    if (in_flight.size() >= detail::kMaxReadsInFlight) drain(detail::kMaxReadsInFlight / 2, timeout, peer);
  }
};

}  // namespace weightstream::transfer::ucx
