// Builds without liburing: io_uring reads are refused with a clear error.
#include "storage/local_io.hpp"
#include "weightstream/error.hpp"

namespace weightstream::local_io {

bool uring_available() noexcept { return false; }

void uring_read(int, const std::string& uri, uint64_t, std::span<std::byte>) {
  WS_FAIL(ErrorCode::kUnsupported, "cannot read " + uri + " with io_uring: this build has no liburing support (use --io pread)");
}

}  // namespace weightstream::local_io
