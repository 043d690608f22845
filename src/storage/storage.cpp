// What every Storage backend shares: the scatter read by one read() per segment.
#include "weightstream/storage.hpp"

namespace weightstream {

void Storage::read_scattered(std::string_view name, uint64_t offset, std::span<const std::span<std::byte>> segments) {
  for (std::span<std::byte> segment : segments) {
    read(name, offset, segment);
    offset += segment.size();
  }
}

}  // namespace weightstream
