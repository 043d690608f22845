// One update of an UpdateReceiver (receiver_state.hpp), from its START to its REPORT: the
// manifest checked whole and ACCEPTED, each bucket checked, received and handed to the
// LoadSession, then FINISH: every declared tensor whole, a delta's windows checked, the
// REPORT sent. A failure is told to the sender and drops the connection.
#include "update/receiver_state.hpp"

namespace weightstream {
namespace receiver {

std::string join_layers(const ModelLayout& layout, const std::vector<int64_t>& layers) {
  if (layers.empty()) return "none";
  std::string text;
  for (int64_t layer : layers) {
    if (!text.empty()) text += ", ";
    text += layer_label(layout, layer);
  }
  return text;
}

void tell_peer(Connection& connection, const Error& error) {
  Message failure;
  failure.type = MessageType::kError;
  failure.code = error.code();
  failure.text = message_text(error.what());
  try {
    send_message(connection, failure, std::chrono::milliseconds(1000));
  } catch (const Error&) {
  }
}

}  // namespace receiver

using receiver::Clock;
using receiver::join_layers;
using receiver::tell_peer;
using receiver::timed;

UpdateReport UpdateReceiver::State::run_update(const Message& start_message, Clock::time_point started,
                                               const std::string* refusal) {
  Connection& link = *connection;
  const std::string peer = link.peer();
  UpdateProgress progress;
  placing_layers.clear();
  try {
    WS_EXPECT(start_message.type == MessageType::kStart, ErrorCode::kProtocol,
              "expected START, got " + std::string(message_type_name(start_message.type)));
    WS_EXPECT(refusal == nullptr, ErrorCode::kModel, refusal ? *refusal : std::string());
    ManifestLedger ledger = accept_update(start_message, progress);
    for (;;) {
      Received received = timed(progress.phases.waiting, [&] {
        return receive_message(link, options.timeout, "bucket " + std::to_string(progress.buckets) + " or FINISH");
      });
      progress.phases.waiting -= received.parse_seconds;
      progress.phases.parsing += received.parse_seconds;
      if (progress.buckets == 0) {
        progress.phases.first_bucket = std::chrono::duration<double>(Clock::now() - started).count();
      }
      Message& message = received.message;
      WS_EXPECT(message.type != MessageType::kError, ErrorCode::kModel, message.text);  // the sender gave up
      if (message.type == MessageType::kFinish) return finish_update(start_message, message, ledger, progress, started);
      WS_EXPECT(message.type == MessageType::kBucket, ErrorCode::kProtocol,
                "expected bucket " + std::to_string(progress.buckets) + " or FINISH, got " +
                    std::string(message_type_name(message.type)));
      apply_bucket(message.manifest, start_message, ledger, progress);
    }
  } catch (const Error& error) {
    fail_update(error, link, peer, progress);
  }
}

ManifestLedger UpdateReceiver::State::accept_update(const Message& start_message, UpdateProgress& progress) {
  const TensorFormat format = start_message.format;
  timed(progress.phases.preparing, [&] { prepare(format); });  // nothing to do when prepared ahead
  prepared.reset();  // this update's now
  last_format = format;
  // The whole update is checked before its first byte: a refusal writes nothing.
  progress.delta = !start_message.versions.base.empty();
  return timed(progress.phases.checking, [&] {
    if (progress.delta) check_delta(start_message.versions);
    ManifestLedger checked = check_manifest(layout, *session, format, start_message.declared, progress.delta);
    Message accepted;
    accepted.type = MessageType::kAccepted;
    // A delta's sender sends each element this receiver holds, and digests them for FINISH.
    if (progress.delta) accepted.held = held_windows(layout, start_message.declared);
    send_message(*connection, accepted, options.timeout);
    return checked;
  });
}

void UpdateReceiver::State::apply_bucket(BucketManifest& manifest, const Message& start_message,
                                         ManifestLedger& ledger, UpdateProgress& progress) {
  UpdatePhases& phases = progress.phases;
  WS_EXPECT(manifest.index == progress.buckets, ErrorCode::kProtocol,
            "bucket numbered " + std::to_string(manifest.index) + " arrived where bucket " +
                std::to_string(progress.buckets) + " was due");
  WS_EXPECT(manifest.bytes <= bucket_bytes, ErrorCode::kProtocol,
            "bucket " + std::to_string(manifest.index) + " claims " + std::to_string(manifest.bytes) +
                " bytes, more than the agreed bucket size " + std::to_string(bucket_bytes));
  progress.current = manifest.index;
  // What the manifest did not declare, or declared otherwise, is refused before the
  // bucket's bytes are received.
  progress.sparse_tensors += ledger.account(manifest, start_message.declared, progress.delta);
  for (const SharedRegion& region : manifest.regions) {
    WS_EXPECT(region.id == progress.regions_open, ErrorCode::kProtocol,
              "bucket " + std::to_string(manifest.index) + " shares region " + std::to_string(region.id) +
                  " where region " + std::to_string(progress.regions_open) + " was due");
    timed(phases.opening, [&] { transport->open_region(region); });
    ++progress.regions_open;
  }
  std::vector<TensorView> views = bucket_views(manifest, transport->slot(manifest.slot), *transport);
  // Where the transport lands bytes where they belong: the bucket is checked whole,
  // then its entries bound as they are to one place of a host parameter are received
  // there (its other bytes land in the buffer).
  BucketPlacement placement = place_bucket(manifest, views, phases);
  if (manifest.bytes > 0) {
    timed(phases.waiting, [&] {
      transport->receive(*connection, manifest.slot, manifest.bytes, options.timeout,
                         "the " + std::to_string(manifest.bytes) + "-byte payload of bucket " +
                             std::to_string(manifest.index));
    });
  }
  timed(phases.checking, [&] { load_bucket(manifest, views, placement, progress); });
  placing_layers.clear();
  if (manifest.bytes > 0) {
    // The sender refills this slot once it hears APPLIED: on a GPU the copies out of it
    // must be done by then, not merely issued.
    timed(phases.copying, [&] { session->settle(); });
  }
  progress.current.reset();
  ++progress.buckets;
  progress.bytes += manifest.bytes;
  for (const BucketEntry& entry : manifest.entries) progress.shared_bytes += entry.source != 0 ? entry.bytes : 0;
  Message applied;
  applied.type = MessageType::kApplied;
  applied.manifest.index = manifest.index;
  applied.manifest.slot = manifest.slot;
  send_message(*connection, applied, options.timeout);
}

UpdateReceiver::State::BucketPlacement UpdateReceiver::State::place_bucket(const BucketManifest& manifest,
                                                                           const std::vector<TensorView>& views,
                                                                           UpdatePhases& phases) {
  BucketPlacement placement;
  if (manifest.bytes == 0 || !transport->places()) return placement;
  timed(phases.checking, [&] {
    try {
      session->check(views);
      placement.placements = bucket_placements(manifest, placement.entries);
    } catch (const Error&) {
      transport->place(manifest.slot, {});  // the pieces land in the buffer, unread
      throw;
    }
  });
  placing_layers = placed_layers(manifest, placement.entries);
  transport->place(manifest.slot, placement.placements);
  return placement;
}

void UpdateReceiver::State::load_bucket(const BucketManifest& manifest, std::vector<TensorView>& views,
                                        const BucketPlacement& placement, UpdateProgress& progress) {
  decode_changes(manifest, transport->slot(manifest.slot), views);
  // The session checks every entry before any byte of the bucket is written (or held
  // back); copies within the GPU are only issued, so the next bucket's checks overlap them.
  // Entries that landed in place are checked and counted, not copied.
  if (!placement.placements.empty()) {
    std::vector<bool> landed_in_place = transport->placed(manifest.slot);
    for (size_t i = 0; i < placement.entries.size(); ++i) {
      if (!landed_in_place[i]) continue;
      views[placement.entries[i]].data = placement.placements[i].destination;
      views[placement.entries[i]].device = placement.placements[i].device;
      progress.placed_bytes += placement.placements[i].bytes;
    }
  }
  if (!views.empty() && !progress.loading) {
    progress.loading = true;
    hold_version("");  // from here bytes land: unknown until the whole update has
  }
  if (!views.empty()) session->load(views);
}

UpdateReport UpdateReceiver::State::finish_update(const Message& start_message, const Message& message,
                                                  const ManifestLedger& ledger, UpdateProgress& progress,
                                                  Clock::time_point started) {
  UpdatePhases& phases = progress.phases;
  WS_EXPECT(message.buckets == progress.buckets, ErrorCode::kProtocol,
            "FINISH says " + std::to_string(message.buckets) + " buckets were sent but " +
                std::to_string(progress.buckets) + " arrived");
  // Every declared tensor whole, before the layers still held are written: an FP8
  // weight's codes never land without the scales the manifest paired them with.
  check_whole(ledger, start_message.declared);
  timed(phases.copying, [&] { session->settle(); });
  timed(phases.finishing, [&] { session->finish(); });
  progress.landed = true;
  UpdateReport report;
  if (progress.delta) {
    hold_version("");  // known again once what landed is checked
    report.checked_tensors = timed(phases.verifying, [&] {
      return check_held_digests(layout, start_message.declared, message.digests, ledger.sent_as_changes,
                                start_message.versions.target, std::max(1u, std::thread::hardware_concurrency()));
    });
  }
  timed(phases.closing, [&] { transport->end_update(); });
  report.format = start_message.format;
  report.buckets = progress.buckets;
  report.bytes = progress.bytes;
  report.shared_bytes = progress.shared_bytes;
  report.placed_bytes = progress.placed_bytes;
  report.regions = progress.regions_open;
  report.tensors = session->counters().tensors_applied;
  report.sparse_tensors = progress.sparse_tensors;
  report.dense_tensors = start_message.declared.size() - progress.sparse_tensors;
  report.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  report.connect_seconds = updates == 0 ? connect_seconds : 0;
  report.counters = session->counters();
  report.phases = phases;
  report.completed_layers = session->completed_layers();
  Message answer;
  answer.type = MessageType::kReport;
  answer.report = report;
  hold_version(start_message.versions.target);
  send_message(*connection, answer, options.timeout);
  ++updates;
  return report;
}

void UpdateReceiver::State::check_whole(const ManifestLedger& ledger, const std::vector<DeclaredTensor>& declared) {
  std::vector<std::string> short_of;
  for (size_t i = 0; i < ledger.bytes.size(); ++i) {
    if (ledger.received[i] == ledger.bytes[i]) continue;
    short_of.push_back(declared[i].name + " (" + std::to_string(ledger.received[i]) + " of " +
                       std::to_string(ledger.bytes[i]) + " bytes)");
  }
  if (short_of.empty()) return;
  std::string names;
  for (size_t i = 0; i < short_of.size() && i < kProblemsListed; ++i) names += (i ? ", " : "") + short_of[i];
  if (short_of.size() > kProblemsListed) names += " and " + std::to_string(short_of.size() - kProblemsListed) + " more";
  WS_FAIL(ErrorCode::kModel, "FINISH came before " + std::to_string(short_of.size()) + " declared tensor" +
                                 (short_of.size() == 1 ? "" : "s") + " arrived whole: " + names);
}

void UpdateReceiver::State::fail_update(const Error& error, Connection& link, const std::string& peer,
                                        const UpdateProgress& progress) {
  // Tell the sender why, then drop the connection: after a failure neither side knows
  // where the other stands.
  tell_peer(link, error);
  std::string applied = session ? join_layers(layout, session->completed_layers()) : "none";
  std::string part_new;  // over ucx, layers whose tensors landed in part
  if (session && commit() == LayerCommit::kAsArrived) {
    std::vector<int64_t> completed = session->completed_layers();
    std::set<int64_t> touched(placing_layers.begin(), placing_layers.end());
    for (int64_t layer : session->touched_layers()) touched.insert(layer);
    std::vector<int64_t> partial;
    std::ranges::set_difference(touched, completed, std::back_inserter(partial));
    part_new = "; layers written in part (over ucx, tensors land in their parameters as they arrive): " +
               join_layers(layout, partial);
  }
  session.reset();  // waits for copies issued from the sender's regions before closing them
  drop_connection();  // closes the regions
  WS_EXPECT(!progress.landed, error.code(),
            "update from " + peer + " to " + self() + " failed after it landed: " + error.what());
  const bool stopped = cancelled.load();
  WS_FAIL(stopped ? ErrorCode::kCancelled : error.code(),
          "update from " + peer + " to " + self() + " failed " + progress.last_bucket_text() + ": " +
              (stopped ? "cancelled (the receiver was cancelled, which shut the connection down)"
                       : std::string(error.what())) + "; layers completed and applied before the failure: " + applied +
                            part_new + "; every other layer keeps its old values (a reload restores a consistent model)");
}

}  // namespace weightstream
