// Digests of tensors computed over the bytes as streamed.
#include <openssl/evp.h>
#include <xxhash.h>

#include <algorithm>
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

/// Hashes pieces in order, as they arrive from the reader pool, with every kind at once.
class DigestSink final : public TensorSink {
 public:
  DigestSink(size_t requests, const std::vector<HashKind>& kinds) : hashers_(requests) {
    for (auto& per_request : hashers_) {
      for (HashKind kind : kinds) per_request.emplace_back(kind);
    }
    digests_.assign(kinds.size(), std::vector<std::string>(requests));
  }
  bool wants_ordered_pieces() const override { return true; }
  void consume(TensorPiece&& piece) override {
    for (Hasher& hasher : hashers_[piece.request]) hasher.update(piece.bytes);
  }
  void request_complete(size_t request) override {
    for (size_t k = 0; k < digests_.size(); ++k) digests_[k][request] = hashers_[request][k].finish();
  }
  std::vector<std::vector<std::string>>& digests() { return digests_; }

 private:
  std::vector<std::vector<Hasher>> hashers_;        // per request, per kind
  std::vector<std::vector<std::string>> digests_;  // per kind, per request
};

}  // namespace

std::vector<std::vector<TensorDigest>> digest_streamed(const Checkpoint& checkpoint, const std::vector<HashKind>& kinds,
                                                       const StreamOptions& options, StreamStats* stats,
                                                       const ProgressCallback& progress) {
  WS_EXPECT(!kinds.empty(), ErrorCode::kInvalidArgument, "cannot digest " + checkpoint.uri() + ": no hash kind asked for");
  auto requests = all_tensors(checkpoint);
  DigestSink sink(requests.size(), kinds);
  auto result = stream_tensors(checkpoint, requests, sink, options, progress);
  if (stats) *stats = result;
  std::vector<std::vector<TensorDigest>> digests(kinds.size());
  for (size_t k = 0; k < kinds.size(); ++k) {
    digests[k].reserve(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) {
      digests[k].push_back({checkpoint.tensors()[i].name, std::move(sink.digests()[k][i])});
    }
  }
  return digests;
}

std::vector<TensorDigest> digest_streamed(const Checkpoint& checkpoint, HashKind kind, const StreamOptions& options,
                                          StreamStats* stats, const ProgressCallback& progress) {
  return std::move(digest_streamed(checkpoint, std::vector<HashKind>{kind}, options, stats, progress).front());
}

std::string content_digest(const Checkpoint& checkpoint, std::span<const TensorDigest> xxh64) {
  const auto& tensors = checkpoint.tensors();
  WS_EXPECT(xxh64.size() == tensors.size(), ErrorCode::kInvalidArgument,
            "cannot compute the content digest of " + checkpoint.uri() + ": " + std::to_string(xxh64.size()) +
                " tensor digests for its " + std::to_string(tensors.size()) + " tensors");
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) {
    WS_EXPECT(xxh64[i].name == tensors[i].name && xxh64[i].hex.size() == 16, ErrorCode::kInvalidArgument,
              "cannot compute the content digest of " + checkpoint.uri() + ": digest " + std::to_string(i) + " (" +
                  xxh64[i].name + ") is not the xxh64 of tensor " + tensors[i].name);
    order[i] = i;
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return tensors[a].name < tensors[b].name; });
  Hasher root(HashKind::kXxh64);
  auto add = [&root](std::string_view text) {
    root.update(std::as_bytes(std::span(text.data(), text.size())));
    root.update(std::as_bytes(std::span("\n", 1)));
  };
  for (size_t i : order) {
    add(tensors[i].name);
    add(dtype_name(tensors[i].dtype));
    add(shape_text(tensors[i].shape));
    add(xxh64[i].hex);
  }
  return root.finish();
}

}  // namespace weightstream
