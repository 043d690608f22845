#include <algorithm>
#include <filesystem>

#include "storage/azure_credentials.hpp"
#include "storage/gcs_client.hpp"
#include "weightstream/error.hpp"
#include "weightstream/storage.hpp"

namespace weightstream {
namespace {

// CONTAINER/PREFIX of an Azure URI whose account is already in `uri`.
void parse_azure_path(Uri& uri, std::string_view rest, std::string_view form) {
  auto slash = rest.find('/');
  uri.bucket = std::string(rest.substr(0, slash));
  uri.path = slash == std::string_view::npos ? std::string() : std::string(rest.substr(slash + 1));
  while (!uri.path.empty() && uri.path.back() == '/') uri.path.pop_back();
  WS_EXPECT(!uri.account.empty(), ErrorCode::kInvalidArgument,
            "'" + uri.text + "': Azure URI without an account (expected " + std::string(form) + ")");
  WS_EXPECT(azure::valid_account_name(uri.account), ErrorCode::kInvalidArgument,
            "'" + uri.text + "': storage account name '" + uri.account +
                "' is not valid (3-24 characters: a-z, 0-9)");
  WS_EXPECT(!uri.bucket.empty(), ErrorCode::kInvalidArgument,
            "'" + uri.text + "': Azure URI without a container (expected " + std::string(form) + ")");
  WS_EXPECT(azure::valid_container_name(uri.bucket), ErrorCode::kInvalidArgument,
            "'" + uri.text + "': container name '" + uri.bucket +
                "' is not valid (3-63 characters: a-z, 0-9, '-'; starting and ending with a letter or digit, no '--')");
}

}  // namespace

Uri parse_uri(std::string_view text) {
  WS_EXPECT(!text.empty(), ErrorCode::kInvalidArgument, "empty checkpoint URI: give a path, file://PATH, s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or az://ACCOUNT/CONTAINER/PREFIX");
  WS_EXPECT(text.find('\0') == std::string_view::npos, ErrorCode::kInvalidArgument, "checkpoint URI contains a NUL byte");
  Uri uri;
  uri.text = std::string(text);
  auto scheme_end = text.find("://");
  if (scheme_end == std::string_view::npos) {
    uri.scheme = Uri::Scheme::kFile;
    uri.path = std::string(text);
    return uri;
  }
  std::string scheme(text.substr(0, scheme_end));
  std::transform(scheme.begin(), scheme.end(), scheme.begin(), [](unsigned char c) { return std::tolower(c); });
  auto rest = text.substr(scheme_end + 3);
  if (scheme == "file") {
    // file:///abs/path or file://localhost/abs/path; a relative file://dir is accepted too.
    if (rest.starts_with("localhost/")) rest.remove_prefix(9);
    WS_EXPECT(!rest.empty(), ErrorCode::kInvalidArgument, "'" + uri.text + "': file:// URI without a path");
    uri.scheme = Uri::Scheme::kFile;
    uri.path = std::string(rest);
    return uri;
  }
  if (scheme == "s3") {
    auto slash = rest.find('/');
    uri.scheme = Uri::Scheme::kS3;
    uri.bucket = std::string(rest.substr(0, slash));
    uri.path = slash == std::string_view::npos ? std::string() : std::string(rest.substr(slash + 1));
    while (!uri.path.empty() && uri.path.back() == '/') uri.path.pop_back();
    WS_EXPECT(!uri.bucket.empty(), ErrorCode::kInvalidArgument, "'" + uri.text + "': s3:// URI without a bucket (expected s3://BUCKET/PREFIX)");
    // Bucket naming rules: 3-63 characters of lowercase letters, digits, '.', '-'.
    bool valid = uri.bucket.size() >= 3 && uri.bucket.size() <= 63 &&
                 std::all_of(uri.bucket.begin(), uri.bucket.end(), [](char c) {
                   return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '-';
                 });
    WS_EXPECT(valid, ErrorCode::kInvalidArgument,
              "'" + uri.text + "': bucket name '" + uri.bucket + "' is not valid (3-63 characters: a-z, 0-9, '.', '-')");
    return uri;
  }
  if (scheme == "gs") {
    auto slash = rest.find('/');
    uri.scheme = Uri::Scheme::kGcs;
    uri.bucket = std::string(rest.substr(0, slash));
    uri.path = slash == std::string_view::npos ? std::string() : std::string(rest.substr(slash + 1));
    while (!uri.path.empty() && uri.path.back() == '/') uri.path.pop_back();
    WS_EXPECT(!uri.bucket.empty(), ErrorCode::kInvalidArgument,
              "'" + uri.text + "': gs:// URI without a bucket (expected gs://BUCKET/PREFIX)");
    WS_EXPECT(gcs::valid_bucket_name(uri.bucket), ErrorCode::kInvalidArgument,
              "'" + uri.text + "': bucket name '" + uri.bucket +
                  "' is not valid (3-63 characters: a-z, 0-9, '-', '_', '.'; starting and ending with a letter or digit)");
    return uri;
  }
  if (scheme == "az") {
    // az://ACCOUNT/CONTAINER/PREFIX, as adlfs and the Run:ai streamer name Blob paths.
    auto slash = rest.find('/');
    uri.scheme = Uri::Scheme::kAzure;
    uri.account = std::string(rest.substr(0, slash));
    parse_azure_path(uri, slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1),
                     "az://ACCOUNT/CONTAINER/PREFIX");
    return uri;
  }
  if (scheme == "http" || scheme == "https") {
    // https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX is Azure Blob Storage.
    auto slash = rest.find('/');
    std::string host(rest.substr(0, slash));
    std::transform(host.begin(), host.end(), host.begin(), [](unsigned char c) { return std::tolower(c); });
    if (const auto dot = host.find(".blob."); dot != std::string::npos && host.ends_with(".blob.core.windows.net")) {
      // A SAS URL pasted whole would put its signature into every message that names the URI.
      WS_EXPECT(rest.find_first_of("?#") == std::string_view::npos, ErrorCode::kInvalidArgument,
                "'" + scheme + "://" + host + "/…': an Azure Blob URL with a query; give the SAS token in "
                "AZURE_STORAGE_SAS_TOKEN and the URL without it");
      uri.scheme = Uri::Scheme::kAzure;
      uri.account = host.substr(0, dot);
      uri.endpoint = scheme + "://" + host;
      parse_azure_path(uri, slash == std::string_view::npos ? std::string_view() : rest.substr(slash + 1),
                       "https://ACCOUNT.blob.core.windows.net/CONTAINER/PREFIX");
      return uri;
    }
    uri.scheme = Uri::Scheme::kHttp;
    uri.path = uri.text;
    return uri;
  }
  WS_FAIL(ErrorCode::kInvalidArgument, "'" + uri.text + "': unsupported scheme '" + scheme + "://' (supported: file://, s3://, gs://, az://, plain paths)");
}

std::unique_ptr<Storage> open_storage(const Uri& uri, const Options& options, std::string* object) {
  if (object) object->clear();
  switch (uri.scheme) {
    case Uri::Scheme::kFile: {
      std::error_code error;
      std::filesystem::path path(uri.path);
      auto status = std::filesystem::status(path, error);
      WS_EXPECT(std::filesystem::exists(status), ErrorCode::kNotFound,
                "checkpoint '" + uri.text + "' does not exist (expected a .safetensors file or a directory of them)");
      if (std::filesystem::is_directory(status)) return open_local_storage(uri.path, options.stream.local_io);
      auto parent = path.parent_path();
      if (object) *object = path.filename().string();
      return open_local_storage(parent.empty() ? std::string(".") : parent.string(), options.stream.local_io);
    }
    case Uri::Scheme::kS3: {
      // A key that ends in .safetensors names one object; anything else is a prefix.
      if (uri.path.ends_with(".safetensors")) {
        auto slash = uri.path.rfind('/');
        if (object) *object = slash == std::string::npos ? uri.path : uri.path.substr(slash + 1);
        return open_s3_storage(uri.bucket, slash == std::string::npos ? std::string() : uri.path.substr(0, slash), options.s3);
      }
      return open_s3_storage(uri.bucket, uri.path, options.s3);
    }
    case Uri::Scheme::kGcs: {
      if (uri.path.ends_with(".safetensors")) {
        auto slash = uri.path.rfind('/');
        if (object) *object = slash == std::string::npos ? uri.path : uri.path.substr(slash + 1);
        return open_gcs_storage(uri.bucket, slash == std::string::npos ? std::string() : uri.path.substr(0, slash), options);
      }
      return open_gcs_storage(uri.bucket, uri.path, options);
    }
    case Uri::Scheme::kAzure: {
      if (uri.path.ends_with(".safetensors")) {
        auto slash = uri.path.rfind('/');
        if (object) *object = slash == std::string::npos ? uri.path : uri.path.substr(slash + 1);
        return open_azure_storage(uri.account, uri.bucket, slash == std::string::npos ? std::string() : uri.path.substr(0, slash),
                                  options, uri.endpoint);
      }
      return open_azure_storage(uri.account, uri.bucket, uri.path, options, uri.endpoint);
    }
    case Uri::Scheme::kHttp:
      WS_FAIL(ErrorCode::kUnsupported, "'" + uri.text + "': http(s) checkpoints are not supported yet; use s3://, gs:// or az://");
  }
  WS_FAIL(ErrorCode::kInternal, "unhandled URI scheme");
}

std::string read_object(Storage& storage, std::string_view name, uint64_t max_bytes) {
  auto info = storage.stat(name);
  WS_EXPECT(info.size <= max_bytes, ErrorCode::kFormat,
            storage.object_uri(name) + ": " + std::to_string(info.size) + " bytes is larger than the " +
                std::to_string(max_bytes) + " bytes allowed for this file");
  std::string text(info.size, '\0');
  storage.read(name, 0, std::as_writable_bytes(std::span(text.data(), text.size())));
  return text;
}

}  // namespace weightstream
