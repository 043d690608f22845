// populate_destination: reads populate the pages of their destination before copying into
// them, and never change a byte, including the bytes of the pages they share with neighbours.
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "storage/shared/read_destination.hpp"

namespace weightstream {
namespace {

/// Fresh anonymous memory, unmapped on destruction.
class FreshPages {
 public:
  explicit FreshPages(size_t pages) : bytes_(pages * static_cast<size_t>(::sysconf(_SC_PAGESIZE))) {
    void* data = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(data, MAP_FAILED);
    data_ = static_cast<std::byte*>(data);
  }
  ~FreshPages() { ::munmap(data_, bytes_); }
  std::byte* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  /// Whether each page is in memory.
  std::vector<bool> resident() const {
    std::vector<unsigned char> flags(bytes_ / static_cast<size_t>(::sysconf(_SC_PAGESIZE)));
    EXPECT_EQ(::mincore(data_, bytes_, flags.data()), 0);
    std::vector<bool> result;
    for (unsigned char flag : flags) result.push_back(flag & 1);
    return result;
  }

 private:
  size_t bytes_;
  std::byte* data_ = nullptr;
};

bool populate_supported() {
  FreshPages probe(1);
  storage::populate_destination(std::span(probe.data(), 1));
  return probe.resident()[0];
}

TEST(PopulateDestination, FaultsInTheDestinationsPagesZeroFilledAndNoOthers) {
  if (!populate_supported()) GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE (Linux 5.14)";
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  FreshPages memory(16);
  // From the middle of page 3 to the middle of page 9: pages 3 to 9 whole.
  storage::populate_destination(std::span(memory.data() + 3 * page + 100, 6 * page));
  std::vector<bool> resident = memory.resident();
  for (size_t i = 0; i < resident.size(); ++i) EXPECT_EQ(resident[i], i >= 3 && i <= 9) << "page " << i;
  EXPECT_TRUE(std::all_of(memory.data(), memory.data() + memory.bytes(), [](std::byte b) { return b == std::byte{0}; }));
}

TEST(PopulateDestination, KeepsTheBytesOfPagesAlreadyWritten) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  FreshPages memory(64);
  // A neighbour's bytes on the destination's first and last pages, and a page in between
  // written earlier: none of them may change.
  std::memset(memory.data() + 5 * page, 0xA5, 200);
  std::memset(memory.data() + 20 * page, 0x3C, page);
  std::memset(memory.data() + 40 * page + 300, 0x5A, page - 300);
  storage::populate_destination(std::span(memory.data() + 5 * page + 200, 35 * page + 100));
  for (size_t i = 0; i < memory.bytes(); ++i) {
    std::byte expected{0};
    if (i >= 5 * page && i < 5 * page + 200) expected = std::byte{0xA5};
    if (i >= 20 * page && i < 21 * page) expected = std::byte{0x3C};
    if (i >= 40 * page + 300 && i < 41 * page) expected = std::byte{0x5A};
    ASSERT_EQ(memory.data()[i], expected) << "byte " << i;
  }
}

TEST(PopulateDestination, AnEmptyDestinationTouchesNothing) {
  FreshPages memory(2);
  storage::populate_destination(std::span(memory.data(), size_t{0}));
  EXPECT_EQ(memory.resident(), std::vector<bool>(2, false));
}

TEST(SliceSegments, CutsAcrossSegmentsAndLeavesOutEmptyOnes) {
  std::vector<std::byte> memory(100);
  std::vector<std::span<std::byte>> segments = {std::span(memory).subspan(0, 10), std::span(memory).subspan(10, 0),
                                                std::span(memory).subspan(50, 30), std::span(memory).subspan(20, 5)};
  EXPECT_EQ(storage::segments_bytes(segments), 45u);
  // Bytes 5..40 of the sequence: the first segment's last 5, all 30 of the third, none of
  // the fourth; the empty one is left out.
  auto slice = storage::slice_segments(segments, 5, 35);
  ASSERT_EQ(slice.size(), 2u);
  EXPECT_EQ(slice[0].data(), memory.data() + 5);
  EXPECT_EQ(slice[0].size(), 5u);
  EXPECT_EQ(slice[1].data(), memory.data() + 50);
  EXPECT_EQ(slice[1].size(), 30u);
  slice = storage::slice_segments(segments, 38, 7);
  ASSERT_EQ(slice.size(), 2u);
  EXPECT_EQ(slice[0].data(), memory.data() + 78);
  EXPECT_EQ(slice[0].size(), 2u);
  EXPECT_EQ(slice[1].data(), memory.data() + 20);
  EXPECT_EQ(slice[1].size(), 5u);
  EXPECT_TRUE(storage::slice_segments(segments, 45, 0).empty());
}

}  // namespace
}  // namespace weightstream
