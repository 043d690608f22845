// What every Storage backend shares: the scatter read by one read() per segment, and
// borrowing by a read into memory of the borrower's own.
#include "weightstream/storage.hpp"

namespace weightstream {

void Storage::read_scattered(std::string_view name, uint64_t offset, std::span<const std::span<std::byte>> segments) {
  for (std::span<std::byte> segment : segments) {
    read(name, offset, segment);
    offset += segment.size();
  }
}

Bytes Storage::borrow(std::string_view name, uint64_t offset, uint64_t length, const BorrowOptions& /*options*/) {
  // Not zeroed first: read() fills every byte or throws.
  std::shared_ptr<std::byte[]> copy = std::make_shared_for_overwrite<std::byte[]>(length);
  read(name, offset, std::span(copy.get(), length));
  return {std::span<const std::byte>(copy.get(), length), copy, copy.get(), false};
}

}  // namespace weightstream
