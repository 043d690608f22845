// CUDA IPC in a build without CUDA: every use is an Error(kUnsupported).
#include "update/transport.hpp"

namespace weightstream::transfer {

std::unique_ptr<ReceiverTransport> make_cuda_ipc_receiver(uint64_t, const Device&) {
  WS_FAIL(ErrorCode::kUnsupported, "the cuda-ipc transport needs a build with CUDA; this one has none");
}

std::unique_ptr<SenderTransport> make_cuda_ipc_sender(const SenderOptions&, std::span<const std::byte>) {
  WS_FAIL(ErrorCode::kUnsupported, "the cuda-ipc transport needs a build with CUDA; this one has none");
}

}  // namespace weightstream::transfer
