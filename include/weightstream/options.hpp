#pragma once
/// @file options.hpp
/// Every tunable of weightstream, as small structs with documented defaults. Each field's
/// comment names the environment variable that sets it; options_from_environment() (in
/// src/base/environment.cpp, the only place that reads the environment) fills them, and
/// command-line flags and API arguments override them afterwards.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace weightstream {

inline constexpr uint64_t kKiB = 1024;
inline constexpr uint64_t kMiB = 1024 * kKiB;
inline constexpr uint64_t kGiB = 1024 * kMiB;

/// Smallest staging memory limit and largest-read size: one page, the size of the smallest
/// staging buffer (StreamOptions::memory_limit, StreamOptions::chunk_bytes).
inline constexpr uint64_t kMinStagingBytes = 4 * kKiB;

/// How local files are read.
enum class LocalIo {
  /// The default: a host load (load_checkpoint onto the CPU) takes the tensors of local
  /// shards in place, as kMmap does (copy-on-write views of the page cache, no fresh page to
  /// zero), and every other read is kPread's (streams, digests, layout loads; a GPU load
  /// chooses its own shape, GpuPath::kAuto).
  kAuto,
  kPread,   ///< buffered pread(2) through the page cache; a host load copies every tensor
  kDirect,  ///< O_DIRECT with aligned buffers, bypassing the page cache
  kUring,   ///< io_uring (liburing) submissions of buffered reads
  /// Streams copy out of a read-only mapping of the file (page cache, no read(2) per chunk).
  /// A host load (load_checkpoint onto the CPU) takes its tensors in place instead: they
  /// are copy-on-write views of the page cache (a private mapping of each shard, near-instant
  /// when the cache is warm; a write copies only the pages written and never reaches the
  /// file). A shard rewritten in place (truncated or overwritten, e.g. save_file over the
  /// same path) while those tensors live changes them or makes touching them raise SIGBUS:
  /// write a new checkpoint to a new file and rename it over the old one.
  kMmap,
};

/// How bytes reach a CUDA device.
enum class GpuPath {
  kAuto,    ///< kStaged; for local shards the page cache holds, in its warm shape (at most 10 readers,
            ///< 4 MiB reads out of a mapping, 160 MiB of staging), the faster shape there
            ///< (bench/RESULTS.md, "GPU load")
  kStaged,  ///< read into pinned staging buffers, async copies to the device
  kMapped,  ///< mmap local files, register windows with CUDA (read-only), the copy engine reads them
  kBoth,    ///< staged and mapped at once on disjoint tensors (StreamOptions::mapped_share of the bytes mapped)
};

/// Options of the stream layer (planning, reader pool, staging pool).
struct StreamOptions {
  /// Reads in flight at once. WEIGHTSTREAM_CONCURRENCY.
  unsigned concurrency = 16;
  /// Hard cap on staging memory in bytes, at least kMinStagingBytes.
  /// WEIGHTSTREAM_MEMORY_LIMIT (e.g. "1GiB").
  uint64_t memory_limit = 1 * kGiB;
  /// Largest single read in bytes, at least kMinStagingBytes; large tensors are split into
  /// reads of this size, neighbouring small ones merged up to it. WEIGHTSTREAM_CHUNK_SIZE.
  uint64_t chunk_bytes = 16 * kMiB;
  /// How local files are read. WEIGHTSTREAM_LOCAL_IO = auto | pread | direct | uring | mmap.
  LocalIo local_io = LocalIo::kAuto;
  /// How bytes reach a CUDA device. WEIGHTSTREAM_GPU_PATH = auto | staged | mapped | both.
  GpuPath gpu_path = GpuPath::kAuto;
  /// With GpuPath::kBoth: the fraction of the bytes the mapped source carries, the rest
  /// staged. WEIGHTSTREAM_MAPPED_SHARE, a number from 0 to 1.
  double mapped_share = 0.4;
  /// Threads that map the pages of reads ahead of the readers and drop them behind, when
  /// local files are read through a mapping (--io mmap, and the warm GPU shape): the
  /// page-table work then runs beside the readers' copies instead of inside them. Unset: 3
  /// where the readers leave that many hardware threads free (plus two), else none; 0: none
  /// (each reader maps its own pages). WEIGHTSTREAM_PREFETCHERS.
  std::optional<unsigned> prefetchers;
  /// Print progress on stderr even when it is not a terminal.
  /// WEIGHTSTREAM_PROGRESS = 1|true|yes|on or 0|false|no|off.
  bool progress = false;
};

/// How S3 requests address a bucket.
enum class S3Addressing {
  kAuto,     ///< path-style for custom endpoints, virtual-hosted for AWS
  kPath,     ///< https://endpoint/bucket/key
  kVirtual,  ///< https://bucket.endpoint/key
};

/// How UCX moves the bulk bytes of peer pulls and `ucx` updates on an endpoint.
enum class UcxPath {
  /// The default: one-sided get/put where the endpoint's lanes carry RMA natively (rc, dc,
  /// cuda_ipc, shared memory, cma), rendezvous messages where they do not (UCX's tcp
  /// transport, which emulates gets and puts with active messages at about half the rate
  /// of its tagged rendezvous).
  kAuto,
  kRma,         ///< always one-sided ucp_get_nbx / ucp_put_nbx
  kRendezvous,  ///< always messages: tagged sends for pulls, active messages for updates
};

/// Options of the S3 backend. Credentials are never logged or printed.
struct S3Options {
  /// Endpoint URL such as http://127.0.0.1:9000. AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL.
  std::string endpoint;
  /// Region used for signing. AWS_REGION, then AWS_DEFAULT_REGION; default us-east-1.
  std::string region;
  /// Static credentials. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN.
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;
  /// Shared credentials file. AWS_SHARED_CREDENTIALS_FILE; default ~/.aws/credentials.
  std::string credentials_file;
  /// Profile in the shared credentials file. AWS_PROFILE; default "default".
  std::string profile;
  /// CA bundle for TLS verification. AWS_CA_BUNDLE.
  std::string ca_bundle;
  /// Bucket addressing. WEIGHTSTREAM_S3_ADDRESSING = auto | path | virtual.
  S3Addressing addressing = S3Addressing::kAuto;
  /// Send unsigned requests (public buckets).
  /// WEIGHTSTREAM_S3_UNSIGNED = 1|true|yes|on or 0|false|no|off.
  bool unsigned_requests = false;
  /// Verify TLS certificates. Only an explicit option turns this off, with a warning.
  bool verify_tls = true;
  /// Connections in flight. WEIGHTSTREAM_S3_CONNECTIONS.
  unsigned max_connections = 32;
  /// Bytes per ranged GET. WEIGHTSTREAM_S3_REQUEST_SIZE.
  uint64_t request_bytes = 16 * kMiB;
  /// Attempts per request, first one included. WEIGHTSTREAM_S3_MAX_ATTEMPTS.
  unsigned max_attempts = 5;
  /// Deadline for one request across all its attempts, seconds. WEIGHTSTREAM_S3_DEADLINE.
  /// Every time variable takes a duration: "300", "300s", "5m", "500ms" (parse_duration).
  double deadline_seconds = 300;
  /// Stall timeout: once a response has begun, a transfer with no byte moving for this long
  /// fails. WEIGHTSTREAM_S3_TIMEOUT.
  double timeout_seconds = 30;
  /// Connect timeout: a TCP (and TLS) connection not established within this long fails.
  /// WEIGHTSTREAM_S3_CONNECT_TIMEOUT.
  double connect_timeout_seconds = 3;
  /// First-byte timeout: an attempt whose request was sent but which has no byte of a
  /// response this long after fails. Two such attempts in a row (or two failed connects) end
  /// the request there: the endpoint is treated as dead rather than waited on for every
  /// attempt, so with the defaults a dead endpoint fails within about 8 s.
  /// WEIGHTSTREAM_S3_FIRST_BYTE_TIMEOUT.
  double first_byte_timeout_seconds = 3;
  /// First retry's backoff ceiling in seconds; it doubles per attempt (capped at 10 s) and the
  /// actual sleep is drawn uniformly below it ("full jitter"). WEIGHTSTREAM_S3_RETRY_BASE.
  double retry_base_seconds = 0.1;
};

/// Options of the Google Cloud Storage backend (gs://), found as Google's client libraries
/// find them. Reads run under the transfer fields of S3Options (connections, request size,
/// attempts, deadline, timeouts): one set of WEIGHTSTREAM_S3_* settings for every object
/// store. Credentials and tokens are never logged or printed.
struct GcsOptions {
  /// An emulator such as fake-gcs-server: "host:port" or "http://host:port"; requests go
  /// there without credentials. STORAGE_EMULATOR_HOST.
  std::string emulator_host;
  /// A service-account key file (JSON) whose key signs the token requests.
  /// GOOGLE_APPLICATION_CREDENTIALS.
  std::string credentials_file;
  /// Host (and port) of the metadata server that hands out tokens when no key file is set.
  /// GCE_METADATA_HOST; default metadata.google.internal.
  std::string metadata_host = "metadata.google.internal";
  /// Send requests without credentials (public buckets), as google-cloud-cpp's
  /// MakeInsecureCredentials() does. WEIGHTSTREAM_GCS_ANONYMOUS = 1|true|yes|on or 0|false|no|off.
  bool anonymous = false;
  /// The JSON API's endpoint; an emulator replaces it. Not read from the environment.
  std::string endpoint = "https://storage.googleapis.com";
};

/// Options of the Azure Blob Storage backend (az://account/container/prefix and
/// https://ACCOUNT.blob.core.windows.net/container/prefix), found as Azure's tools find them:
/// a connection string first, then an account key, then a SAS token, then (unless anonymous)
/// the managed identity of the machine. Reads run under the transfer fields of S3Options, as
/// every object store's do. Keys, SAS tokens and access tokens are never logged or printed.
struct AzureOptions {
  /// "AccountName=…;AccountKey=…" and the other forms of Azure's connection strings
  /// (BlobEndpoint= for an emulator, SharedAccessSignature=, UseDevelopmentStorage=true).
  /// AZURE_STORAGE_CONNECTION_STRING. A secret.
  std::string connection_string;
  /// The storage account the key or SAS token belongs to. AZURE_STORAGE_ACCOUNT; a URI that
  /// names another account is refused rather than signed with the wrong key.
  std::string account;
  /// The account's access key (base64), signing requests with Shared Key. AZURE_STORAGE_KEY. A secret.
  std::string account_key;
  /// A SAS token ("sv=…&sig=…", with or without the leading '?'). AZURE_STORAGE_SAS_TOKEN. A secret.
  std::string sas_token;
  /// App Service's managed identity endpoint and its header secret. IDENTITY_ENDPOINT,
  /// IDENTITY_HEADER; both set, they are used instead of IMDS.
  std::string identity_endpoint;
  std::string identity_header;
  /// The instance metadata service handing out managed-identity tokens.
  /// AZURE_POD_IDENTITY_AUTHORITY_HOST (as azure-identity reads it); default http://169.254.169.254.
  std::string imds_host = "http://169.254.169.254";
  /// Client id of a user-assigned managed identity. AZURE_CLIENT_ID; empty: the system-assigned one.
  std::string client_id;
  /// Send requests without credentials (public containers).
  /// WEIGHTSTREAM_AZURE_ANONYMOUS = 1|true|yes|on or 0|false|no|off.
  bool anonymous = false;
};

/// How messages name Options::model_uri when the caller set it rather than the environment.
inline constexpr std::string_view kModelUriOption = "model_uri option";

/// Every option of the library, as read from the environment.
struct Options {
  StreamOptions stream;
  S3Options s3;
  GcsOptions gcs;
  AzureOptions azure;
  /// Checkpoint URI used when a model's own sources hold no weights.
  /// WEIGHTSTREAM_MODEL_URI (MX_MODEL_URI accepted as an alias; the two must agree).
  std::string model_uri;
  /// Where model_uri came from, as messages and reports name it: the variable that set it
  /// ("WEIGHTSTREAM_MODEL_URI" or "MX_MODEL_URI"), or kModelUriOption when the caller did.
  std::string model_uri_origin = std::string(kModelUriOption);
  /// Directory of temporary files and of the update receivers' fresh Unix sockets. TMPDIR;
  /// default /tmp.
  std::string temporary_directory = "/tmp";
  /// Token presented to serving peers (peer://) and required of pullers by a server, where
  /// no other is given (`--token-stdin`, the vLLM key `peer_token`). WEIGHTSTREAM_PEER_TOKEN;
  /// default empty: a server then refuses to start, and a puller is served only by an open
  /// server (an empty token never means "no authentication"). Never logged.
  std::string peer_token;
  /// Test hook of peer pulls: the pulling process stops itself (SIGSTOP) once this many
  /// bytes from peers have landed, before it reads the next serving parameter, so a test
  /// can kill a server mid-pull without timing. WEIGHTSTREAM_TEST_PULL_STOP_AFTER (bytes);
  /// default 0, off.
  uint64_t test_pull_stop_after = 0;
  /// How UCX moves bulk bytes on each endpoint of a pull or a `ucx` update sender.
  /// WEIGHTSTREAM_UCX_PATH: auto, rma or rendezvous; default auto.
  UcxPath ucx_path = UcxPath::kAuto;
};

/// A snapshot of environment variables (name to value).
using Environment = std::map<std::string, std::string, std::less<>>;

/// The current process environment.
Environment process_environment();

/// Reads and validates every WEIGHTSTREAM_* (and the AWS_*) variable of `environment`.
/// An unknown WEIGHTSTREAM_* name, a malformed value, or aliases that disagree throw
/// Error(kConfig) naming the variable.
Options options_from_environment(const Environment& environment);

/// The directory TMPDIR names in `environment`, or /tmp when it is unset or empty (what
/// options_from_environment() puts in Options::temporary_directory).
std::string temporary_directory(const Environment& environment);

/// Parses a byte size such as "64MiB", "2GiB", "1.5GB", "4096" or "512k".
/// Throws Error(kInvalidArgument) naming `what` on a malformed or overflowing value.
uint64_t parse_size(std::string_view text, std::string_view what = "size");

/// Formats a byte count for people, e.g. "1.50 GiB".
std::string format_size(uint64_t bytes);

/// Parses a duration in seconds: a positive number with an optional unit, "ms", "s", "m"
/// (minutes) or "h", e.g. "500ms", "1s", "2m", "1.5" (seconds). Throws
/// Error(kInvalidArgument) naming `what` on anything else.
double parse_duration(std::string_view text, std::string_view what = "duration");

/// Parses "pread", "direct", "uring" or "mmap". Throws Error(kInvalidArgument) naming `what`.
LocalIo parse_local_io(std::string_view text, std::string_view what = "io");
/// "pread", "direct", "uring" or "mmap".
std::string_view local_io_name(LocalIo io) noexcept;
/// Parses "auto", "staged", "mapped" or "both". Throws Error(kInvalidArgument) naming `what`.
GpuPath parse_gpu_path(std::string_view text, std::string_view what = "gpu_path");
/// "auto", "staged", "mapped" or "both".
std::string_view gpu_path_name(GpuPath path) noexcept;
/// Parses "auto", "rma" or "rendezvous". Throws Error(kInvalidArgument) naming `what`.
UcxPath parse_ucx_path(std::string_view text, std::string_view what = "ucx_path");
/// "auto", "rma" or "rendezvous".
std::string_view ucx_path_name(UcxPath path) noexcept;
/// Parses a fraction from 0 to 1 (StreamOptions::mapped_share). Throws
/// Error(kInvalidArgument) naming `what`.
double parse_share(std::string_view text, std::string_view what = "mapped_share");

/// How check_stream_options names the fields in its messages (a flag, a variable, a keyword).
struct StreamOptionNames {
  std::string_view concurrency = "concurrency";
  std::string_view memory_limit = "memory_limit";
  std::string_view chunk_bytes = "chunk_bytes";
};

/// Checks the limits of `options`: concurrency at least 1, memory_limit and chunk_bytes at
/// least kMinStagingBytes. Throws Error(kInvalidArgument) naming the field as `names` say.
/// stream_tensors calls it; the environment, the CLI and the Python bindings call it so
/// that each names its own spelling of the field.
void check_stream_options(const StreamOptions& options, const StreamOptionNames& names = {});

}  // namespace weightstream
