// io_uring reads for the local-file backend (built only where liburing is found).
#include <liburing.h>

#include <cerrno>
#include <vector>

#include "storage/local_io.hpp"
#include "weightstream/error.hpp"
#include "base/errno_text.hpp"

namespace weightstream::local_io {
namespace {

constexpr unsigned kRingDepth = 32;
constexpr uint64_t kSubmissionBytes = 2 * 1024 * 1024;

/// One ring per reader thread: io_uring rings are not meant to be shared without locks.
class ThreadRing {
 public:
  ThreadRing() {
    int rc = io_uring_queue_init(kRingDepth, &ring_, 0);
    WS_EXPECT(rc == 0, ErrorCode::kIo, "cannot create an io_uring: " + detail::errno_text(-rc) + " (use --io pread)");
  }
  ~ThreadRing() { io_uring_queue_exit(&ring_); }
  ThreadRing(const ThreadRing&) = delete;
  ThreadRing& operator=(const ThreadRing&) = delete;
  io_uring* get() { return &ring_; }

 private:
  io_uring ring_{};
};

struct Submission {
  uint64_t offset;
  std::byte* target;
  uint64_t length;
};

}  // namespace

bool uring_available() noexcept { return true; }

void uring_read(int fd, const std::string& uri, uint64_t offset, std::span<std::byte> destination) {
  thread_local ThreadRing ring;
  std::vector<Submission> pending;
  for (uint64_t done = 0; done < destination.size(); done += kSubmissionBytes) {
    uint64_t length = std::min<uint64_t>(kSubmissionBytes, destination.size() - done);
    pending.push_back({offset + done, destination.data() + done, length});
  }
  size_t next = 0;
  unsigned in_flight = 0;
  std::vector<Submission> retries;
  while (next < pending.size() || in_flight > 0) {
    while (next < pending.size() && in_flight < kRingDepth) {
      io_uring_sqe* sqe = io_uring_get_sqe(ring.get());
      if (!sqe) break;
      auto& submission = pending[next];
      io_uring_prep_read(sqe, fd, submission.target, static_cast<unsigned>(submission.length), submission.offset);
      io_uring_sqe_set_data64(sqe, next);
      ++next;
      ++in_flight;
    }
    int rc = io_uring_submit(ring.get());
    WS_EXPECT(rc >= 0, ErrorCode::kIo, "cannot read " + uri + ": io_uring_submit: " + detail::errno_text(-rc));
    io_uring_cqe* cqe = nullptr;
    rc = io_uring_wait_cqe(ring.get(), &cqe);
    if (rc == -EINTR) continue;
    WS_EXPECT(rc == 0, ErrorCode::kIo, "cannot read " + uri + ": io_uring_wait_cqe: " + detail::errno_text(-rc));
    auto index = io_uring_cqe_get_data64(cqe);
    int result = cqe->res;
    io_uring_cqe_seen(ring.get(), cqe);
    --in_flight;
    auto& submission = pending[index];
    WS_EXPECT(result >= 0 || result == -EINTR || result == -EAGAIN, ErrorCode::kIo,
              "cannot read " + std::to_string(submission.offset) + "+" + std::to_string(submission.length) + " bytes of " +
                  uri + ": io_uring read: " + detail::errno_text(-result));
    WS_EXPECT(result != 0, ErrorCode::kIo,
              "cannot read " + std::to_string(submission.offset) + "+" + std::to_string(submission.length) + " bytes of " +
                  uri + ": unexpected end of file (truncated file?)");
    if (result > 0 && static_cast<uint64_t>(result) < submission.length) {
      // A short read: finish the remainder synchronously rather than re-queueing.
      pread_exact(fd, uri, submission.offset + result,
                  std::span(submission.target + result, submission.length - static_cast<uint64_t>(result)));
    } else if (result < 0) {
      pread_exact(fd, uri, submission.offset, std::span(submission.target, submission.length));
    }
  }
}

}  // namespace weightstream::local_io
