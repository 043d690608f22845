// NCCL in a build without it (WS_HAVE_NCCL off): every use is an Error(kUnsupported).
#include "update/transport.hpp"

namespace weightstream::transfer {
namespace {
[[noreturn]] void unsupported() {
  WS_FAIL(ErrorCode::kUnsupported,
          "the nccl transport needs a build with NCCL (found with the CUDA toolkit; see WS_WITH_NCCL); this one has none");
}
}  // namespace

bool nccl_compiled() noexcept { return false; }
std::vector<std::byte> nccl_unique_id() { unsupported(); }
std::unique_ptr<ReceiverTransport> make_nccl_receiver(uint64_t, const Device&, std::span<const std::byte>, int, int) {
  unsupported();
}
std::unique_ptr<SenderTransport> make_nccl_sender(uint64_t, const Device&, std::span<const std::byte>, int) { unsupported(); }

}  // namespace weightstream::transfer
