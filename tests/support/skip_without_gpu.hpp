#pragma once
// Skips a GoogleTest test on a machine without a CUDA device, saying why and where the CUDA
// path is tested instead.

#include <gtest/gtest.h>

#include "weightstream/device.hpp"

#define WS_SKIP_WITHOUT_GPU()                                                                          \
  do {                                                                                                 \
    if (::weightstream::cuda_device_count() == 0)                                                      \
      GTEST_SKIP() << (::weightstream::cuda_compiled() ? "no CUDA device on this machine"              \
                                                       : "built without CUDA")                         \
                   << ": the CUDA path is tested by scripts/gpu.sh on a GPU machine";                  \
  } while (0)
