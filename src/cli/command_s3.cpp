// weightstream s3 presign s3://BUCKET/KEY [--expires SECONDS] [--region R] [--date YYYYMMDDTHHMMSSZ]
#include <iostream>

#include "cli/command.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream::cli {

namespace {
struct PresignFlags {
  std::string uri;
  uint64_t expires = 3600;
  std::string region;
  std::string endpoint;
  std::string date;
};
}  // namespace

void add_s3_command(CLI::App& app) {
  auto* s3 = app.add_subcommand("s3", "S3 helpers (credentials and endpoint from AWS_* variables)");
  s3->require_subcommand(1);

  auto flags = std::make_shared<PresignFlags>();
  auto* presign = s3->add_subcommand("presign", "Print a presigned GET URL (SigV4 query authentication) for one object");
  presign->add_option("uri", flags->uri, "Object: s3://BUCKET/KEY")->required();
  presign->add_option("--expires", flags->expires, "Seconds the URL stays valid, 1 to 604800 (default 3600)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{604800}));
  presign->add_option("--region", flags->region, "Region to sign for (default AWS_REGION, else us-east-1)");
  presign->add_option("--endpoint", flags->endpoint, "Endpoint URL (default AWS_ENDPOINT_URL_S3, else AWS)");
  presign->add_option("--date", flags->date,
                      "Signing time YYYYMMDDTHHMMSSZ (default now); fixing it makes the URL reproducible");
  presign->callback([flags] {
    auto uri = parse_uri(flags->uri);
    WS_EXPECT(uri.scheme == Uri::Scheme::kS3 && !uri.path.empty() && !uri.path.ends_with('/'),
              ErrorCode::kInvalidArgument, "'" + flags->uri + "': expected an object URI, s3://BUCKET/KEY");
    S3Options options = environment_options().s3;
    if (!flags->region.empty()) options.region = flags->region;
    if (!flags->endpoint.empty()) options.endpoint = flags->endpoint;
    std::cout << presign_s3_url(uri.bucket, uri.path, options, flags->expires, flags->date) << "\n";
  });
}

}  // namespace weightstream::cli
