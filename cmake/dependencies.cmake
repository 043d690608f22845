# Every third-party library is found here, in one place.
find_package(Threads REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(CURL REQUIRED)

find_path(XXHASH_INCLUDE_DIR xxhash.h REQUIRED)
find_library(XXHASH_LIBRARY NAMES xxhash)
add_library(ws_xxhash INTERFACE)
target_include_directories(ws_xxhash SYSTEM INTERFACE ${XXHASH_INCLUDE_DIR})
# The shared library alone, for the installed package's link interface (src/CMakeLists.txt).
set(WS_XXHASH_LIBRARY "")
if(XXHASH_LIBRARY)
  set(WS_XXHASH_LIBRARY ${XXHASH_LIBRARY})
  target_link_libraries(ws_xxhash INTERFACE ${XXHASH_LIBRARY})
else()
  # Header-only mode of xxHash (used where only the header was carried).
  target_compile_definitions(ws_xxhash INTERFACE XXH_INLINE_ALL)
endif()

set(WS_HAVE_URING OFF)
if(NOT WS_WITH_URING STREQUAL "OFF")
  find_path(URING_INCLUDE_DIR liburing.h)
  find_library(URING_LIBRARY NAMES uring)
  if(URING_INCLUDE_DIR AND URING_LIBRARY)
    set(WS_HAVE_URING ON)
  elseif(WS_WITH_URING STREQUAL "ON")
    message(FATAL_ERROR "WS_WITH_URING=ON but liburing was not found")
  endif()
endif()
message(STATUS "weightstream: io_uring ${WS_HAVE_URING}")

set(WS_HAVE_CUDA OFF)
if(NOT WS_WITH_CUDA STREQUAL "OFF")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(WS_HAVE_CUDA ON)
  elseif(WS_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "WS_WITH_CUDA=ON but the CUDA toolkit was not found")
  endif()
endif()
message(STATUS "weightstream: CUDA ${WS_HAVE_CUDA}")

# CUDA kernels of our own (src/device/*_kernels.cu: one launch copies thousands of
# tensors) where nvcc works; without it those copies fall back to the driver's batch call.
set(WS_HAVE_CUDA_KERNELS OFF)
if(WS_HAVE_CUDA)
  include(CheckLanguage)
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND CUDAToolkit_NVCC_EXECUTABLE)
    set(CMAKE_CUDA_COMPILER ${CUDAToolkit_NVCC_EXECUTABLE})
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Ampere and Hopper machine code, and PTX the driver compiles for newer GPUs.
      set(CMAKE_CUDA_ARCHITECTURES 80-real 90-real 90-virtual)
    endif()
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    enable_language(CUDA)
    set(WS_HAVE_CUDA_KERNELS ON)
  endif()
endif()
message(STATUS "weightstream: CUDA kernels ${WS_HAVE_CUDA_KERNELS}")

# pugixml parses S3 ListObjectsV2 pages (src/storage/s3_listing.cpp).
find_package(pugixml 1.11 REQUIRED)
# Its static library where the package has one (Debian's is PIC): one shared library fewer
# to find at run time, for the command and for the Python module, whose installed copy
# carries no run path to wherever pugixml was found.
if(TARGET pugixml::static)
  set(WS_PUGIXML pugixml::static)
else()
  set(WS_PUGIXML pugixml::pugixml)
endif()

# NCCL (the update transport across GPUs and hosts, src/update/*_nccl.cpp). It ships
# with the CUDA toolkit on the GPU machines (lib/ beside include/), or system-wide.
set(WS_WITH_NCCL "AUTO" CACHE STRING "Build the NCCL update transport: AUTO, ON or OFF")
set(WS_HAVE_NCCL OFF)
if(WS_HAVE_CUDA AND NOT WS_WITH_NCCL STREQUAL "OFF")
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_LIBRARY_ROOT}/include)
  find_library(NCCL_LIBRARY NAMES nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib
               ${CUDAToolkit_LIBRARY_ROOT}/lib64)
  if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
    set(WS_HAVE_NCCL ON)
  endif()
endif()
if(WS_WITH_NCCL STREQUAL "ON" AND NOT WS_HAVE_NCCL)
  message(FATAL_ERROR "WS_WITH_NCCL=ON but NCCL (and CUDA) were not found")
endif()
message(STATUS "weightstream: NCCL ${WS_HAVE_NCCL}")

# UCX (the cross-host engine: peer pulls and the ucx update transport, src/net/*_ucx.cpp).
# Debian's libucx-dev here; the libucx-cu12/cu13 wheels carry a CUDA-aware build elsewhere
# (point WS_DEPS_DIR or CMAKE_PREFIX_PATH at it).
set(WS_WITH_UCX "AUTO" CACHE STRING "Build the UCX peer and update transport: AUTO, ON or OFF")
set(WS_HAVE_UCX OFF)
if(NOT WS_WITH_UCX STREQUAL "OFF")
  find_path(UCX_INCLUDE_DIR ucp/api/ucp.h)
  find_library(UCX_UCP_LIBRARY NAMES ucp)
  find_library(UCX_UCS_LIBRARY NAMES ucs)
  if(UCX_INCLUDE_DIR AND UCX_UCP_LIBRARY AND UCX_UCS_LIBRARY)
    set(WS_HAVE_UCX ON)
  elseif(WS_WITH_UCX STREQUAL "ON")
    message(FATAL_ERROR "WS_WITH_UCX=ON but UCX (ucp/api/ucp.h, libucp, libucs) was not found")
  endif()
endif()
message(STATUS "weightstream: UCX ${WS_HAVE_UCX}")

# prometheus-cpp (the /metrics endpoint of `serve` and the update receiver, --metrics-listen:
# src/cli/metrics_prometheus.cpp). Debian's prometheus-cpp-dev; without it the command
# refuses --metrics-listen, saying why (metrics_prometheus_fallback.cpp).
set(WS_WITH_PROMETHEUS "AUTO" CACHE STRING "Build the Prometheus metrics endpoint: AUTO, ON or OFF")
set(WS_HAVE_PROMETHEUS OFF)
if(NOT WS_WITH_PROMETHEUS STREQUAL "OFF")
  find_package(prometheus-cpp CONFIG QUIET)
  if(TARGET prometheus-cpp::pull)
    set(WS_HAVE_PROMETHEUS ON)
  elseif(WS_WITH_PROMETHEUS STREQUAL "ON")
    message(FATAL_ERROR "WS_WITH_PROMETHEUS=ON but prometheus-cpp (its pull library) was not found")
  endif()
endif()
message(STATUS "weightstream: Prometheus metrics ${WS_HAVE_PROMETHEUS}")
