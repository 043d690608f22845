// weightstream digest URI [--hash sha256|xxh64] [--device cpu|cuda:N] [--json]
// One line per tensor, then the checkpoint's content digest (the one `serve` publishes and
// --expect-digest takes), computed from the same pass over the bytes.
#include <cstdio>

#include "cli/command.hpp"
#include "weightstream/load.hpp"

namespace weightstream::cli {

namespace {
struct DigestFlags {
  std::string uri;
  std::string hash = "sha256";
  std::string device = "cpu";
  bool json = false;
  bool summary = false;
  StreamFlags stream;
};
}  // namespace

void add_digest_command(CLI::App& app) {
  auto flags = std::make_shared<DigestFlags>();
  auto* command = app.add_subcommand(
      "digest",
      "Hash every tensor's bytes as they are streamed (one line per tensor), then print the checkpoint's content "
      "digest: xxh64 over every tensor's name, dtype, shape and xxh64, what `serve` publishes and --expect-digest takes");
  command->add_option("uri", flags->uri, "Checkpoint: a .safetensors file, a directory, file://, s3://, gs:// or az://")->required();
  command->add_option("--hash", flags->hash, "sha256 or xxh64 (default sha256)")->check(CLI::IsMember({"sha256", "xxh64"}));
  command->add_option("--device", flags->device, "Land the bytes on cpu or cuda:N and hash them from there");
  command->add_flag("--json", flags->json,
                    "One JSON object per line: {\"name\": ..., \"sha256\": ...}, and last {\"content_digest\": ...}");
  command->add_flag("--summary", flags->summary, "Also print the throughput summary on stderr");
  add_stream_flags(*command, flags->stream);
  command->callback([flags] {
    auto options = resolve_options(flags->stream);
    auto device = parse_device(flags->device);
    auto kind = parse_hash(flags->hash);
    auto checkpoint = Checkpoint::open(flags->uri, options);
    StreamStats stats;
    // The content digest needs every tensor's xxh64: a sha256 digest computes both in its one pass.
    std::vector<HashKind> kinds{kind};
    if (kind != HashKind::kXxh64) kinds.push_back(HashKind::kXxh64);
    std::vector<std::vector<TensorDigest>> computed;
    {
      ProgressLine progress(progress_enabled(flags->stream, options));
      computed = digest_checkpoint(checkpoint, kinds, device, options.stream, &stats,
                                   [&progress](uint64_t done, uint64_t total) { progress.update(done, total); });
    }
    const std::vector<TensorDigest>& digests = computed.front();
    const std::string content = content_digest(checkpoint, computed.back());
    auto key = std::string(hash_name(kind));
    for (const auto& digest : digests) {
      if (flags->json) {
        std::printf("%s\n", nlohmann::json({{"name", digest.name}, {key, digest.hex}}).dump().c_str());
      } else {
        std::printf("%s  %s\n", digest.hex.c_str(), digest.name.c_str());
      }
    }
    if (flags->json) {
      std::printf("%s\n", nlohmann::json({{"content_digest", content},
                                          {"of", "xxh64 over every tensor's name, dtype, shape and xxh64, in name order"}})
                               .dump()
                               .c_str());
    } else {
      std::printf("content digest %s (xxh64 over every tensor's name, dtype, shape and xxh64, in name order)\n",
                  content.c_str());
    }
    if (flags->summary) {
      std::fflush(stdout);
      std::fprintf(stderr, "%s\n", stats_json(stat_fields(stats)).dump().c_str());
    }
  });
}

}  // namespace weightstream::cli
