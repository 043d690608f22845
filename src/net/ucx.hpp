#pragma once
// The one place that talks to UCX (the ucp API): a context with one worker, memory
// registered for remote access (ucp_mem_map, packed remote keys), endpoints made from a
// peer's worker address, and the two ways bulk bytes move (Path):
//
// - kRma: one-sided ucp_get_nbx / ucp_put_nbx into or out of the peer's registered memory.
// - kRendezvous: messages. A read is a tagged receive posted into the destination plus a
//   small active message asking the peer to send the range; the peer's worker answers it
//   on its own (answer_send_requests) with ucp_tag_send_nbx straight from its registered
//   memory. A write is an active message whose payload the peer's worker receives straight
//   into the place its handler names (accept_messages). Both move by UCX's rendezvous
//   protocol, zero-copy on both ends.
//
// connect() picks kRma where a lane of the endpoint moves gets and puts over an RDMA NIC
// (rc, dc) and kRendezvous everywhere else, unless the caller forces one
// (WEIGHTSTREAM_UCX_PATH): UCX's tcp emulates gets with active messages, and gets of GPU
// memory between two processes of one GPU avoid the GPU's own copy path, so both are slower
// than its tagged rendezvous (ucx_perftest ucp_get against tag_bw: bench/HISTORY.md).
//
// ucx_ucx.cpp implements it where UCX was found; ucx_ucx_fallback.cpp throws
// Error(kUnsupported) from every constructor, so the rest of the library builds and runs
// without UCX.
//
// Threading: a worker is used by one thread at a time. The serving side (memory others
// read or write) registers everything and installs its handlers first, then calls
// start_progress(): a thread of its own then drives the worker, sleeping on its event
// descriptor while nothing happens; the handlers run on that thread. The pulling (or
// sending) side issues its operations and waits for them on its own thread.
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "weightstream/device.hpp"
#include "weightstream/options.hpp"

namespace weightstream::transfer::ucx {

/// True when this build has UCX.
bool compiled() noexcept;

/// "1.13.1": the UCX library's version (empty without UCX).
std::string library_version();

class Worker;

/// The size of UCX's tcp receive segments in this process: UCX_TCP_RX_SEG_SIZE where the
/// environment sets it, else 1 MiB (every Worker asks for it). UCX's tcp carries a rendezvous
/// message in fragments of the sender's segment, and UCX 1.13 aborts the process whose
/// segments are smaller than a fragment it receives: the two ends of a link must agree, so
/// handshakes carry it and check_receive_segments() refuses a peer that differs.
uint64_t receive_segment_bytes();
/// Throws Error(kConfig) naming `peer` when `theirs` (its receive_segment_bytes()) differs
/// from this process's.
void check_receive_segments(uint64_t theirs, const std::string& peer);

/// Where memory handed to UCX lives. GPU memory moves only through a CUDA-aware UCX
/// (Worker::moves_cuda_memory(): cuda_ipc between processes of a host, cuda_copy, RDMA with
/// GPUDirect); the memory type is named to UCX rather than left to its detection.
enum class Memory { kHost, kCuda };

/// How an endpoint moves bulk bytes (see the top of this file).
enum class Path { kRma, kRendezvous };

/// "rma" or "rendezvous".
std::string_view path_name(Path path) noexcept;

/// A secret a peer must present with every message it sends to this worker's handlers
/// (a send request, a bucket write): the rendezvous path's equivalent of a remote key,
/// handed over only on the token-checked control connection.
using Secret = std::array<std::byte, 16>;

/// A fresh random secret.
Secret random_secret();

/// Memory registered with a worker's context for remote access; deregistered on destruction.
class Registration {
 public:
  ~Registration();
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;
  /// The packed remote key a peer unpacks to read this memory.
  const std::vector<std::byte>& remote_key() const noexcept { return remote_key_; }
  uint64_t address() const noexcept { return address_; }
  uint64_t bytes() const noexcept { return bytes_; }

 private:
  friend class Worker;
  friend class Endpoint;
  Registration() = default;
  void* context_ = nullptr;
  void* handle_ = nullptr;
  void* table_ = nullptr;  // the worker's list of registrations, which answers send requests
  uint64_t address_ = 0;
  uint64_t bytes_ = 0;
  std::vector<std::byte> remote_key_;
};

/// An endpoint to one peer, with the remote keys unpacked for it. Reads and writes are
/// queued and run concurrently; wait() returns when all have landed.
class Endpoint {
 public:
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  /// Unpacks a peer's remote key; returns its number for get().
  uint32_t add_remote_key(std::span<const std::byte> packed);
  /// How this endpoint moves bulk bytes.
  Path path() const noexcept;
  /// The transports of its lanes as UCX selected them ("tcp/eth0"), for reports.
  const std::string& transports() const noexcept;
  /// Runs once a read has landed whole, inside the worker's progress (a later get(),
  /// wait(), wait_until() or progress()), right after UCX wrote its last bytes: while they
  /// are still in this core's cache. Never for a read that failed or was cancelled. It must
  /// not throw.
  using Landed = std::function<void()>;
  /// Queues a read of `bytes` at the peer's `remote_address` (inside the memory of key
  /// `key`) into `destination`: a ucp_get_nbx on kRma, a tagged receive plus a send request
  /// on kRendezvous (the peer answers from registered memory only; a range outside it fails
  /// the read at wait()). Waits first when too many reads are in flight.
  void get(std::byte* destination, uint64_t remote_address, uint32_t key, uint64_t bytes,
           std::chrono::milliseconds timeout, Memory destination_memory = Memory::kHost, Landed landed = {});
  /// Cancels every queued operation, without waiting for the peer; no Landed given to get()
  /// runs again. For a caller that gives up (an error of its own) before the destinations
  /// and what its Landed callbacks touch go away.
  void cancel() noexcept;
  /// Waits until `counter` (which get()'s Landed callbacks advance) reaches `value`, with
  /// wait()'s errors; reads issued after it stay in flight.
  void wait_until(const uint64_t& counter, uint64_t value, std::chrono::milliseconds timeout);
  /// Queues a one-sided write (kRma) of `bytes` from `source` (which stays unchanged until
  /// wait() or flush() returns) to the peer's `remote_address`.
  void put(const std::byte* source, uint64_t remote_address, uint32_t key, uint64_t bytes,
           std::chrono::milliseconds timeout);
  /// Queues a message (kRendezvous) of `bytes` from `source` (unchanged until wait()
  /// returns; registered as `source_registration` when not null; in GPU memory where
  /// `source_memory` says so, which a worker that moves_cuda_memory() reads where it lies)
  /// with `header` (at most 64 bytes, copied) to the peer's accept_messages() handler, which
  /// places the payload. Its completion means the peer holds the bytes; a peer that refuses
  /// the header fails it at wait().
  void send_message(std::span<const std::byte> header, const std::byte* source, uint64_t bytes,
                    const Registration* source_registration, std::chrono::milliseconds timeout,
                    Memory source_memory = Memory::kHost);
  /// Waits until every queued write has landed in the peer's memory (remote completion),
  /// with wait()'s errors.
  void flush(std::chrono::milliseconds timeout);
  /// Moves what is queued along without waiting (the worker's progress, the ended operations
  /// freed), with wait()'s errors for an operation that failed: a sender calls it between
  /// the pieces of other work, so the transfer runs meanwhile (UCX has no thread of its own).
  void progress();
  /// True while operations are queued that have not ended.
  bool busy() const noexcept;
  /// Waits until every queued read (or message) has landed. Throws Error(kNetwork) naming the peer and
  /// UCX's status when a read failed (the peer died or reset), Error(kTimeout) when they
  /// have not landed within `timeout` of no progress; outstanding reads are cancelled.
  void wait(std::chrono::milliseconds timeout);
  /// Who it is, for messages.
  const std::string& peer() const noexcept { return peer_; }

 private:
  friend class Worker;
  struct State;
  explicit Endpoint(std::unique_ptr<State> state, std::string peer);
  std::unique_ptr<State> state_;
  std::string peer_;
};

/// A UCX context with one worker.
class Worker {
 public:
  /// Throws Error(kUnsupported) in a build without UCX, Error(kNetwork) when UCX cannot
  /// start (no usable transport).
  Worker();
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// The worker's address, which a peer passes to connect().
  std::vector<std::byte> address() const;
  /// Registers `bytes` at `data` for remote reads and writes.
  std::unique_ptr<Registration> register_memory(const std::byte* data, uint64_t bytes, Memory memory = Memory::kHost);
  /// True when this UCX moves CUDA memory (its context lists the CUDA memory type).
  bool moves_cuda_memory() const;
  /// An endpoint to the worker at `address` (error handling: the peer's death fails its
  /// requests instead of hanging them). `peer` names it in messages. `path` kAuto picks
  /// kRma where a lane of the endpoint moves gets and puts over an RDMA NIC (rc, dc; UCX's
  /// own description of the endpoint, ucp_ep_print_info), kRendezvous otherwise. `secret` is what the
  /// peer's handlers expect (its answer_send_requests or accept_messages secret).
  std::unique_ptr<Endpoint> connect(std::span<const std::byte> address, const std::string& peer,
                                    UcxPath path = UcxPath::kAuto, const Secret& secret = {});
  /// Serving side, before start_progress(): answers the send requests of pullers that
  /// present `secret` (Endpoint::get on kRendezvous) from memory registered with this worker,
  /// with a tagged send on the progress thread; a range outside every registration is
  /// answered with an empty message, which fails that read.
  void answer_send_requests(const Secret& secret);
  /// Bytes of the ranges sent so far on those requests (each counted once its send was
  /// started): what a rendezvous puller read. One-sided gets (kRma) never pass through here.
  uint64_t bytes_sent_on_request() const noexcept;
  /// Sends answering requests that have not ended (a puller takes each as it receives it).
  uint64_t sends_in_flight() const noexcept;
  /// Sends answering requests that had not ended when stop_progress() stopped the worker (a
  /// puller that took none of them for 2 s: paused, frozen): ended then by closing their
  /// endpoints by force, so that the worker goes without UCX aborting the process.
  uint64_t sends_ended_at_stop() const noexcept;
  /// Where a message's payload lands: `destination` (host memory); or, with `later`, not
  /// known yet: the worker keeps the message and asks again after each wake(); or neither:
  /// refused (the sender's message fails).
  struct Landing {
    std::byte* destination = nullptr;
    bool later = false;
    /// Where `destination` lies: a GPU's memory takes rendezvous payloads straight from
    /// UCX (a CUDA-aware build: moves_cuda_memory()) and eager ones by a copy to the device.
    Device device{};
  };
  /// Receiving side of Endpoint::send_message, before start_progress(): for each message
  /// that presents `secret`, `place(header, bytes)` (on the progress thread) says where its
  /// payload lands, and `landed(header, bytes, ok)` runs once it has landed (or failed).
  using Place = std::function<Landing(std::span<const std::byte> header, uint64_t bytes)>;
  using Landed = std::function<void(std::span<const std::byte> header, uint64_t bytes, bool ok)>;
  void accept_messages(const Secret& secret, Place place, Landed landed);
  /// From any thread: the progress thread asks `place` again for the messages it keeps for
  /// later (what place() answers has changed).
  void wake();
  /// Starts the thread that progresses the worker (serving side); stopped by
  /// stop_progress() or the destructor.
  void start_progress();
  /// Stops that thread (before the memory it serves is deregistered), after the sends it
  /// started have ended (at most 2 s; those still in flight then are ended by closing their
  /// endpoints by force: sends_ended_at_stop()).
  void stop_progress();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace weightstream::transfer::ucx
