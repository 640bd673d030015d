// Bad input: every malformed, misdirected, stale, duplicated, oversized or
// abandoned request to a real shard server is refused (or ignored) with a
// status that says what is wrong, changes nothing on the server, and the job
// then trains on to the same weights as unsharded training.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/wire_encoding.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "common/square_sum.h"
#include "proto/rpc_util.h"
#include "proto/shard.grpc.pb.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"
#include "tests/testutil/reference_training.h"
#include "trainer_client/data/default_corpus.h"
#include "trainer_client/trainer.h"

namespace pshard::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kShards = 2;
constexpr int kTrainers = 2;
constexpr absl::Duration kRpcTimeout = absl::Seconds(30);
// Elements per pushed chunk in the hand-made pushes: several chunks a slice.
constexpr int64_t kChunkElements = 256;

JobConfig TinyJob() { return TinyGptJob(kShards, kTrainers, 5); }

TrainerOptions TinyTrainer() { return TinyTrainerOptions(7); }


// Quantized pushes by hand: blocks of 80, three to a chunk, so that the
// slices (multiples of 64 elements) end in a short block.
constexpr int kBlock = 80;

// The chunks of one gradient slice as a well-behaved client sends them (fp32
// unless `format` says otherwise).
std::vector<v1::PushChunk> SliceChunks(int rank, int64_t step, int unit, std::span<const float> slice,
                                       const WireFormat& format = WireFormat(WireEncoding::kFp32)) {
  std::vector<v1::PushChunk> chunks;
  const int64_t n = static_cast<int64_t>(slice.size());
  bool finite = true;
  for (float x : slice) finite = finite && std::isfinite(x);
  const int64_t per_chunk = kChunkElements / static_cast<int64_t>(format.GrainElements()) *
                            static_cast<int64_t>(format.GrainElements());
  int index = 0;
  for (int64_t offset = 0; offset < n || index == 0; offset += per_chunk, ++index) {
    const int64_t count = std::min(per_chunk, n - offset);
    v1::PushChunk c;
    c.set_trainer_rank(rank);
    c.set_step(step);
    c.set_unit(unit);
    c.set_encoding(EncodingToProto(format.encoding()));
    c.set_quant_block(format.block());
    c.set_non_finite(format.quantized() && !finite);
    c.set_chunk_index(index);
    c.set_offset(offset);
    c.set_slice_length(n);
    std::string* data = c.mutable_data();
    data->resize(format.EncodedBytes(count));
    EncodeElements(format, slice.subspan(offset, count), reinterpret_cast<std::byte*>(data->data()));
    chunks.push_back(std::move(c));
  }
  return chunks;
}

struct PushResult {
  grpc::Status status;
  v1::PushResponse response;
};

// Sends `chunks` as one push stream and half-closes it.
PushResult RawPush(v1::ShardService::Stub* stub, const std::vector<v1::PushChunk>& chunks) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kRpcTimeout));
  PushResult result;
  std::unique_ptr<grpc::ClientWriter<v1::PushChunk>> writer = stub->Push(&ctx, &result.response);
  for (const v1::PushChunk& c : chunks) {
    if (!writer->Write(c)) break;  // the server already answered
  }
  writer->WritesDone();
  result.status = writer->Finish();
  return result;
}

grpc::Status RawFetch(v1::ShardService::Stub* stub, int unit, int64_t version,
                      v1::Encoding encoding = v1::ENCODING_FP32,
                      absl::Time deadline = absl::Now() + kRpcTimeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::FetchRequest request;
  request.set_unit(unit);
  request.set_version(version);
  request.set_encoding(encoding);
  request.set_trainer_rank(0);
  std::unique_ptr<grpc::ClientReader<v1::FetchChunk>> reader = stub->Fetch(&ctx, request);
  v1::FetchChunk chunk;
  while (reader->Read(&chunk)) {
  }
  return reader->Finish();
}

// "shard 0, step 1: no gradient from trainer 1 (units 0,1) for 3 s" without
// the seconds, which move on their own.
std::string WithoutSeconds(const std::string& waiting_for) {
  return waiting_for.substr(0, waiting_for.rfind(" for "));
}

#define EXPECT_STATUS(result, code, substring)                                          \
  do {                                                                                  \
    const grpc::Status status_ = (result);                                              \
    EXPECT_EQ(status_.error_code(), grpc::StatusCode::code) << status_.error_message(); \
    EXPECT_THAT(status_.error_message(), HasSubstr(substring));                         \
  } while (0)

// What a client can see of a server's state.
struct Snapshot {
  std::vector<std::vector<float>> weights;  // every unit, unpadded
  std::vector<v1::StatusResponse> status;   // per shard
};

class BadInputTest : public ::testing::Test {
 protected:
  void Start(LocalCluster::Options options = LocalCluster::Options()) {
    job_ = TinyJob();
    auto cluster = LocalCluster::Start(job_, options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    for (int r = 0; r < kTrainers; ++r) {
      auto client = cluster_->Connect(r, WireEncoding::kFp32);
      ASSERT_TRUE(client.ok()) << client.status();
      clients_.push_back(std::move(*client));
    }
    for (const std::string& address : cluster_->addresses()) {
      stubs_.push_back(
          v1::ShardService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())));
    }
    auto oracle = ReferenceTraining::Create(job_, WireEncoding::kFp32, TinyTrainer(), &TestCorpus());
    ASSERT_TRUE(oracle.ok()) << oracle.status();
    oracle_.emplace(std::move(*oracle));
  }

  const JobLayout& layout() const { return clients_[0]->layout(); }
  int num_units() const { return static_cast<int>(layout().partitions.size()); }
  v1::ShardService::Stub* stub(int shard) { return stubs_[shard].get(); }

  // Shard `shard`'s part of the reference gradient of `rank` at `step`.
  std::vector<float> ReferenceSlice(int64_t step, int rank, int unit, int shard) {
    auto grads = oracle_->MicroBatchGradient(step, rank);
    EXPECT_TRUE(grads.ok()) << grads.status();
    if (!grads.ok()) return {};
    const SliceRange slice = layout().partitions[unit].Slice(shard);
    const auto begin = (*grads)[unit].begin() + slice.begin;
    return std::vector<float>(begin, begin + slice.length);
  }

  v1::StatusResponse GetStatus(int shard) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + kRpcTimeout));
    v1::StatusResponse response;
    grpc::Status s = stub(shard)->GetStatus(&ctx, v1::StatusRequest(), &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return response;
  }

  Snapshot TakeSnapshot() {
    Snapshot snapshot;
    auto weights = cluster_->ReadMasterWeights();
    EXPECT_TRUE(weights.ok()) << weights.status();
    if (weights.ok()) snapshot.weights = std::move(*weights);
    for (int s = 0; s < kShards; ++s) snapshot.status.push_back(GetStatus(s));
    return snapshot;
  }

  // Weights bit for bit, step, counters and what the step waits for.
  void ExpectUnchanged(const Snapshot& before) {
    const Snapshot after = TakeSnapshot();
    EXPECT_TRUE(BitIdentical(after.weights, before.weights)) << "master weights changed";
    for (int s = 0; s < kShards; ++s) {
      const v1::StatusResponse& a = after.status[s];
      const v1::StatusResponse& b = before.status[s];
      EXPECT_EQ(a.current_step(), b.current_step()) << "shard " << s;
      EXPECT_EQ(a.applied_updates(), b.applied_updates()) << "shard " << s;
      EXPECT_EQ(a.skipped_steps(), b.skipped_steps()) << "shard " << s;
      EXPECT_EQ(WithoutSeconds(a.waiting_for()), WithoutSeconds(b.waiting_for())) << "shard " << s;
    }
  }

  // A correct push of the reference slice, as the first of its kind, is
  // accepted: nothing of an earlier refused or abandoned push was recorded.
  void ExpectCleanPushAccepted(int rank, int64_t step, int unit, int shard) {
    const std::vector<float> slice = ReferenceSlice(step, rank, unit, shard);
    const PushResult r = RawPush(stub(shard), SliceChunks(rank, step, unit, slice));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.response.disposition(), v1::PushResponse::ACCEPTED) << r.response.detail();
    pushed_.insert({rank, unit, shard});
  }

  // Pushes every reference slice of `step` not in pushed_, and waits until
  // the step is applied. (Real trainers would push the slices in pushed_ a
  // second time, and such a duplicate may arrive after the step closed,
  // when it is refused as stale: so a step begun by hand is ended by hand.)
  void FinishStepByHand(int64_t step) {
    for (int rank = 0; rank < kTrainers; ++rank) {
      auto grads = oracle_->MicroBatchGradient(step, rank);
      ASSERT_TRUE(grads.ok()) << grads.status();
      for (int unit = 0; unit < num_units(); ++unit) {
        for (int shard = 0; shard < kShards; ++shard) {
          if (pushed_.count({rank, unit, shard})) continue;
          const SliceRange slice = layout().partitions[unit].Slice(shard);
          const PushResult r = RawPush(
              stub(shard), SliceChunks(rank, step, unit,
                                       std::span<const float>((*grads)[unit]).subspan(slice.begin, slice.length)));
          ASSERT_TRUE(r.status.ok()) << r.status.error_message();
          EXPECT_EQ(r.response.disposition(), v1::PushResponse::ACCEPTED) << r.response.detail();
        }
      }
    }
    pushed_.clear();
    ASSERT_NO_FATAL_FAILURE(WaitForVersion(step + 1));
  }

  // Runs step `step` with a real pshard::Trainer for each of `ranks`, each
  // in its own thread; returns once their pushes are acknowledged.
  void RunTrainers(int64_t step, std::vector<int> ranks) {
    std::vector<absl::Status> results(ranks.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < ranks.size(); ++i) {
      threads.emplace_back([&, i] {
        auto trainer = Trainer::Create(clients_[ranks[i]].get(), &TestCorpus(), TinyTrainer());
        if (!trainer.ok()) {
          results[i] = trainer.status();
          return;
        }
        results[i] = (*trainer)->RunStep(step).status();
      });
    }
    for (auto& t : threads) t.join();
    for (size_t i = 0; i < ranks.size(); ++i) {
      ASSERT_TRUE(results[i].ok()) << "trainer " << ranks[i] << ": " << results[i];
    }
  }

  // Waits until every unit is published at `version` on every shard.
  void WaitForVersion(int64_t version) {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    for (int u = 0; u < num_units(); ++u) {
      absl::Status s;
      do {  // a server's fetch wait limit may be shorter than a step under load
        s = clients_[0]->StartFetch(u, version)->Wait();
      } while (absl::IsDeadlineExceeded(s) && absl::Now() < give_up);
      ASSERT_TRUE(s.ok()) << s;
    }
  }

  void ExpectMatchesReference() {
    auto weights = cluster_->ReadMasterWeights();
    ASSERT_TRUE(weights.ok()) << weights.status();
    EXPECT_TRUE(BitIdentical(*weights, oracle_->MasterWeights()))
        << "sharded weights differ from the reference";
  }

  // Ends a step with real trainers for `ranks` (those that have not run it
  // yet), or by hand if the test has begun it by hand; the result equals
  // the reference.
  void CompleteStep(int64_t step, std::vector<int> ranks = {0, 1}) {
    if (pushed_.empty()) {
      ASSERT_NO_FATAL_FAILURE(RunTrainers(step, ranks));
      ASSERT_NO_FATAL_FAILURE(WaitForVersion(step + 1));
    } else {
      ASSERT_NO_FATAL_FAILURE(FinishStepByHand(step));
    }
    ASSERT_TRUE(oracle_->Step(step).ok());
    ExpectMatchesReference();
    for (int s = 0; s < kShards; ++s) EXPECT_EQ(GetStatus(s).current_step(), step + 1) << "shard " << s;
  }

  void ExpectNonFiniteStepSkipped(float bad);

  JobConfig job_;
  std::unique_ptr<LocalCluster> cluster_;
  std::vector<std::unique_ptr<ShardClient>> clients_;  // by trainer rank
  std::vector<std::unique_ptr<v1::ShardService::Stub>> stubs_;  // by shard
  std::optional<ReferenceTraining> oracle_;
  std::set<std::tuple<int, int, int>> pushed_;  // (rank, unit, shard) of this step, by hand
};

TEST_F(BadInputTest, WrongSliceLengthFieldIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const Snapshot before = TakeSnapshot();
  for (int shard = 0; shard < kShards; ++shard) {
    const int unit = 1;
    const int64_t length = layout().partitions[unit].slice_length;
    for (int64_t declared : {length + 8, length - 8, int64_t{0}}) {
      // A self-consistent push of the wrong number of elements.
      std::vector<float> values(declared, 0.25f);
      const PushResult r = RawPush(stub(shard), SliceChunks(0, 0, unit, values));
      EXPECT_STATUS(r.status, INVALID_ARGUMENT, "wrong length");
      EXPECT_THAT(r.status.error_message(), HasSubstr(absl::StrCat("declares ", declared)));
    }
  }
  ExpectUnchanged(before);
  ExpectCleanPushAccepted(0, 0, 1, 0);
  ExpectCleanPushAccepted(0, 0, 1, 1);
  CompleteStep(0);
  CompleteStep(1);
}

TEST_F(BadInputTest, ChunksThatDoNotCoverTheSliceAreRefused) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const Snapshot before = TakeSnapshot();
  const int unit = 0;
  const int shard = 1;
  const std::vector<float> slice = ReferenceSlice(0, 1, unit, shard);
  const int64_t length = static_cast<int64_t>(slice.size());
  ASSERT_GT(length, 2 * kChunkElements);
  {
    // Fewer elements than the slice, correctly declared: refused at the end.
    std::vector<v1::PushChunk> chunks = SliceChunks(1, 0, unit, slice);
    chunks.pop_back();
    const PushResult r = RawPush(stub(shard), chunks);
    EXPECT_STATUS(r.status, INVALID_ARGUMENT, "wrong length");
    EXPECT_THAT(r.status.error_message(), HasSubstr("ended after"));
    EXPECT_THAT(r.status.error_message(), HasSubstr(absl::StrCat(" of ", length, " elements")));
  }
  {
    // More elements than the slice.
    std::vector<v1::PushChunk> chunks = SliceChunks(1, 0, unit, slice);
    v1::PushChunk extra = chunks.back();
    extra.set_chunk_index(static_cast<int>(chunks.size()));
    extra.set_offset(length);
    chunks.push_back(extra);
    const PushResult r = RawPush(stub(shard), chunks);
    EXPECT_STATUS(r.status, INVALID_ARGUMENT, "wrong length");
  }
  {
    // A chunk whose bytes are not whole elements.
    std::vector<v1::PushChunk> chunks = SliceChunks(1, 0, unit, slice);
    chunks[1].mutable_data()->push_back('\0');
    const PushResult r = RawPush(stub(shard), chunks);
    EXPECT_STATUS(r.status, INVALID_ARGUMENT, "wrong length");
  }
  {
    // A chunk that skips elements (offset ahead of what was received).
    std::vector<v1::PushChunk> chunks = SliceChunks(1, 0, unit, slice);
    chunks[1].set_offset(chunks[1].offset() + 1);
    const PushResult r = RawPush(stub(shard), chunks);
    EXPECT_STATUS(r.status, INVALID_ARGUMENT, "wrong offset");
  }
  {
    // A stream with no chunk at all.
    const PushResult r = RawPush(stub(shard), {});
    EXPECT_STATUS(r.status, INVALID_ARGUMENT, "empty push");
  }
  ExpectUnchanged(before);
  ExpectCleanPushAccepted(1, 0, unit, shard);
  CompleteStep(0);
  CompleteStep(1);
}

TEST_F(BadInputTest, UnknownUnitIsNotFoundForPushAndFetch) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const Snapshot before = TakeSnapshot();
  for (int shard = 0; shard < kShards; ++shard) {
    for (int unit : {num_units(), -1, 1000}) {
      const std::vector<float> values(layout().partitions[0].slice_length, 0.5f);
      const PushResult push = RawPush(stub(shard), SliceChunks(0, 0, unit, values));
      EXPECT_STATUS(push.status, NOT_FOUND, absl::StrCat("unknown unit ", unit));
      EXPECT_STATUS(RawFetch(stub(shard), unit, 0), NOT_FOUND, absl::StrCat("unknown unit ", unit));
    }
  }
  ExpectUnchanged(before);
  CompleteStep(0);
}

TEST_F(BadInputTest, StaleAndFutureStepsAreRefused) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const int unit = 2;
  {
    const Snapshot before = TakeSnapshot();
    const PushResult r = RawPush(stub(0), SliceChunks(0, 5, unit, ReferenceSlice(0, 0, unit, 0)));
    EXPECT_STATUS(r.status, OUT_OF_RANGE, "future");
    EXPECT_THAT(r.status.error_message(), HasSubstr("step 5"));
    ExpectUnchanged(before);
  }
  CompleteStep(0);
  {
    const Snapshot before = TakeSnapshot();
    for (int shard = 0; shard < kShards; ++shard) {
      const PushResult r =
          RawPush(stub(shard), SliceChunks(1, 0, unit, ReferenceSlice(0, 1, unit, shard)));
      EXPECT_STATUS(r.status, FAILED_PRECONDITION, "already applied");
      EXPECT_THAT(r.status.error_message(), HasSubstr("step 0"));
    }
    ExpectUnchanged(before);
  }
  CompleteStep(1);
}

TEST_F(BadInputTest, DuplicatePushIsAcknowledgedAndIgnored) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const int unit = 2;
  const int shard = 1;
  const std::vector<float> slice = ReferenceSlice(0, 0, unit, shard);
  const PushResult first = RawPush(stub(shard), SliceChunks(0, 0, unit, slice));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.response.disposition(), v1::PushResponse::ACCEPTED);
  pushed_.insert({0, unit, shard});

  const Snapshot before = TakeSnapshot();
  // A plain retry, and a "retry" whose values differ: both are ignored, since
  // a contribution is identified by (trainer, step, unit), not by its bytes.
  std::vector<float> doubled = slice;
  for (float& x : doubled) x *= 2.0f;
  for (const std::vector<float>& values : {slice, doubled}) {
    const PushResult again = RawPush(stub(shard), SliceChunks(0, 0, unit, values));
    ASSERT_TRUE(again.status.ok()) << again.status.error_message();
    EXPECT_EQ(again.response.disposition(), v1::PushResponse::DUPLICATE);
    EXPECT_THAT(again.response.detail(), HasSubstr("already"));
  }
  ExpectUnchanged(before);
  // The step ends with a single push of everything else, and the result
  // equals training with a single push of each contribution.
  CompleteStep(0);
  CompleteStep(1);
}

void BadInputTest::ExpectNonFiniteStepSkipped(float bad) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const Snapshot initial = TakeSnapshot();
  const int unit = 1;
  const int shard = 0;
  std::vector<float> slice = ReferenceSlice(0, 0, unit, shard);
  slice[3] = bad;
  const PushResult r = RawPush(stub(shard), SliceChunks(0, 0, unit, slice));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.response.disposition(), v1::PushResponse::ACCEPTED_NON_FINITE);
  EXPECT_THAT(r.response.detail(), HasSubstr("skipped"));
  pushed_.insert({0, unit, shard});

  // Every other contribution of step 0 arrives; the step closes without an
  // update anywhere, also on the shard that never saw the bad value.
  ASSERT_NO_FATAL_FAILURE(FinishStepByHand(0));
  for (int s = 0; s < kShards; ++s) {
    const v1::StatusResponse status = GetStatus(s);
    EXPECT_EQ(status.current_step(), 1) << "shard " << s;
    EXPECT_EQ(status.skipped_steps(), 1) << "shard " << s;
    EXPECT_EQ(status.applied_updates(), 0) << "shard " << s;
  }
  auto weights = cluster_->ReadMasterWeights();
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_TRUE(BitIdentical(*weights, initial.weights)) << "a skipped step changed the weights";

  // The next step trains normally: the reference skips step 0 as well.
  ASSERT_NO_FATAL_FAILURE(RunTrainers(1, {0, 1}));
  ASSERT_NO_FATAL_FAILURE(WaitForVersion(2));
  ASSERT_TRUE(oracle_->Step(1).ok());
  ExpectMatchesReference();
  EXPECT_FALSE(BitIdentical(oracle_->MasterWeights(), initial.weights));
  for (int s = 0; s < kShards; ++s) {
    const v1::StatusResponse status = GetStatus(s);
    EXPECT_EQ(status.current_step(), 2) << "shard " << s;
    EXPECT_EQ(status.skipped_steps(), 1) << "shard " << s;
    EXPECT_EQ(status.applied_updates(), 1) << "shard " << s;
  }
}

TEST_F(BadInputTest, NanGradientSkipsTheStepOnEveryShard) {
  ExpectNonFiniteStepSkipped(std::numeric_limits<float>::quiet_NaN());
}

TEST_F(BadInputTest, InfGradientSkipsTheStepOnEveryShard) {
  ExpectNonFiniteStepSkipped(std::numeric_limits<float>::infinity());
}

TEST_F(BadInputTest, OversizeMessageIsRefused) {
  constexpr int kMaxMessageBytes = 1 << 20;
  LocalCluster::Options options;
  options.max_message_bytes = kMaxMessageBytes;
  options.fetch_chunk_bytes = kMaxMessageBytes / 4;
  ASSERT_NO_FATAL_FAILURE(Start(options));
  const Snapshot before = TakeSnapshot();
  const int unit = 0;
  for (int shard = 0; shard < kShards; ++shard) {
    v1::PushChunk chunk;
    chunk.set_trainer_rank(0);
    chunk.set_step(0);
    chunk.set_unit(unit);
    chunk.set_encoding(v1::ENCODING_FP32);
    chunk.set_chunk_index(0);
    chunk.set_offset(0);
    chunk.set_slice_length(layout().partitions[unit].slice_length);
    chunk.mutable_data()->assign(2 * kMaxMessageBytes, '\0');
    const PushResult r = RawPush(stub(shard), {chunk});
    EXPECT_STATUS(r.status, RESOURCE_EXHAUSTED, "larger than max");
  }
  ExpectUnchanged(before);
  ExpectCleanPushAccepted(0, 0, unit, 0);
  CompleteStep(0);
  CompleteStep(1);
}

TEST_F(BadInputTest, AbandonedPushAppliesNothing) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const Snapshot before = TakeSnapshot();
  const int unit = 0;
  const int shard = 0;
  std::vector<float> garbage(layout().partitions[unit].slice_length, 1000.0f);
  const std::vector<v1::PushChunk> chunks = SliceChunks(0, 0, unit, garbage);
  ASSERT_GT(chunks.size(), 2u);
  // Gone after the first chunk; then gone after every chunk but before
  // closing the stream (all data is there, the push is still not complete).
  for (size_t sent : {size_t{1}, chunks.size()}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + kRpcTimeout));
    v1::PushResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::PushChunk>> writer = stub(shard)->Push(&ctx, &response);
    for (size_t i = 0; i < sent; ++i) ASSERT_TRUE(writer->Write(chunks[i]));
    absl::SleepFor(absl::Milliseconds(100));  // let the server read them (not needed to pass)
    ctx.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  {
    // A client that goes away without cancelling: the writer and context are
    // destroyed mid-stream.
    auto ctx = std::make_unique<grpc::ClientContext>();
    v1::PushResponse response;
    auto writer = stub(shard)->Push(ctx.get(), &response);
    ASSERT_TRUE(writer->Write(chunks[0]));
    writer.reset();
    ctx.reset();
  }
  ExpectUnchanged(before);
  ExpectCleanPushAccepted(0, 0, unit, shard);
  CompleteStep(0);
  CompleteStep(1);
}

TEST_F(BadInputTest, FetchOfAVersionThatIsGoneIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Start());
  CompleteStep(0);
  const Snapshot before = TakeSnapshot();
  for (int shard = 0; shard < kShards; ++shard) {
    for (int64_t version : {int64_t{0}, int64_t{-1}}) {
      const grpc::Status s = RawFetch(stub(shard), 1, version);
      EXPECT_STATUS(s, FAILED_PRECONDITION, "gone");
      EXPECT_THAT(s.error_message(), HasSubstr("at version 1"));
    }
  }
  ExpectUnchanged(before);
  CompleteStep(1);
}

// Waiting is for the next steps only: a fetch of a far-future version, or a
// norm report for a step the coordinator is far from, is refused at once
// instead of holding a waiter (and its call) until the deadline.
TEST_F(BadInputTest, FarFutureFetchesAndNormReportsAreRefusedAtOnce) {
  ASSERT_NO_FATAL_FAILURE(Start());
  CompleteStep(0);
  const Snapshot before = TakeSnapshot();
  for (int shard = 0; shard < kShards; ++shard) {
    // OUT_OF_RANGE at once, not the DEADLINE_EXCEEDED a wait ends in.
    EXPECT_STATUS(RawFetch(stub(shard), 1, 1 + kMaxVersionsAhead + 1), OUT_OF_RANGE,
                  "ahead of this shard's version 1");
  }
  for (int64_t step : {int64_t{3}, int64_t{1000}, int64_t{-10}}) {
    grpc::ClientContext ctx;
    v1::NormReport report;
    report.set_shard_index(1);
    report.set_step(step);
    SquareSum large;
    const float gradient = 1e15f;
    large.AddSquares(std::span<const float>(&gradient, 1));
    report.set_sum_of_squares(large.ToBytes());
    report.set_job_fingerprint(JobFingerprint(TinyJob()));
    v1::NormAgreement agreement;
    EXPECT_STATUS(stub(0)->AgreeNorm(&ctx, report, &agreement), OUT_OF_RANGE, "the coordinator is at step 1");
  }
  ExpectUnchanged(before);
  CompleteStep(1);
}

// A norm report whose exact sum of squares is not one (a length that is not
// whole words, too many words, an unknown flag) is refused: the round of
// the step waits for the shard's real report, and the step closes as ever.
TEST_F(BadInputTest, AMalformedExactNormIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Start());
  CompleteStep(0);
  const Snapshot before = TakeSnapshot();
  for (const std::string& bytes : {std::string(), std::string(3, '\0'), std::string(1 + 8 * 11, '\0'),
                                   std::string(1, '\x04')}) {
    grpc::ClientContext ctx;
    v1::NormReport report;
    report.set_shard_index(1);
    report.set_step(1);
    report.set_sum_of_squares(bytes);
    report.set_job_fingerprint(JobFingerprint(TinyJob()));
    v1::NormAgreement agreement;
    EXPECT_STATUS(stub(0)->AgreeNorm(&ctx, report, &agreement), INVALID_ARGUMENT, "exact sum of squares");
  }
  ExpectUnchanged(before);
  CompleteStep(1);
}

TEST_F(BadInputTest, BadTrainerRankIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const Snapshot before = TakeSnapshot();
  for (int shard = 0; shard < kShards; ++shard) {
    for (int rank : {kTrainers, -1, 77}) {
      const PushResult r = RawPush(stub(shard), SliceChunks(rank, 0, 0, ReferenceSlice(0, 0, 0, shard)));
      EXPECT_STATUS(r.status, INVALID_ARGUMENT, absl::StrCat("trainer rank ", rank));
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + kRpcTimeout));
    v1::JoinRequest join;
    join.set_trainer_rank(kTrainers);
    v1::JoinResponse joined;
    EXPECT_STATUS(stub(shard)->Join(&ctx, join, &joined), INVALID_ARGUMENT, "trainer rank");
  }
  ExpectUnchanged(before);
  CompleteStep(0);
}

TEST_F(BadInputTest, BadEncodingIsRefused) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const Snapshot before = TakeSnapshot();
  for (int shard = 0; shard < kShards; ++shard) {
    for (v1::Encoding encoding : {v1::ENCODING_UNSPECIFIED, static_cast<v1::Encoding>(7)}) {
      std::vector<v1::PushChunk> chunks = SliceChunks(0, 0, 0, ReferenceSlice(0, 0, 0, shard));
      for (v1::PushChunk& c : chunks) c.set_encoding(encoding);
      EXPECT_STATUS(RawPush(stub(shard), chunks).status, INVALID_ARGUMENT, "encoding");
      EXPECT_STATUS(RawFetch(stub(shard), 0, 0, encoding), INVALID_ARGUMENT, "encoding");
    }
  }
  ExpectUnchanged(before);
  CompleteStep(0);
}

TEST_F(BadInputTest, QuantizedPushesWithBadBlocksOrScalesAreRefused) {
  ASSERT_NO_FATAL_FAILURE(Start());
  // Rank 0 joins again, saying it pushes int8 gradients in blocks of 80.
  auto int8_client = cluster_->Connect(0, WireEncodings(WireEncoding::kFp32, WireEncoding::kInt8, kBlock));
  ASSERT_TRUE(int8_client.ok()) << int8_client.status();
  const WireFormat int8(WireEncoding::kInt8, kBlock);
  const Snapshot before = TakeSnapshot();
  const int unit = 0;
  const int shard = 1;
  const std::vector<float> slice = ReferenceSlice(0, 0, unit, shard);
  ASSERT_GT(slice.size(), 2u * kChunkElements);
  ASSERT_NE(slice.size() % kBlock, 0u) << "the slice should end in a short block";
  {
    // A chunk that is not whole blocks: three bytes of a block cut off.
    std::vector<v1::PushChunk> chunks = SliceChunks(0, 0, unit, slice, int8);
    chunks[1].mutable_data()->resize(chunks[1].data().size() - 3);
    EXPECT_STATUS(RawPush(stub(shard), chunks).status, INVALID_ARGUMENT, "neither whole blocks");
  }
  {
    // The last chunk's short block one element too long.
    std::vector<v1::PushChunk> chunks = SliceChunks(0, 0, unit, slice, int8);
    chunks.back().mutable_data()->push_back('\0');
    EXPECT_STATUS(RawPush(stub(shard), chunks).status, INVALID_ARGUMENT, "wrong length");
  }
  {
    // Block sizes that are not block sizes.
    for (int block : {0, 10, 100000}) {
      std::vector<v1::PushChunk> chunks = SliceChunks(0, 0, unit, slice, int8);
      for (v1::PushChunk& c : chunks) c.set_quant_block(block);
      EXPECT_STATUS(RawPush(stub(shard), chunks).status, INVALID_ARGUMENT, "quantization block");
    }
  }
  {
    // Scales that are not finite, or negative, anywhere in the slice.
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), -1.0f}) {
      std::vector<v1::PushChunk> chunks = SliceChunks(0, 0, unit, slice, int8);
      std::memcpy(chunks.back().mutable_data()->data(), &bad, sizeof(bad));  // the last chunk's first block
      const PushResult r = RawPush(stub(shard), chunks);
      EXPECT_STATUS(r.status, INVALID_ARGUMENT, "bad scale");
      EXPECT_THAT(r.status.error_message(), HasSubstr("nothing applied"));
    }
  }
  {
    // Encodings rank 0 did not join with: int4, another block size, fp32.
    for (const WireFormat& other : {WireFormat(WireEncoding::kInt4, kBlock), WireFormat(WireEncoding::kInt8, 128),
                                    WireFormat(WireEncoding::kFp32)}) {
      const PushResult r = RawPush(stub(shard), SliceChunks(0, 0, unit, slice, other));
      EXPECT_STATUS(r.status, FAILED_PRECONDITION, "joined pushing int8 (blocks of 80) gradients");
    }
  }
  // Weights never travel as int4.
  EXPECT_STATUS(RawFetch(stub(shard), unit, 0, v1::ENCODING_INT4), INVALID_ARGUMENT, "int4 is for gradients");
  ExpectUnchanged(before);
  // A well-formed int8 push is then taken: the refused ones left nothing
  // behind (it is no duplicate, no partial overlap).
  const PushResult ok = RawPush(stub(shard), SliceChunks(0, 0, unit, slice, int8));
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.response.disposition(), v1::PushResponse::ACCEPTED) << ok.response.detail();
}

TEST_F(BadInputTest, AQuantizedPushFlaggedNonFiniteSkipsTheStep) {
  ASSERT_NO_FATAL_FAILURE(Start());
  auto int4_client = cluster_->Connect(0, WireEncodings(WireEncoding::kFp32, WireEncoding::kInt4, kBlock));
  ASSERT_TRUE(int4_client.ok()) << int4_client.status();
  const Snapshot initial = TakeSnapshot();
  const int unit = 1;
  const int shard = 0;
  std::vector<float> slice = ReferenceSlice(0, 0, unit, shard);
  slice[5] = std::numeric_limits<float>::infinity();
  const std::vector<v1::PushChunk> chunks = SliceChunks(0, 0, unit, slice, WireFormat(WireEncoding::kInt4, kBlock));
  ASSERT_TRUE(chunks[0].non_finite());
  const PushResult r = RawPush(stub(shard), chunks);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.response.disposition(), v1::PushResponse::ACCEPTED_NON_FINITE);
  pushed_.insert({0, unit, shard});
  // Rank 0 pushes fp32 again for the rest of the step.
  auto fp32_client = cluster_->Connect(0, WireEncoding::kFp32);
  ASSERT_TRUE(fp32_client.ok()) << fp32_client.status();
  ASSERT_NO_FATAL_FAILURE(FinishStepByHand(0));
  for (int s = 0; s < kShards; ++s) {
    const v1::StatusResponse status = GetStatus(s);
    EXPECT_EQ(status.current_step(), 1) << "shard " << s;
    EXPECT_EQ(status.skipped_steps(), 1) << "shard " << s;
  }
  auto weights = cluster_->ReadMasterWeights();
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_TRUE(BitIdentical(*weights, initial.weights)) << "a skipped step changed the weights";
}

TEST_F(BadInputTest, ChunksOutOfOrderAreRefused) {
  ASSERT_NO_FATAL_FAILURE(Start());
  const Snapshot before = TakeSnapshot();
  const int unit = 0;
  const int shard = 0;
  const std::vector<v1::PushChunk> good = SliceChunks(0, 0, unit, ReferenceSlice(0, 0, unit, shard));
  ASSERT_GT(good.size(), 2u);
  {
    std::vector<v1::PushChunk> chunks = good;  // chunk 1 skipped
    chunks.erase(chunks.begin() + 1);
    chunks[1].set_offset(good[1].offset());
    EXPECT_STATUS(RawPush(stub(shard), chunks).status, INVALID_ARGUMENT,
                  "chunk 2 arrived where chunk 1 was due");
  }
  {
    std::vector<v1::PushChunk> chunks = good;  // chunks 0 and 1 swapped
    std::swap(chunks[0], chunks[1]);
    EXPECT_STATUS(RawPush(stub(shard), chunks).status, INVALID_ARGUMENT,
                  "chunk 1 arrived where chunk 0 was due");
  }
  {
    std::vector<v1::PushChunk> chunks = good;  // chunk 1 sent twice
    chunks.insert(chunks.begin() + 2, chunks[1]);
    EXPECT_STATUS(RawPush(stub(shard), chunks).status, INVALID_ARGUMENT,
                  "chunk 1 arrived where chunk 2 was due");
  }
  {
    std::vector<v1::PushChunk> chunks = good;  // a later chunk names another unit
    chunks[1].set_unit(unit + 1);
    EXPECT_STATUS(RawPush(stub(shard), chunks).status, INVALID_ARGUMENT, "identity");
  }
  ExpectUnchanged(before);
  ExpectCleanPushAccepted(0, 0, unit, shard);
  CompleteStep(0);
  CompleteStep(1);
}

TEST_F(BadInputTest, DeadlineNamesWhatTheStepWaitsFor) {
  LocalCluster::Options options;
  options.fetch_wait_limit = absl::Seconds(1);
  ASSERT_NO_FATAL_FAILURE(Start(options));
  ASSERT_NO_FATAL_FAILURE(RunTrainers(0, {0}));  // trainer 1 sends nothing
  for (int shard = 0; shard < kShards; ++shard) {
    const absl::Time start = absl::Now();
    const grpc::Status s = RawFetch(stub(shard), 1, 1);
    EXPECT_STATUS(s, DEADLINE_EXCEEDED, "trainer 1");
    EXPECT_THAT(s.error_message(), HasSubstr("step 0"));
    EXPECT_THAT(s.error_message(), HasSubstr("unit 1 version 1"));
    EXPECT_THAT(s.error_message(), Not(HasSubstr("trainer 0")));
    // The server's limit answered, long before the client's own deadline.
    EXPECT_LT(absl::Now() - start, kRpcTimeout / 2);
    EXPECT_THAT(GetStatus(shard).waiting_for(), HasSubstr("no gradient from trainer 1"));
  }
  CompleteStep(0, {1});
}

TEST_F(BadInputTest, ClientDeadlineGetsTheServersExplanation) {
  ASSERT_NO_FATAL_FAILURE(Start());  // the server's own limit is far away
  ASSERT_NO_FATAL_FAILURE(RunTrainers(0, {0}));
  const absl::Duration client_deadline = absl::Seconds(5);
  const absl::Time start = absl::Now();
  const grpc::Status s = RawFetch(stub(1), 2, 1, v1::ENCODING_BF16, start + client_deadline);
  // The server answers a moment before the client would give up, so the
  // client learns why rather than a bare "Deadline Exceeded".
  EXPECT_STATUS(s, DEADLINE_EXCEEDED, "no gradient from trainer 1");
  EXPECT_THAT(s.error_message(), HasSubstr("step 0"));
  EXPECT_LT(absl::Now() - start, client_deadline + absl::Seconds(1));
  CompleteStep(0, {1});
}

}  // namespace
}  // namespace pshard::testing
