// UCX in a build without it (WS_HAVE_UCX off): making a worker is Error(kUnsupported).
#include "net/ucx.hpp"
#include "weightstream/error.hpp"

namespace weightstream::transfer::ucx {

bool compiled() noexcept { return false; }
std::string library_version() { return {}; }
uint64_t receive_segment_bytes() { return 0; }
void check_receive_segments(uint64_t, const std::string&) {}
std::string_view path_name(Path path) noexcept { return path == Path::kRma ? "rma" : "rendezvous"; }
Secret random_secret() { return {}; }

Registration::~Registration() = default;

struct Endpoint::State {
  std::string transports;
};
Endpoint::Endpoint(std::unique_ptr<State> state, std::string peer) : state_(std::move(state)), peer_(std::move(peer)) {}
Endpoint::~Endpoint() = default;
Path Endpoint::path() const noexcept { return Path::kRma; }
const std::string& Endpoint::transports() const noexcept { return state_->transports; }
uint32_t Endpoint::add_remote_key(std::span<const std::byte>) { return 0; }
void Endpoint::get(std::byte*, uint64_t, uint32_t, uint64_t, std::chrono::milliseconds, Memory, Landed) {}
void Endpoint::cancel() noexcept {}
void Endpoint::wait_until(const uint64_t&, uint64_t, std::chrono::milliseconds) {}
void Endpoint::progress() {}
bool Endpoint::busy() const noexcept { return false; }
void Endpoint::wait(std::chrono::milliseconds) {}
void Endpoint::put(const std::byte*, uint64_t, uint32_t, uint64_t, std::chrono::milliseconds) {}
void Endpoint::send_message(std::span<const std::byte>, const std::byte*, uint64_t, const Registration*,
                            std::chrono::milliseconds, Memory) {}
void Endpoint::flush(std::chrono::milliseconds) {}

struct Worker::State {};
Worker::Worker() {
  WS_FAIL(ErrorCode::kUnsupported,
          "peers and the ucx transport need a build with UCX (Debian's libucx-dev, or the libucx-cu12 wheel; see "
          "WS_WITH_UCX); this one has none");
}
Worker::~Worker() = default;
std::vector<std::byte> Worker::address() const { return {}; }
std::unique_ptr<Registration> Worker::register_memory(const std::byte*, uint64_t, Memory) { return nullptr; }
bool Worker::moves_cuda_memory() const { return false; }
uint64_t Worker::bytes_sent_on_request() const noexcept { return 0; }
uint64_t Worker::sends_in_flight() const noexcept { return 0; }
uint64_t Worker::sends_ended_at_stop() const noexcept { return 0; }
std::unique_ptr<Endpoint> Worker::connect(std::span<const std::byte>, const std::string&, UcxPath, const Secret&) {
  return nullptr;
}
void Worker::answer_send_requests(const Secret&) {}
void Worker::accept_messages(const Secret&, Place, Landed) {}
void Worker::wake() {}
void Worker::start_progress() {}
void Worker::stop_progress() {}

}  // namespace weightstream::transfer::ucx
