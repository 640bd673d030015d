#include "trainer_client/data/dataset.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "trainer_client/data/default_corpus.h"

namespace pshard {
namespace {

// Bytes 0, 1, ..., 250, 0, 1, ...: every window is identified by its first byte.
std::string CountingText(int length) {
  std::string text(length, '\0');
  for (int i = 0; i < length; ++i) text[i] = static_cast<char>(i % 251);
  return text;
}

struct Batch {
  std::vector<int32_t> tokens, targets;
  bool operator==(const Batch&) const = default;
};

Batch Sample(const TokenDataset& data, uint64_t seed, int64_t step, int rank, int micro,
             int batch = 4, int seq_len = 16) {
  Batch b{std::vector<int32_t>(batch * seq_len), std::vector<int32_t>(batch * seq_len)};
  const absl::Status status =
      data.SampleBatch(seed, step, rank, micro, batch, seq_len, b.tokens, b.targets);
  EXPECT_TRUE(status.ok()) << status;
  return b;
}

TEST(TokenDatasetTest, SampleBatchIsAPureFunction) {
  const TokenDataset data = TokenDataset::FromText(CountingText(5000));
  const Batch base = Sample(data, 1, 10, 0, 0);
  EXPECT_EQ(Sample(data, 1, 10, 0, 0), base);
  EXPECT_NE(Sample(data, 2, 10, 0, 0), base);  // seed
  EXPECT_NE(Sample(data, 1, 11, 0, 0), base);  // step
  EXPECT_NE(Sample(data, 1, 10, 1, 0), base);  // rank
  EXPECT_NE(Sample(data, 1, 10, 0, 1), base);  // micro-batch
  // A copy of the dataset samples the same.
  const TokenDataset copy = data;
  EXPECT_EQ(Sample(copy, 1, 10, 0, 0), base);
}

TEST(TokenDatasetTest, SequencesAreContiguousAndTargetsShifted) {
  const TokenDataset data = TokenDataset::FromText(CountingText(5000));
  const int batch = 4, seq_len = 16;
  const Batch b = Sample(data, 3, 5, 2, 1, batch, seq_len);
  for (int s = 0; s < batch; ++s) {
    for (int t = 0; t < seq_len; ++t) {
      const int at = s * seq_len + t;
      EXPECT_EQ(b.targets[at], (b.tokens[at] + 1) % 251) << at;
      if (t + 1 < seq_len) {
        EXPECT_EQ(b.tokens[at + 1], b.targets[at]) << at;
      }
    }
  }
}

TEST(TokenDatasetTest, StartsCoverTheWholeRangeUniformly) {
  const int seq_len = 8;
  const int num_starts = 4;  // size - seq_len - 1 = 3: starts 0..3
  const TokenDataset data = TokenDataset::FromText(CountingText(seq_len + num_starts));
  std::vector<int> hits(num_starts, 0);
  const int batch = 10, steps = 400;
  for (int step = 0; step < steps; ++step) {
    const Batch b = Sample(data, 9, step, 0, 0, batch, seq_len);
    for (int s = 0; s < batch; ++s) {
      const int start = b.tokens[s * seq_len];
      ASSERT_GE(start, 0);
      ASSERT_LT(start, num_starts);
      ++hits[start];
    }
  }
  // 1000 expected hits each; 5 standard deviations is about 140.
  for (int h : hits) EXPECT_NEAR(h, batch * steps / num_starts, 140);
}

TEST(TokenDatasetTest, ShortestTextHasOneWindow) {
  const TokenDataset data = TokenDataset::FromText("abcde");
  const Batch b = Sample(data, 1, 0, 0, 0, 2, 4);
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{'a', 'b', 'c', 'd', 'a', 'b', 'c', 'd'}));
  EXPECT_EQ(b.targets, (std::vector<int32_t>{'b', 'c', 'd', 'e', 'b', 'c', 'd', 'e'}));
}

TEST(TokenDatasetTest, BadArgumentsAreRejected) {
  const TokenDataset data = TokenDataset::FromText(CountingText(100));
  std::vector<int32_t> tokens(32), targets(32);
  auto sample = [&](int64_t step, int rank, int micro, int batch, int seq_len) {
    return data.SampleBatch(1, step, rank, micro, batch, seq_len, tokens, targets).code();
  };
  EXPECT_EQ(sample(0, 0, 0, 2, 16), absl::StatusCode::kOk);
  EXPECT_EQ(sample(-1, 0, 0, 2, 16), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sample(0, -1, 0, 2, 16), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sample(0, 0, -1, 2, 16), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sample(0, 0, 0, 0, 16), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(sample(0, 0, 0, 4, 8), absl::StatusCode::kOk);
  EXPECT_EQ(sample(0, 0, 0, 4, 16), absl::StatusCode::kInvalidArgument);  // spans too short
  EXPECT_EQ(sample(0, 0, 0, 32, 0), absl::StatusCode::kInvalidArgument);

  const TokenDataset tiny = TokenDataset::FromText("abcd");
  std::vector<int32_t> four(4);
  EXPECT_EQ(tiny.SampleBatch(1, 0, 0, 0, 1, 4, four, four).code(),
            absl::StatusCode::kInvalidArgument);  // no target after the last token
  std::vector<int32_t> three(3);
  EXPECT_TRUE(tiny.SampleBatch(1, 0, 0, 0, 1, 3, three, three).ok());
}

TEST(TokenDatasetTest, FromFile) {
  const std::string path = testing::TempDir() + "/pshard_dataset_test.txt";
  {
    std::ofstream out(path, std::ios::binary);
    out << "hello, world\n";
  }
  absl::StatusOr<TokenDataset> data = TokenDataset::FromFile(path);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->size(), 13);

  const absl::StatusOr<TokenDataset> missing = TokenDataset::FromFile(path + ".missing");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(".missing"), std::string::npos);

  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << "x";
  }
  EXPECT_EQ(TokenDataset::FromFile(path).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TokenDatasetTest, UnigramEntropy) {
  // "aab": p(a) = 2/3, p(b) = 1/3, H = -(2/3 ln 2/3 + 1/3 ln 1/3) = ln 3 - 2/3 ln 2.
  EXPECT_NEAR(TokenDataset::FromText("aab").UnigramEntropyNats(),
              std::log(3.0) - 2.0 / 3.0 * std::log(2.0), 1e-15);
  EXPECT_NEAR(TokenDataset::FromText("abcdabcd").UnigramEntropyNats(), std::log(4.0), 1e-15);
  EXPECT_EQ(TokenDataset::FromText("zzzz").UnigramEntropyNats(), 0.0);
  EXPECT_EQ(TokenDataset::FromText("").UnigramEntropyNats(), 0.0);
}

TEST(DefaultCorpusTest, DeterministicEnglishLikeText) {
  const std::string corpus = DefaultCorpus();
  EXPECT_EQ(DefaultCorpus(), corpus);
  EXPECT_GE(corpus.size(), 1u << 20);
  EXPECT_LE(corpus.size(), 2u << 20);
  for (char c : corpus) {
    ASSERT_TRUE(c == '\n' || (c >= ' ' && c <= '~')) << "byte " << static_cast<int>(c);
  }
  const TokenDataset data = TokenDataset::FromText(corpus);
  const double entropy = data.UnigramEntropyNats();
  RecordProperty("unigram_entropy_nats", std::to_string(entropy));
  std::printf("DefaultCorpus: %zu bytes, unigram entropy %.4f nats\n", corpus.size(), entropy);
  // English letters give about 2.9 nats; a grammar over a few hundred words
  // is somewhat less varied.
  EXPECT_GT(entropy, 2.3);
  EXPECT_LT(entropy, 3.3);
  std::printf("%s\n", corpus.substr(0, 600).c_str());
}

}  // namespace
}  // namespace pshard
