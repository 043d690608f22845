// Step 3 of LoadSession::load(): with whole-layer commits, pieces of a layer still incomplete
// are held (by reference, or copied out of a source that may change) until their layer is whole.
#include <algorithm>
#include <set>

#include "base/text.hpp"
#include "model/session_state.hpp"

namespace weightstream {

using namespace model;  // the session's internal pieces (piece_write.hpp)

namespace {

const Device kHost{};

}  // namespace

void LoadSession::State::Ready::copy_held() {
  for (const auto& copy : copies) {
    try {
      copy_bytes(copy->destination, copy->destination_device, copy->source, kHost, copy->bytes);
    } catch (...) {
      copy->done.set_exception(std::current_exception());
      throw;
    }
    copy->done.set_value();
  }
  copies.clear();
  for (const auto& copied : waits) copied.get();  // rethrows a copy that was abandoned
}

LoadSession::State::Ready::~Ready() {
  for (const auto& copy : copies) {
    copy->done.set_exception(std::make_exception_ptr(
        Error(ErrorCode::kModel, "a held piece was never copied: the load() call that held it failed")));
  }
}

LoadSession::State::Ready LoadSession::State::hold(std::vector<Write> writes) {
  Ready ready;
  if (commit != LayerCommit::kWholeLayer) {
    ready.writes = std::move(writes);
    return ready;
  }
  std::set<int64_t> flushed;
  for (Write& write : writes) {
    LayerState& layer_state = layers[layout.parameters()[write.parameter].layer];
    if (!layer_state.complete_now()) {
      keep(Held{write, std::make_shared<const std::string>(write.name), {}}, ready);
      continue;
    }
    ready.writes.push_back(write);
    if (!flushed.insert(layout.parameters()[write.parameter].layer).second) continue;
    for (Held& held : layer_state.held) {
      ready.writes.push_back(held.write);
      ready.names.push_back(held.name);
      if (held.copied.valid()) ready.waits.push_back(held.copied);
    }
    // The held bytes live on in the writes' keepalives.
    layer_state.held.clear();
  }
  return ready;
}

void LoadSession::State::keep(Held held, Ready& ready) {
  Write& write = held.write;
  write.name = *held.name;
  if (write.changes) {
    // The changed elements are the session's own: nothing to copy.
  } else if (write.lifetime == SourceLifetime::kLoad) {
    write.keepalive.reset();
  } else if (write.lifetime == SourceLifetime::kKeepalive && write.keepalive) {
    // The keepalive goes with the held write: nothing to copy.
  } else if (!write.device.is_cuda()) {
    counters.held_bytes_copied += source_bytes(write);
    auto pending = std::make_shared<HeldCopy>();
    std::shared_ptr<std::byte> copy = take_device_held(write);
    if (copy) {
      counters.held_bytes_on_device += source_bytes(write);
      pending->destination_device = held_device_bytes->device();
    } else {
      copy = held_bytes->take(source_bytes(write));
    }
    pending->destination = copy.get();
    pending->source = write.source;
    pending->bytes = source_bytes(write);
    held.copied = pending->copied;
    write.source = copy.get();
    write.device = pending->destination_device;
    write.keepalive = std::move(copy);
    ready.copies.push_back(std::move(pending));
  } else {
    counters.held_bytes_copied += write.end - write.begin;
    auto copy = std::make_shared<Buffer>(write.device, std::max<uint64_t>(write.end - write.begin, 1));
    copy_bytes(copy->data(), write.device, write.source, write.device, write.end - write.begin);
    wait_for_copies(write.device);
    write.source = copy->data();
    write.keepalive = std::move(copy);
  }
  layers[layout.parameters()[write.parameter].layer].held.push_back(std::move(held));
}

std::shared_ptr<std::byte> LoadSession::State::take_device_held(const Write& write) {
  const Parameter& parameter = layout.parameters()[write.parameter];
  if (!held_device_bytes || parameter.device != held_device_bytes->device() || write.dtype != parameter.load_dtype) {
    return nullptr;
  }
  return held_device_bytes->take(source_bytes(write));
}

bool LoadSession::State::may_write_unlocked(std::span<const Write> writes) const {
  return std::ranges::none_of(writes, [&](const Write& write) {
    return write.changes || write.dtype != layout.parameters()[write.parameter].load_dtype;
  });
}

void LoadSession::State::release_held_bytes() {
  held_bytes->release();
  if (held_device_bytes) held_device_bytes->release();
}

}  // namespace weightstream
