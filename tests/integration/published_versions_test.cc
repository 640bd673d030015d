// A version's published bytes outlive every fetch that sends from them: fetches
// that read slowly while the next versions are published, and fetches whose
// trainer goes away half-way, leave every other fetch of the same version with
// exactly that version's bytes (checksum and values), in both encodings.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checksum.h"
#include "common/status_macros.h"
#include "common/wire_encoding.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/rpc_util.h"
#include "proto/shard.grpc.pb.h"
#include "tests/testutil/cluster_training.h"
#include "tests/testutil/local_cluster.h"
#include "tests/testutil/tiny_job.h"

namespace pshard::testing {
namespace {

// A raw Fetch stream of one slice, read chunk by chunk at the caller's pace.
class SlowFetch {
 public:
  SlowFetch(const std::string& address, int unit, int64_t version, WireEncoding encoding)
      : encoding_(encoding),
        stub_(v1::ShardService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::FetchRequest request;
    request.set_unit(unit);
    request.set_version(version);
    request.set_encoding(EncodingToProto(encoding));
    request.set_trainer_rank(-1);
    reader_ = stub_->Fetch(&ctx_, request);
  }
  // Reads the first chunk (the version is then published and held).
  bool ReadFirst() {
    v1::FetchChunk chunk;
    if (!reader_->Read(&chunk)) return false;
    checksum_ = chunk.checksum();
    Take(chunk);
    return true;
  }
  // The trainer goes away half-way.
  void Cancel() { ctx_.TryCancel(); }
  // Reads the rest; the slice decoded to fp32, or an error.
  absl::StatusOr<std::vector<float>> ReadRest() {
    v1::FetchChunk chunk;
    while (reader_->Read(&chunk)) Take(chunk);
    RETURN_IF_ERROR(FromGrpcStatus(reader_->Finish()));
    if (Crc32c(bytes_.data(), bytes_.size()) != checksum_) return absl::DataLossError("checksum mismatch");
    std::vector<float> values(bytes_.size() / (encoding_ == WireEncoding::kBf16 ? 2 : 4));
    DecodeElements(encoding_, reinterpret_cast<const std::byte*>(bytes_.data()), values);
    return values;
  }

 private:
  void Take(const v1::FetchChunk& chunk) { bytes_ += chunk.data(); }

  const WireEncoding encoding_;
  std::unique_ptr<v1::ShardService::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::FetchChunk>> reader_;
  uint32_t checksum_ = 0;
  std::string bytes_;
};

TEST(PublishedVersionsTest, SlowAndAbandonedFetchesNeverSeeAnotherVersionsBytes) {
  constexpr int kSteps = 4;
  constexpr int kReaders = 12;
  LocalCluster::Options options;
  options.fetch_chunk_bytes = 16 << 10;
  // Slices of several MiB: far more than gRPC's flow-control window, so a
  // reader that pauses gets most of its chunks after the step is applied.
  JobConfig job = TinyGptJob(2, 1, kSteps);
  job.model = MakeGptSpec(GptConfig{.num_layers = 1, .d_model = 512, .num_heads = 8, .context = 8, .vocab = 256})
                  .value();
  auto cluster = LocalCluster::Start(job, options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto reader = (*cluster)->Connect(-1, WireEncoding::kFp32);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const int units = static_cast<int>((*reader)->layout().spec.units.size());
  for (int64_t version = 0; version < kSteps; ++version) {
    SCOPED_TRACE(absl::StrCat("version ", version));
    // What each unit's slice of shard 0 holds at this version.
    std::vector<std::vector<float>> want(units);
    for (int u = 0; u < units; ++u) {
      auto [at, master] = (*cluster)->server(0).state().ReadMaster(u);
      ASSERT_EQ(at, version);
      want[u] = std::move(master);
    }
    std::vector<std::unique_ptr<SlowFetch>> fetches;
    for (int i = 0; i < kReaders; ++i) {
      const WireEncoding e = i % 2 == 0 ? WireEncoding::kFp32 : WireEncoding::kBf16;
      fetches.push_back(
          std::make_unique<SlowFetch>((*cluster)->addresses()[0], i % units, version, e));
      ASSERT_TRUE(fetches.back()->ReadFirst()) << "fetch " << i;
    }
    for (int i = 0; i < kReaders; i += 3) fetches[i]->Cancel();
    // The step is applied and the next version published while they read.
    ClusterTraining how;
    how.trainer = TinyTrainerOptions(7);
    how.first_step = version;
    how.steps = version + 1;
    ASSERT_TRUE(TrainInThreads(**cluster, 1, TestCorpus(), how).ok());
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    for (int s = 0; s < (*cluster)->num_shards(); ++s) {
      ShardState& state = (*cluster)->server(s).state();
      while (state.ReadMaster(state.num_units() - 1).first <= version) {  // units publish in order
        ASSERT_LT(absl::Now(), deadline) << "shard " << s << " did not apply step " << version;
        absl::SleepFor(absl::Milliseconds(5));
      }
    }
    for (int i = 0; i < kReaders; ++i) {
      if (i % 3 == 0) continue;  // cancelled
      absl::StatusOr<std::vector<float>> got = fetches[i]->ReadRest();
      ASSERT_TRUE(got.ok()) << "fetch " << i << ": " << got.status();
      std::vector<float> expected = want[i % units];
      RoundTripInPlace(i % 2 == 0 ? WireEncoding::kFp32 : WireEncoding::kBf16, expected);
      EXPECT_EQ(*got, expected) << "fetch " << i << " saw bytes of another version";
    }
  }
}

}  // namespace
}  // namespace pshard::testing
