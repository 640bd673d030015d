#include "trainer_client/data/dataset.h"

#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/rng.h"

namespace pshard {

absl::StatusOr<TokenDataset> TokenDataset::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot open dataset file ", path, ": ", std::strerror(errno)));
  }
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) {
    return absl::DataLossError(absl::StrCat("error while reading dataset file ", path));
  }
  if (bytes.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat("dataset file ", path, " holds ", bytes.size(),
                                                   " bytes; need at least 2 tokens"));
  }
  return TokenDataset(std::move(bytes));
}

TokenDataset TokenDataset::FromText(std::string text) { return TokenDataset(std::move(text)); }

absl::Status TokenDataset::SampleBatch(uint64_t seed, int64_t step, int rank, int micro, int batch,
                                       int seq_len, std::span<int32_t> tokens,
                                       std::span<int32_t> targets) const {
  if (step < 0 || rank < 0 || micro < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("negative step ", step, ", rank ", rank, " or micro-batch ", micro));
  }
  if (batch < 1 || seq_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch ", batch, " and seq_len ", seq_len, " must be positive"));
  }
  if (seq_len >= size()) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len ", seq_len, " needs more than ",
                                                   seq_len, " tokens; the dataset has ", size()));
  }
  const size_t n = static_cast<size_t>(batch) * static_cast<size_t>(seq_len);
  if (tokens.size() != n || targets.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("expected ", n, " tokens and targets, got ",
                                                   tokens.size(), " and ", targets.size()));
  }
  // One hash stream per (step, rank, micro); element b of it places sequence b.
  const uint64_t stream = CounterHash(static_cast<uint64_t>(step), static_cast<uint64_t>(rank),
                                      static_cast<uint64_t>(micro));
  // Starts lie in [0, size - seq_len - 1] so that every target exists.
  const uint64_t num_starts = static_cast<uint64_t>(size() - seq_len);
  for (int b = 0; b < batch; ++b) {
    // Multiply-shift maps the 64-bit hash onto [0, num_starts) uniformly
    // (bias below 2^-40 for any realistic dataset).
    const uint64_t hash = CounterHash(seed, stream, static_cast<uint64_t>(b));
    const auto start =
        static_cast<int64_t>((static_cast<unsigned __int128>(hash) * num_starts) >> 64);
    for (int t = 0; t < seq_len; ++t) {
      const size_t at = static_cast<size_t>(b) * seq_len + t;
      tokens[at] = static_cast<unsigned char>(bytes_[start + t]);
      targets[at] = static_cast<unsigned char>(bytes_[start + t + 1]);
    }
  }
  return absl::OkStatus();
}

double TokenDataset::UnigramEntropyNats() const {
  if (bytes_.empty()) return 0.0;
  std::array<int64_t, kVocab> counts{};
  for (char c : bytes_) ++counts[static_cast<unsigned char>(c)];
  const double total = static_cast<double>(bytes_.size());
  double entropy = 0.0;
  for (int64_t count : counts) {
    if (count == 0) continue;
    const double p = static_cast<double>(count) / total;
    entropy -= p * std::log(p);
  }
  return entropy;
}

}  // namespace pshard
