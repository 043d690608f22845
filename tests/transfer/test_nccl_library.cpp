// The NCCL transport opens libnccl at first use instead of linking it (so a process that
// holds torch uses torch's NCCL). These run wherever the build has NCCL, GPU or not:
// making a unique id needs the library, not a device.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include "update/transport.hpp"

namespace weightstream::transfer {
namespace {

TEST(NcclLibrary, OpensAtFirstUseAndMakesAUniqueId) {
  if (!nccl_compiled()) GTEST_SKIP() << "this build has no NCCL";
  std::vector<std::byte> id;
  try {
    id = nccl_unique_id();
  } catch (const Error& error) {
    // No network interface NCCL's bootstrap accepts is a machine's limit, not ours; a
    // library that failed to open says so and fails the test.
    ASSERT_EQ(std::string(error.what()).find("cannot load"), std::string::npos) << error.what();
    GTEST_SKIP() << "ncclGetUniqueId failed here: " << error.what();
  }
  EXPECT_EQ(id.size(), 128u);  // sizeof(ncclUniqueId)
  // The transport opened the library (by name, or by the path found at build time).
  void* by_path = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
#ifdef WS_NCCL_FALLBACK_PATH
  if (by_path == nullptr) by_path = ::dlopen(WS_NCCL_FALLBACK_PATH, RTLD_NOW | RTLD_NOLOAD);
#endif
  EXPECT_NE(by_path, nullptr);
}

}  // namespace
}  // namespace weightstream::transfer
