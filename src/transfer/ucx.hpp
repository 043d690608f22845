#pragma once
// The one place that talks to UCX (the ucp API): a context with one worker, memory
// registered for one-sided access (ucp_mem_map, packed remote keys), endpoints made from a
// peer's worker address, and one-sided gets. ucx_ucx.cpp implements it where UCX was
// found; ucx_ucx_fallback.cpp throws Error(kUnsupported) from every constructor, so the
// rest of the library builds and runs without UCX.
//
// Threading: a worker is used by one thread at a time. The serving side (memory others
// read) registers everything first, then calls start_progress(): a thread of its own then
// drives the worker, sleeping in ucp_worker_wait while nothing happens (UCX's tcp
// transport emulates one-sided reads with messages the target must progress). The pulling
// side issues gets and waits for them on its own thread.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace weightstream::transfer::ucx {

/// True when this build has UCX.
bool compiled() noexcept;

/// "1.13.1": the UCX library's version (empty without UCX).
std::string library_version();

class Worker;

/// Where memory handed to UCX lives. GPU memory moves only through a CUDA-aware UCX
/// (Worker::moves_cuda_memory(): cuda_ipc between processes of a host, cuda_copy, RDMA with
/// GPUDirect); the memory type is named to UCX rather than left to its detection.
enum class Memory { kHost, kCuda };

/// Memory registered with a worker's context for remote reads; deregistered on destruction.
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
  Registration() = default;
  void* context_ = nullptr;
  void* handle_ = nullptr;
  uint64_t address_ = 0;
  uint64_t bytes_ = 0;
  std::vector<std::byte> remote_key_;
};

/// An endpoint to one peer, with the remote keys unpacked for it. Gets are queued and run
/// concurrently; wait() returns when all have landed.
class Endpoint {
 public:
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  /// Unpacks a peer's remote key; returns its number for get().
  uint32_t add_remote_key(std::span<const std::byte> packed);
  /// Queues a read of `bytes` at the peer's `remote_address` (inside the memory of key
  /// `key`) into `destination`. Waits first when too many reads are in flight.
  void get(std::byte* destination, uint64_t remote_address, uint32_t key, uint64_t bytes,
           std::chrono::milliseconds timeout, Memory destination_memory = Memory::kHost);
  /// Queues a write of `bytes` from `source` (which stays unchanged until wait() or
  /// flush() returns) to the peer's `remote_address`.
  void put(const std::byte* source, uint64_t remote_address, uint32_t key, uint64_t bytes,
           std::chrono::milliseconds timeout);
  /// Waits until every queued write has landed in the peer's memory (remote completion),
  /// with wait()'s errors.
  void flush(std::chrono::milliseconds timeout);
  /// Waits until every queued read has landed. Throws Error(kNetwork) naming the peer and
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
  /// requests instead of hanging them). `peer` names it in messages.
  std::unique_ptr<Endpoint> connect(std::span<const std::byte> address, const std::string& peer);
  /// Starts the thread that progresses the worker (serving side); stopped by
  /// stop_progress() or the destructor.
  void start_progress();
  /// Stops that thread (before the memory it serves is deregistered).
  void stop_progress();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace weightstream::transfer::ucx
