// weightstream s3 presign s3://BUCKET/KEY [--expires DURATION] [--region R] [--date YYYYMMDDTHHMMSSZ]
#include <cmath>
#include <iostream>

#include "cli/command.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream::cli {

namespace {
struct PresignFlags {
  std::string uri;
  std::string expires = "3600";
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
  presign->add_option("--expires", flags->expires,
                      "How long the URL stays valid: a duration such as 3600, 90s, 15m or 2h; whole seconds, "
                      "1 s to 7 days (default 1h)");
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
    const double seconds = parse_duration(flags->expires, "--expires");
    WS_EXPECT(seconds == std::floor(seconds) && seconds >= 1 && seconds <= 604800, ErrorCode::kInvalidArgument,
              "--expires='" + flags->expires + "': expected whole seconds from 1 s to 7 days (604800 s), as S3 allows");
    std::cout << presign_s3_url(uri.bucket, uri.path, options, static_cast<uint64_t>(seconds), flags->date) << "\n";
  });
}

}  // namespace weightstream::cli
