// Load strategies and the chain that tries them. The storage strategies share one load:
// open the checkpoint (only the shards that hold wanted tensors when the target is not
// loaded), plan every module and check the plans before a byte is written, then stream the
// checkpoint once, routing each tensor to the module (or modules) that want it.
#include <algorithm>
#include <map>
#include <mutex>
#include <set>

#include "resolve/source_probe.hpp"
#include "weightstream/error.hpp"
#include "weightstream/resolve.hpp"

namespace weightstream {
namespace {

using detail::join;
using detail::join_limited;

/// "the target and the draft (mtp)".
std::string modules_text(const LoadContext& context) {
  std::vector<std::string> names;
  for (const ModuleLoadRequest* module : context.modules) names.push_back(module->resolution.module_text());
  return join(names, " and ");
}

/// A storage root seen through a filter: only `names` are listed, so a Checkpoint opened on it
/// reads the headers of those shards only (the index is hidden; the caller took the shard
/// list from it).
class ShardSubsetStorage final : public Storage {
 public:
  ShardSubsetStorage(std::shared_ptr<Storage> storage, std::set<std::string, std::less<>> names)
      : storage_(std::move(storage)), names_(std::move(names)) {}
  std::string root_uri() const override { return storage_->root_uri(); }
  std::string object_uri(std::string_view name) const override { return storage_->object_uri(name); }
  std::vector<ObjectInfo> list() override {
    std::vector<ObjectInfo> objects = storage_->list();
    std::erase_if(objects, [&](const ObjectInfo& object) { return !names_.contains(object.name); });
    return objects;
  }
  ObjectInfo stat(std::string_view name) override { return storage_->stat(name); }
  void read(std::string_view name, uint64_t offset, std::span<std::byte> destination) override {
    storage_->read(name, offset, destination);
  }
  unsigned preferred_concurrency() const override { return storage_->preferred_concurrency(); }
  Bytes borrow(std::string_view name, uint64_t offset, uint64_t length, const BorrowOptions& options) override {
    return storage_->borrow(name, offset, length, options);
  }
  bool lends_views() const override { return storage_->lends_views(); }
  bool views_serve_reads() const override { return storage_->views_serve_reads(); }
  std::optional<double> cached_share(std::string_view name) override { return storage_->cached_share(name); }
  StorageStats stats() const override { return storage_->stats(); }

 private:
  std::shared_ptr<Storage> storage_;
  std::set<std::string, std::less<>> names_;
};

/// One module being loaded: its plan and its session.
struct ModuleRun {
  ModuleLoadRequest* request = nullptr;
  LoadPlan plan;
  std::unique_ptr<LoadSession> session;
};

/// Delivers each streamed piece to every module whose plan reads its tensor, and remembers
/// which parameters were written so that a failure can name them.
class RoutingSink final : public TensorSink {
 public:
  struct Delivery {
    size_t module = 0;
    size_t read = 0;  ///< index into the module's plan.reads
  };

  RoutingSink(std::vector<ModuleRun>& modules, const std::vector<TensorRequest>& requests,
              const std::vector<std::vector<Delivery>>& routes)
      : modules_(modules), requests_(requests), routes_(routes) {}

  void consume(TensorPiece&& piece) override {
    const CheckpointTensor& tensor = *piece.tensor;
    TensorView view{.name = tensor.name,
                    .dtype = tensor.dtype,
                    .shape = tensor.shape,
                    .data = piece.bytes.data(),
                    .offset = requests_[piece.request].range.offset + piece.offset,
                    .bytes = piece.bytes.size()};
    for (const Delivery& delivery : routes_[piece.request]) {
      ModuleRun& module = modules_[delivery.module];
      module.session->load(view);
      std::lock_guard lock(mutex_);
      for (const auto& [parameter, part] : module.plan.reads[delivery.read].targets) {
        written_.emplace(delivery.module, parameter);
      }
    }
  }

  /// "target: a, b; draft (mtp): c", or empty when nothing was written. A session that
  /// commits whole layers has written only the parameters of the layers it completed: the
  /// pieces of the others were held, and are dropped with the session.
  std::string written_text() const {
    std::lock_guard lock(mutex_);
    std::vector<std::string> groups;
    for (size_t index = 0; index < modules_.size(); ++index) {
      const LoadSession& session = *modules_[index].session;
      const ModelLayout& layout = *modules_[index].request->layout;
      std::set<int64_t> completed;
      if (session.commit() == LayerCommit::kWholeLayer) {
        for (int64_t layer : session.completed_layers()) completed.insert(layer);
      }
      std::vector<std::string> names;
      for (const auto& [module, parameter] : written_) {
        if (module != index) continue;
        const Parameter& written = layout.parameters()[parameter];
        if (session.commit() == LayerCommit::kWholeLayer && completed.count(written.layer) == 0) continue;
        names.push_back(written.name);
      }
      if (!names.empty()) {
        groups.push_back(std::string(module_role_name(modules_[index].request->role)) + " (" +
                         std::to_string(names.size()) + "): " + join_limited(names, 10));
      }
    }
    return join(groups, "; ");
  }

 private:
  std::vector<ModuleRun>& modules_;
  const std::vector<TensorRequest>& requests_;
  const std::vector<std::vector<Delivery>>& routes_;
  mutable std::mutex mutex_;
  std::set<std::pair<size_t, size_t>> written_;
};

/// In a cold load every wanted tensor must be in the checkpoint: names each layer that lacks
/// some, before any byte is written.
void expect_complete(const ModuleRun& module, const Checkpoint& checkpoint, LoadMode mode) {
  if (mode != LoadMode::kCold || module.plan.missing.empty()) return;
  const ModelLayout& layout = *module.request->layout;
  std::map<int64_t, std::vector<std::string>> by_layer;
  for (const std::string& tensor : module.plan.missing) {
    TensorRoute route = layout.route(tensor);
    int64_t layer = route.targets.empty() ? -1 : layout.parameters()[route.targets.front().first].layer;
    by_layer[layer].push_back(tensor);
  }
  std::vector<std::string> groups;
  for (const auto& [layer, tensors] : by_layer) {
    groups.push_back(layer_label(layout, layer) + " is missing from " + checkpoint.uri() + " (" +
                     std::to_string(tensors.size()) + " tensors: " + join_limited(tensors, 5) + ")");
  }
  WS_FAIL(ErrorCode::kModel, "cold load of " + module.request->resolution.module_text() + " (" + layout.description() +
                                 "): " + join(groups, "; ") +
                                 "; a reload or update may leave layers out, a cold load may not");
}

/// The checkpoint of `context`: as resolution opened it, when it did; else opened, only the
/// shards holding wanted tensors when asked and the source has an index (all shards otherwise).
std::shared_ptr<const Checkpoint> open_checkpoint(const LoadContext& context) {
  if (context.checkpoint) return context.checkpoint;
  auto open_all = [&] { return std::make_shared<const Checkpoint>(Checkpoint::open(context.uri, context.options)); };
  if (!context.only_wanted_shards) return open_all();
  resolve::SourceListing listing = resolve::list_source(context.uri, context.options);
  if (!listing.index) return open_all();
  std::set<std::string, std::less<>> shards;
  for (const ModuleLoadRequest* module : context.modules) {
    for (const std::string& shard : resolve::wanted_shards(listing, *module->layout, context.options, nullptr)) {
      shards.insert(shard);
    }
  }
  WS_EXPECT(!shards.empty(), ErrorCode::kNotFound,
            "the index of " + context.uri + " names no shard holding a tensor of " + modules_text(context));
  return std::make_shared<const Checkpoint>(
      Checkpoint::open(std::make_shared<ShardSubsetStorage>(listing.storage, std::move(shards))));
}

/// The load both storage strategies run; they differ in which URIs they serve.
StrategyLoad load_from_storage(LoadContext& context, const std::string& strategy) {
  std::shared_ptr<const Checkpoint> opened = open_checkpoint(context);
  const Checkpoint& checkpoint = *opened;
  uint64_t shards_opened = opened == context.checkpoint ? 0 : checkpoint.shards().size();

  // Plan and check every module before any session begins: a failure here writes nothing.
  std::vector<ModuleRun> modules;
  for (ModuleLoadRequest* request : context.modules) {
    WS_EXPECT(request->layout != nullptr, ErrorCode::kInvalidArgument,
              "load of " + request->resolution.module_text() + ": no layout");
    ModuleRun module;
    module.request = request;
    module.plan = plan_layout_load(*request->layout, checkpoint);
    expect_complete(module, checkpoint, context.mode);
    modules.push_back(std::move(module));
  }

  // A checkpoint tensor read by one module is read as that module plans it (its rows, its
  // column window, its sections). One that several modules read is one request, whatever
  // their number: the union of their extents is read once and each module takes its bytes.
  std::map<size_t, std::set<size_t>> modules_of_tensor;
  for (size_t m = 0; m < modules.size(); ++m) {
    for (const PlannedTensor& read : modules[m].plan.reads) modules_of_tensor[read.tensor].insert(m);
  }
  std::vector<TensorRequest> requests;
  std::vector<std::vector<RoutingSink::Delivery>> routes;
  std::map<size_t, size_t> request_of_shared_tensor;
  for (size_t m = 0; m < modules.size(); ++m) {
    for (size_t r = 0; r < modules[m].plan.reads.size(); ++r) {
      const PlannedTensor& read = modules[m].plan.reads[r];
      if (modules_of_tensor[read.tensor].size() == 1) {
        requests.push_back(read.request());
        routes.push_back({{m, r}});
        continue;
      }
      const ByteRange extent = read.request().extent();
      auto [it, inserted] = request_of_shared_tensor.try_emplace(read.tensor, requests.size());
      if (inserted) {
        requests.push_back({read.tensor, extent});
        routes.emplace_back();
      } else {
        ByteRange& range = requests[it->second].range;
        uint64_t end = std::max(range.offset + range.length, extent.offset + extent.length);
        range.offset = std::min(range.offset, extent.offset);
        range.length = end - range.offset;
      }
      routes[it->second].push_back({m, r});
    }
  }

  for (ModuleRun& module : modules) {
    module.session = std::make_unique<LoadSession>(*module.request->layout);
    module.session->begin(context.mode);
  }
  RoutingSink sink(modules, requests, routes);
  StrategyLoad result;
  result.strategy = strategy;
  try {
    result.stream = stream_tensors(checkpoint, requests, sink, context.options.stream, context.progress);
    for (ModuleRun& module : modules) module.session->finish();
  } catch (const Error& error) {
    std::string written = sink.written_text();
    throw Error(error.code(), std::string(error.what()) +
                                  (written.empty() ? "; no parameter was written"
                                                   : "; parameters written before the failure, to reload: " + written));
  }

  for (ModuleRun& module : modules) {
    ModuleLoad load;
    load.role = module.request->role;
    load.source = context.uri;
    load.field = module.request->resolution.chosen().field;
    load.strategy = strategy;
    load.tensors = module.plan.reads.size();
    load.bytes_read = module.plan.bytes_to_read;
    std::set<uint32_t> shards;
    for (const PlannedTensor& read : module.plan.reads) shards.insert(checkpoint.tensors()[read.tensor].shard);
    load.shards_read = shards.size();
    load.shards_opened = shards_opened;
    load.counters = module.session->counters();
    result.modules.push_back(std::move(load));
  }
  return result;
}

class LocalFilesStrategy final : public LoadStrategy {
 public:
  std::string name() const override { return "local files"; }
  StrategyAvailability available(const LoadContext& context) const override {
    if (parse_uri(context.uri).scheme == Uri::Scheme::kFile) return {true, {}};
    return {false, context.uri + " is not a local path"};
  }
  StrategyLoad load(LoadContext& context) override { return load_from_storage(context, name()); }
};

class ObjectStorageStrategy final : public LoadStrategy {
 public:
  std::string name() const override { return "object storage"; }
  StrategyAvailability available(const LoadContext& context) const override {
    Uri::Scheme scheme = parse_uri(context.uri).scheme;
    if (scheme == Uri::Scheme::kS3 || scheme == Uri::Scheme::kGcs || scheme == Uri::Scheme::kAzure) return {true, {}};
    // open_storage refuses http(s) too; saying so here names the fix before any planning.
    if (scheme == Uri::Scheme::kHttp)
      return {false, context.uri + ": http(s) checkpoints are not supported yet; use s3:// with an endpoint "
                                   "(AWS_ENDPOINT_URL)"};
    return {false, context.uri + " is not an s3://, gs:// or az:// URI"};
  }
  StrategyLoad load(LoadContext& context) override { return load_from_storage(context, name()); }
};

}  // namespace

std::unique_ptr<LoadStrategy> make_local_files_strategy() { return std::make_unique<LocalFilesStrategy>(); }

std::unique_ptr<LoadStrategy> make_object_storage_strategy() { return std::make_unique<ObjectStorageStrategy>(); }

StrategyChain StrategyChain::standard() {
  StrategyChain chain;
  chain.add(make_local_files_strategy());
  chain.add(make_object_storage_strategy());
  return chain;
}

void StrategyChain::add(std::unique_ptr<LoadStrategy> strategy) {
  WS_EXPECT(strategy != nullptr, ErrorCode::kInvalidArgument, "StrategyChain::add: null strategy");
  strategies_.push_back(std::move(strategy));
}

void StrategyChain::insert_front(std::unique_ptr<LoadStrategy> strategy) {
  WS_EXPECT(strategy != nullptr, ErrorCode::kInvalidArgument, "StrategyChain::insert_front: null strategy");
  strategies_.insert(strategies_.begin(), std::move(strategy));
}

StrategyLoad StrategyChain::load(LoadContext& context) const {
  std::vector<std::string> tried;
  ErrorCode code = ErrorCode::kNotFound;
  for (const auto& strategy : strategies_) {
    StrategyAvailability availability;
    try {
      availability = strategy->available(context);
    } catch (const Error& error) {
      availability = {false, error.what()};
    }
    if (!availability.available) {
      tried.push_back(strategy->name() + ": " + availability.reason);
      continue;
    }
    try {
      return strategy->load(context);
    } catch (const Error& error) {
      // Kept, and the next strategy tried: the error names every cause, not the last one.
      tried.push_back(strategy->name() + ": " + error.what());
      code = error.code();
    }
  }
  std::vector<std::string> sources;
  for (const ModuleLoadRequest* module : context.modules) {
    std::vector<std::string> candidates;
    for (const SourceCandidate& candidate : module->resolution.candidates) candidates.push_back(candidate.text());
    sources.push_back("sources of " + module->resolution.module_text() + ": " + join(candidates, "; "));
  }
  if (strategies_.empty()) tried.push_back("no strategy configured");
  WS_FAIL(code, "Cannot load " + modules_text(context) + " from " + context.uri + ": " + join(sources, "; ") +
                    "; strategies: " + join(tried, "; "));
}

std::vector<StrategyLoad> load_modules(std::vector<ModuleLoadRequest>& modules, LoadMode mode, const Options& options,
                                       const StrategyChain& chain, const ProgressCallback& progress) {
  std::vector<SourceResolution> resolutions;
  for (const ModuleLoadRequest& module : modules) resolutions.push_back(module.resolution);
  expect_resolved(resolutions);
  // Modules that resolved to one source share one stream; others get one each, in order.
  std::vector<LoadContext> contexts;
  for (ModuleLoadRequest& module : modules) {
    const std::string& uri = module.resolution.chosen().uri;
    auto it = std::find_if(contexts.begin(), contexts.end(), [&](const LoadContext& c) { return c.uri == uri; });
    if (it == contexts.end()) {
      contexts.push_back({uri, {}, mode, options, progress, true, {}});
      it = std::prev(contexts.end());
    }
    it->modules.push_back(&module);
    if (module.role == ModuleRole::kTarget) it->only_wanted_shards = false;
    if (!it->checkpoint) it->checkpoint = module.resolution.chosen().checkpoint;
  }
  std::vector<StrategyLoad> loads;
  for (LoadContext& context : contexts) loads.push_back(chain.load(context));
  return loads;
}

}  // namespace weightstream
