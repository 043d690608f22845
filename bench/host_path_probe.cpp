// What bounds a warm load onto a GPU (issue 19): each mechanism a loader could use to get
// page-cache bytes to the device, timed alone and in combination on the same files.
//
//   host_path_probe [--dir DIR] [--files 8] [--file-gib 1] [--device cuda:0]
//
// Writes DIR/probe-N.bin if missing (pattern bytes), reads them once so the cache is warm,
// then prints one line per measurement: the pinned copy ceiling, pread and memcpy rates from
// the page cache (no GPU), cudaHostRegister / unregister rates of mapped windows by thread
// count and window size, the copy rate out of registered page-cache pages, and end-to-end
// pipelines: staged (pread into pinned, copy), mapped (register, copy, unregister) and both
// at once on disjoint files. Uses the library's device layer for every CUDA call.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "weightstream/device.hpp"
#include "device/shared/copies.hpp"
#include "device/shared/host_registration.hpp"
#include "weightstream/error.hpp"

using namespace weightstream;

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kChunk = 16 * kMiB;

using Clock = std::chrono::steady_clock;
double since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

void report(const std::string& name, uint64_t bytes, double seconds, const std::string& note = {}) {
  std::printf("probe: %-52s %7.3f s %7.2f GB/s%s%s\n", name.c_str(), seconds, bytes / seconds / 1e9,
              note.empty() ? "" : "  ", note.c_str());
  std::fflush(stdout);
}

struct File {
  std::string path;
  int fd = -1;
  uint64_t size = 0;
  const std::byte* map = nullptr;
};

/// One range of one file: the unit every experiment hands to a thread.
struct Piece {
  size_t file;
  uint64_t offset;
  uint64_t length;
};

std::vector<Piece> pieces_of(const std::vector<File>& files, size_t first, size_t last, uint64_t size) {
  std::vector<Piece> pieces;
  for (size_t f = first; f < last; ++f) {
    for (uint64_t at = 0; at < files[f].size; at += size) pieces.push_back({f, at, std::min(size, files[f].size - at)});
  }
  return pieces;
}

uint64_t bytes_of(const std::vector<Piece>& pieces) {
  uint64_t total = 0;
  for (auto& piece : pieces) total += piece.length;
  return total;
}

/// Runs `body(thread)` on `threads` threads and returns the wall seconds.
double parallel(unsigned threads, const std::function<void(unsigned)>& body) {
  auto start = Clock::now();
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back(body, t);
  for (auto& thread : pool) thread.join();
  return since(start);
}

void pread_all(int fd, std::byte* target, uint64_t length, uint64_t offset) {
  while (length > 0) {
    ssize_t got = ::pread(fd, target, length, static_cast<off_t>(offset));
    WS_EXPECT(got > 0, ErrorCode::kIo, "pread failed");
    target += got;
    length -= static_cast<uint64_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

/// Destination offsets: every piece lands at its own place of one device buffer.
std::vector<uint64_t> destination_offsets(const std::vector<File>& files) {
  std::vector<uint64_t> offsets(files.size());
  uint64_t at = 0;
  for (size_t f = 0; f < files.size(); ++f) {
    offsets[f] = at;
    at += files[f].size;
  }
  return offsets;
}

/// Staged: each thread preads a chunk into one of two pinned buffers while the copy of the
/// other runs on its own stream.
void staged_worker(const std::vector<File>& files, const std::vector<Piece>& pieces, std::atomic<size_t>& next,
                   const Device& device, std::byte* destination, const std::vector<uint64_t>& offsets) {
  Buffer buffers[2] = {Buffer(Device{}, kChunk, HostMemory::kPinned), Buffer(Device{}, kChunk, HostMemory::kPinned)};
  DeviceStream stream(device);
  unsigned turn = 0;
  for (size_t i; (i = next.fetch_add(1)) < pieces.size();) {
    const Piece& piece = pieces[i];
    Buffer& buffer = buffers[turn++ % 2];
    pread_all(files[piece.file].fd, buffer.data(), piece.length, piece.offset);
    stream.synchronize("staged");  // the copy out of this buffer two steps ago is done
    stream.copy_async(destination + offsets[piece.file] + piece.offset, buffer.data(), piece.length, "staged");
  }
  stream.synchronize("staged");
}

/// Mapped: each thread registers a window, copies it, and registers the next while that copy
/// runs; a window is unregistered once its copy is done.
void mapped_worker(const std::vector<File>& files, const std::vector<Piece>& windows, std::atomic<size_t>& next,
                   const Device& device, std::byte* destination, const std::vector<uint64_t>& offsets) {
  DeviceStream stream(device);
  std::unique_ptr<HostRegistration> in_flight;
  for (size_t i; (i = next.fetch_add(1)) < windows.size();) {
    const Piece& window = windows[i];
    const std::byte* base = files[window.file].map + window.offset;
    auto registration = std::make_unique<HostRegistration>(device, base, window.length);
    stream.synchronize("mapped");
    in_flight.reset();
    stream.copy_async(destination + offsets[window.file] + window.offset, base, window.length, "mapped");
    in_flight = std::move(registration);
  }
  stream.synchronize("mapped");
}

}  // namespace

int main(int argc, char** argv) {
  std::string directory = "/tmp/host-path-probe";
  size_t file_count = 8;
  uint64_t file_bytes = kGiB;
  Device device = parse_device("cuda:0");
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--dir") directory = argv[i + 1];
    else if (flag == "--files") file_count = std::stoul(argv[i + 1]);
    else if (flag == "--file-gib") file_bytes = static_cast<uint64_t>(std::stod(argv[i + 1]) * kGiB);
    else if (flag == "--device") device = parse_device(argv[i + 1]);
  }
  try {
    ::mkdir(directory.c_str(), 0755);
    std::vector<File> files(file_count);
    {
      std::vector<std::byte> pattern(64 * kMiB);
      for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<std::byte>(i * 2654435761u >> 13);
      for (size_t f = 0; f < file_count; ++f) {
        File& file = files[f];
        file.path = directory + "/probe-" + std::to_string(f) + ".bin";
        struct stat status {};
        if (::stat(file.path.c_str(), &status) != 0 || static_cast<uint64_t>(status.st_size) != file_bytes) {
          int fd = ::open(file.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
          WS_EXPECT(fd >= 0, ErrorCode::kIo, "cannot create " + file.path);
          for (uint64_t at = 0; at < file_bytes; at += pattern.size()) {
            uint64_t length = std::min<uint64_t>(pattern.size(), file_bytes - at);
            WS_EXPECT(::pwrite(fd, pattern.data(), length, static_cast<off_t>(at)) == static_cast<ssize_t>(length),
                      ErrorCode::kIo, "cannot write " + file.path);
          }
          ::close(fd);
        }
        file.fd = ::open(file.path.c_str(), O_RDONLY);
        file.size = file_bytes;
        void* map = ::mmap(nullptr, file.size, PROT_READ, MAP_SHARED, file.fd, 0);
        WS_EXPECT(map != MAP_FAILED, ErrorCode::kIo, "cannot map " + file.path);
        file.map = static_cast<const std::byte*>(map);
      }
    }
    const uint64_t total = file_count * file_bytes;
    auto chunks = pieces_of(files, 0, files.size(), kChunk);
    {  // warm the cache (and report the rate of a plain read pass)
      std::atomic<size_t> next{0};
      double seconds = parallel(16, [&](unsigned) {
        std::vector<std::byte> buffer(kChunk);
        for (size_t i; (i = next.fetch_add(1)) < chunks.size();)
          pread_all(files[chunks[i].file].fd, buffer.data(), chunks[i].length, chunks[i].offset);
      });
      report("warm-up pread, 16 threads (cache may be cold)", total, seconds);
    }
    Buffer device_buffer(device, total);
    auto offsets = destination_offsets(files);

    {  // the ceiling: one pinned buffer to the device on 4 streams
      Buffer pinned(Device{}, kGiB, HostMemory::kPinned);
      std::memset(pinned.data(), 1, pinned.size());
      std::vector<DeviceStream> streams;
      for (int s = 0; s < 4; ++s) streams.emplace_back(device);
      for (int round = 0; round < 2; ++round) {
        auto start = Clock::now();
        for (uint64_t at = 0; at < total; at += 256 * kMiB) {
          auto& stream = streams[(at / (256 * kMiB)) % 4];
          stream.copy_async(device_buffer.data() + at, pinned.data() + at % kGiB, 256 * kMiB, "ceiling");
        }
        for (auto& stream : streams) stream.synchronize("ceiling");
        if (round == 1) report("pinned host-to-device copy, 4 streams", total, since(start));
      }
    }

    for (unsigned threads : {4u, 8u, 16u, 32u}) {  // the page cache's copy rate, no GPU
      std::atomic<size_t> next{0};
      double seconds = parallel(threads, [&](unsigned) {
        Buffer buffer(Device{}, kChunk, HostMemory::kPinned);
        for (size_t i; (i = next.fetch_add(1)) < chunks.size();)
          pread_all(files[chunks[i].file].fd, buffer.data(), chunks[i].length, chunks[i].offset);
      });
      report("pread 16 MiB into pinned, " + std::to_string(threads) + " threads", total, seconds);
    }
    {
      auto start = Clock::now();
#ifdef MADV_POPULATE_READ
      for (auto& file : files) ::madvise(const_cast<std::byte*>(file.map), file.size, MADV_POPULATE_READ);
#endif
      report("MADV_POPULATE_READ of every mapping, 1 thread", total, since(start));
    }
    for (unsigned threads : {8u, 16u}) {
      std::atomic<size_t> next{0};
      double seconds = parallel(threads, [&](unsigned) {
        Buffer buffer(Device{}, kChunk, HostMemory::kPinned);
        for (size_t i; (i = next.fetch_add(1)) < chunks.size();)
          std::memcpy(buffer.data(), files[chunks[i].file].map + chunks[i].offset, chunks[i].length);
      });
      report("memcpy from populated mapping into pinned, " + std::to_string(threads) + " threads", total, seconds);
    }

    for (uint64_t window : {64 * kMiB, 256 * kMiB, kGiB}) {  // registration alone
      auto windows = pieces_of(files, 0, files.size(), window);
      for (unsigned threads : {1u, 4u, 16u}) {
        std::vector<std::unique_ptr<HostRegistration>> registrations(windows.size());
        std::atomic<size_t> next{0};
        double seconds = parallel(threads, [&](unsigned) {
          for (size_t i; (i = next.fetch_add(1)) < windows.size();)
            registrations[i] = std::make_unique<HostRegistration>(device, files[windows[i].file].map + windows[i].offset,
                                                                  windows[i].length);
        });
        std::string shape = std::to_string(window / kMiB) + " MiB windows, " + std::to_string(threads) + " threads";
        report("cudaHostRegister " + shape, total, seconds);
        if (window == 256 * kMiB && threads == 16) {  // DMA out of registered page-cache pages
          std::vector<DeviceStream> streams;
          for (int s = 0; s < 4; ++s) streams.emplace_back(device);
          auto start = Clock::now();
          for (size_t i = 0; i < windows.size(); ++i)
            streams[i % 4].copy_async(device_buffer.data() + offsets[windows[i].file] + windows[i].offset,
                                      files[windows[i].file].map + windows[i].offset, windows[i].length, "registered");
          for (auto& stream : streams) stream.synchronize("registered");
          report("copy out of registered page cache, 4 streams", total, since(start));
        }
        next = 0;
        seconds = parallel(threads, [&](unsigned) {
          for (size_t i; (i = next.fetch_add(1)) < windows.size();) registrations[i].reset();
        });
        report("cudaHostUnregister " + shape, total, seconds);
      }
    }

    auto staged = [&](size_t first, size_t last, unsigned threads) {
      auto pieces = pieces_of(files, first, last, kChunk);
      auto next = std::make_shared<std::atomic<size_t>>(0);
      return std::make_pair(bytes_of(pieces), [&, pieces, next, threads] {
        parallel(threads, [&](unsigned) { staged_worker(files, pieces, *next, device, device_buffer.data(), offsets); });
      });
    };
    auto mapped = [&](size_t first, size_t last, unsigned threads, uint64_t window) {
      auto pieces = pieces_of(files, first, last, window);
      auto next = std::make_shared<std::atomic<size_t>>(0);
      return std::make_pair(bytes_of(pieces), [&, pieces, next, threads] {
        parallel(threads, [&](unsigned) { mapped_worker(files, pieces, *next, device, device_buffer.data(), offsets); });
      });
    };
    for (unsigned threads : {8u, 16u, 24u}) {
      auto [bytes, run] = staged(0, files.size(), threads);
      auto start = Clock::now();
      run();
      report("staged pipeline, " + std::to_string(threads) + " threads", bytes, since(start));
    }
    for (auto [threads, window] : {std::pair{4u, 64 * kMiB}, std::pair{8u, 64 * kMiB}, std::pair{8u, 256 * kMiB},
                                   std::pair{16u, 256 * kMiB}}) {
      auto [bytes, run] = mapped(0, files.size(), threads, window);
      auto start = Clock::now();
      run();
      report("mapped pipeline, " + std::to_string(threads) + " threads, " + std::to_string(window / kMiB) + " MiB",
             bytes, since(start));
    }
    for (auto [staged_threads, mapped_threads, staged_files] :
         {std::tuple{12u, 4u, file_count / 2}, std::tuple{12u, 4u, file_count * 5 / 8}, std::tuple{8u, 8u, file_count / 2}}) {
      auto staged_run = staged(0, staged_files, staged_threads);
      auto mapped_run = mapped(staged_files, files.size(), mapped_threads, 256 * kMiB);
      const uint64_t staged_bytes = staged_run.first, mapped_bytes = mapped_run.first;
      auto start = Clock::now();
      double staged_seconds = 0, mapped_seconds = 0;
      std::thread a([&] { staged_run.second(); staged_seconds = since(start); });
      std::thread b([&] { mapped_run.second(); mapped_seconds = since(start); });
      a.join();
      b.join();
      char note[160];
      std::snprintf(note, sizeof note, "(staged %.1f GB in %.3f s, mapped %.1f GB in %.3f s)", staged_bytes / 1e9,
                    staged_seconds, mapped_bytes / 1e9, mapped_seconds);
      report("both: " + std::to_string(staged_threads) + " staged + " + std::to_string(mapped_threads) +
                 " mapped threads, " + std::to_string(staged_files) + "/" + std::to_string(file_count) + " files staged",
             staged_bytes + mapped_bytes, since(start), note);
    }
    for (auto& file : files) {
      ::munmap(const_cast<std::byte*>(file.map), file.size);
      ::close(file.fd);
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "host_path_probe: %s\n", error.what());
    return 1;
  }
  return 0;
}
