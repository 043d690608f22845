// Digests of tensors computed over the bytes as streamed.
#include <openssl/evp.h>
#include <xxhash.h>

#include <cstdio>

#include "weightstream/error.hpp"
#include "weightstream/stream.hpp"

namespace weightstream {

struct Hasher::State {
  HashKind kind;
  EVP_MD_CTX* sha = nullptr;
  XXH64_state_t* xxh = nullptr;
  ~State() {
    if (sha) EVP_MD_CTX_free(sha);
    if (xxh) XXH64_freeState(xxh);
  }
};

Hasher::Hasher(HashKind kind) : state_(std::make_unique<State>()) {
  state_->kind = kind;
  if (kind == HashKind::kSha256) {
    state_->sha = EVP_MD_CTX_new();
    WS_EXPECT(state_->sha && EVP_DigestInit_ex(state_->sha, EVP_sha256(), nullptr) == 1, ErrorCode::kInternal,
              "cannot initialize SHA-256 (OpenSSL)");
  } else {
    state_->xxh = XXH64_createState();
    WS_EXPECT(state_->xxh && XXH64_reset(state_->xxh, 0) == XXH_OK, ErrorCode::kInternal, "cannot initialize XXH64");
  }
}

Hasher::Hasher(Hasher&&) noexcept = default;
Hasher& Hasher::operator=(Hasher&&) noexcept = default;
Hasher::~Hasher() = default;

void Hasher::update(std::span<const std::byte> bytes) {
  if (bytes.empty()) return;
  if (state_->kind == HashKind::kSha256) {
    WS_EXPECT(EVP_DigestUpdate(state_->sha, bytes.data(), bytes.size()) == 1, ErrorCode::kInternal, "SHA-256 update failed");
  } else {
    WS_EXPECT(XXH64_update(state_->xxh, bytes.data(), bytes.size()) == XXH_OK, ErrorCode::kInternal, "XXH64 update failed");
  }
}

std::string Hasher::finish() {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned length = 0;
  if (state_->kind == HashKind::kSha256) {
    WS_EXPECT(EVP_DigestFinal_ex(state_->sha, digest, &length) == 1, ErrorCode::kInternal, "SHA-256 final failed");
  } else {
    XXH64_canonical_t canonical;
    XXH64_canonicalFromHash(&canonical, XXH64_digest(state_->xxh));
    length = sizeof(canonical.digest);
    std::copy(std::begin(canonical.digest), std::end(canonical.digest), digest);
  }
  std::string hex(length * 2, '0');
  for (unsigned i = 0; i < length; ++i) std::snprintf(&hex[i * 2], 3, "%02x", digest[i]);
  return hex;
}

std::string_view hash_name(HashKind kind) noexcept { return kind == HashKind::kSha256 ? "sha256" : "xxh64"; }

HashKind parse_hash(std::string_view text) {
  if (text == "sha256") return HashKind::kSha256;
  if (text == "xxh64") return HashKind::kXxh64;
  WS_FAIL(ErrorCode::kInvalidArgument, "unknown hash '" + std::string(text) + "' (expected sha256 or xxh64)");
}

namespace {

/// Hashes pieces in order, as they arrive from the reader pool.
class DigestSink final : public TensorSink {
 public:
  DigestSink(size_t requests, HashKind kind) {
    hashers_.reserve(requests);
    for (size_t i = 0; i < requests; ++i) hashers_.emplace_back(kind);
    digests_.resize(requests);
  }
  bool wants_ordered_pieces() const override { return true; }
  void consume(TensorPiece&& piece) override { hashers_[piece.request].update(piece.bytes); }
  void request_complete(size_t request) override { digests_[request] = hashers_[request].finish(); }
  std::vector<std::string>& digests() { return digests_; }

 private:
  std::vector<Hasher> hashers_;
  std::vector<std::string> digests_;
};

}  // namespace

std::vector<TensorDigest> digest_streamed(const Checkpoint& checkpoint, HashKind kind, const StreamOptions& options,
                                          StreamStats* stats, const ProgressCallback& progress) {
  auto requests = all_tensors(checkpoint);
  DigestSink sink(requests.size(), kind);
  auto result = stream_tensors(checkpoint, requests, sink, options, progress);
  if (stats) *stats = result;
  std::vector<TensorDigest> digests;
  digests.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) digests.push_back({checkpoint.tensors()[i].name, std::move(sink.digests()[i])});
  return digests;
}

}  // namespace weightstream
