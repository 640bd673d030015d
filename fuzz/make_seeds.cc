// Writes the harnesses' seed corpora, one folder per harness, from the
// fuzz job's real layout: well-formed requests of every rpc (with a few
// refused ones beside them), pushes that close a step in each encoding,
// real checkpoint files, topologies and container environments.
//   pshard-fuzz-seeds OUT      (the committed ones: fuzz/corpus)
// The fuzzers take any input; seeds only start them where the code is.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/wire_encoding.h"
#include "fuzz/harness.h"
#include "fuzz/in_process_shard.h"
#include "fuzz/service_checks.h"
#include "common/layout_file.h"
#include "common/safetensors.h"
#include "common/square_sum.h"
#include "common/ucx/ucx_wire.h"
#include "proto/rpc_util.h"
#include "proto/shard.pb.h"

namespace pshard::fuzz {
namespace {

constexpr uint8_t kTrainer = static_cast<uint8_t>(Caller::kTrainer);
constexpr uint8_t kServer = static_cast<uint8_t>(Caller::kServer);
constexpr uint8_t kReader = static_cast<uint8_t>(Caller::kReader);
constexpr uint8_t kNoToken = static_cast<uint8_t>(Caller::kNoToken);
// The top two bits of a choices byte: frames cut into pieces of 5 or 64 bytes.
constexpr uint8_t kPieces5 = 2 << 6, kPieces64 = 3 << 6;
// Elements per pushed chunk.
constexpr int64_t kChunkElements = 256;

class Corpus {
 public:
  explicit Corpus(std::filesystem::path root) : root_(std::move(root)) {}
  void Add(const std::string& harness, const std::string& name, const std::string& bytes) {
    const std::filesystem::path dir = root_ / harness;
    std::filesystem::create_directories(dir);
    std::ofstream(dir / name, std::ios::binary) << bytes;
  }

 private:
  std::filesystem::path root_;
};

std::string Bytes(const google::protobuf::MessageLite& message) { return message.SerializeAsString(); }

// Slice lengths of shard 0, the shard every harness serves.
std::vector<int64_t> SliceLengths() {
  InProcessShard shard;
  std::vector<int64_t> lengths;
  for (int u = 0; u < shard.state().num_units(); ++u) lengths.push_back(shard.state().slice_length(u));
  return lengths;
}

struct PushSpec {
  int rank = 0;
  int rank_count = 1;
  int unit = 0;
  WireFormat format;
  float poison = 0;  // written into element 3 when not 0 (NaN, infinity)
  bool non_finite = false;
  int64_t step = 0;
};

// The frames of one push of a whole slice, as a trainer sends them.
std::vector<std::string> PushFrames(const PushSpec& p, int64_t length) {
  std::vector<float> gradient(static_cast<size_t>(length));
  for (int64_t i = 0; i < length; ++i) gradient[i] = 0.01f * std::sin(0.1f * static_cast<float>(i + p.unit + p.rank));
  if (p.poison != 0 && length > 3) gradient[3] = p.poison;
  const int64_t per_chunk = kChunkElements / static_cast<int64_t>(p.format.GrainElements()) *
                            static_cast<int64_t>(p.format.GrainElements());
  std::vector<std::string> frames;
  int index = 0;
  for (int64_t offset = 0; offset < length; offset += per_chunk, ++index) {
    const int64_t count = std::min(per_chunk, length - offset);
    v1::PushChunk c;
    c.set_trainer_rank(p.rank);
    c.set_rank_count(p.rank_count);
    c.set_step(p.step);
    c.set_unit(p.unit);
    c.set_encoding(EncodingToProto(p.format.encoding()));
    c.set_quant_block(p.format.quantized() ? p.format.block() : 0);
    c.set_non_finite(p.non_finite);
    c.set_chunk_index(index);
    c.set_offset(offset);
    c.set_slice_length(length);
    std::string* data = c.mutable_data();
    data->resize(p.format.EncodedBytes(static_cast<size_t>(count)));
    EncodeElements(p.format, std::span<const float>(gradient).subspan(offset, count),
                   reinterpret_cast<std::byte*>(data->data()));
    frames.push_back(Bytes(c));
  }
  return frames;
}

// Records of pushes one after another (an empty record between two).
std::vector<std::string> PushRecords(const std::vector<PushSpec>& pushes, const std::vector<int64_t>& lengths) {
  std::vector<std::string> records;
  for (const PushSpec& p : pushes) {
    if (!records.empty()) records.emplace_back();
    for (std::string& f : PushFrames(p, lengths[p.unit])) records.push_back(std::move(f));
  }
  return records;
}

// Every unit from trainers [0, 2) in one push each (rank_count 2), or from
// each trainer on its own.
std::vector<PushSpec> WholeStep(const WireFormat& format, bool summed, int num_units, int64_t step = 0) {
  std::vector<PushSpec> pushes;
  for (int rank = 0; rank < (summed ? 1 : 2); ++rank) {
    for (int u = 0; u < num_units; ++u) {
      PushSpec p{rank, summed ? 2 : 1, u, format};
      p.step = step;
      pushes.push_back(p);
    }
  }
  return pushes;
}

void AddPushes(Corpus& corpus, const std::vector<int64_t>& lengths) {
  const int units = static_cast<int>(lengths.size());
  const WireFormat fp32(WireEncoding::kFp32), bf16(WireEncoding::kBf16), int8(WireEncoding::kInt8, 64),
      int4(WireEncoding::kInt4, 32);
  auto add = [&](const std::string& name, uint8_t choices, const std::vector<PushSpec>& pushes) {
    corpus.Add("push", name, FuzzRecords(choices, PushRecords(pushes, lengths)));
  };
  add("step_fp32_summed", kTrainer, WholeStep(fp32, true, units));
  add("step_bf16_each_trainer", kTrainer | kPieces5, WholeStep(bf16, false, units));
  add("step_int8_summed", kTrainer | kPieces64, WholeStep(int8, true, units));
  std::vector<PushSpec> skipped = WholeStep(fp32, true, units);
  skipped[1].poison = NAN;
  add("step_with_nan", kTrainer, skipped);
  std::vector<PushSpec> reported = WholeStep(int4, true, units);
  reported[0].non_finite = true;
  add("step_int4_non_finite", kTrainer, reported);
  std::vector<PushSpec> overflow = WholeStep(fp32, false, units);
  overflow[0].poison = 3e38f;
  overflow[units].poison = 3e38f;  // the same element from the other trainer: the sum overflows
  add("step_overflowing_sum", kTrainer, overflow);
  add("duplicate", kTrainer, {{0, 1, 0, fp32}, {0, 1, 0, fp32}});
  add("from_a_reader", kReader, {{0, 1, 2, bf16}});
  // A push whose second chunk claims another unit, and one of a wrong length.
  std::vector<std::string> records = PushFrames({0, 1, 2, fp32}, lengths[2]);
  v1::PushChunk changed;
  changed.ParseFromString(records[1]);
  changed.set_unit(3);
  records[1] = Bytes(changed);
  v1::PushChunk short_slice;
  short_slice.ParseFromString(PushFrames({1, 1, 1, fp32}, lengths[1])[0]);
  short_slice.set_slice_length(lengths[1] - 8);
  records.emplace_back();
  records.push_back(Bytes(short_slice));
  corpus.Add("push", "refused", FuzzRecords(kTrainer, records));
}

v1::FetchRequest Fetch(int unit, int64_t version, v1::Encoding encoding, int block = 0) {
  v1::FetchRequest f;
  f.set_unit(unit);
  f.set_version(version);
  f.set_encoding(encoding);
  f.set_quant_block(block);
  f.set_trainer_rank(0);
  return f;
}

void AddFetches(Corpus& corpus, int units) {
  std::vector<std::string> all;
  for (int u = 0; u < units; ++u) all.push_back(Bytes(Fetch(u, 0, v1::ENCODING_FP32)));
  corpus.Add("fetch", "every_unit_fp32", FuzzRecords(kTrainer, all));
  corpus.Add("fetch", "encodings",
             FuzzRecords(kTrainer, {Bytes(Fetch(0, 0, v1::ENCODING_BF16)), Bytes(Fetch(1, 0, v1::ENCODING_INT8, 64)),
                                    Bytes(Fetch(2, 0, v1::ENCODING_INT8, 16)), Bytes(Fetch(3, 0, v1::ENCODING_BF16))}));
  corpus.Add("fetch", "versions",
             FuzzRecords(kTrainer, {Bytes(Fetch(0, 1, v1::ENCODING_FP32)), Bytes(Fetch(1, 3, v1::ENCODING_FP32)),
                                    Bytes(Fetch(2, -1, v1::ENCODING_FP32))}));
  corpus.Add("fetch", "refused",
             FuzzRecords(kTrainer, {Bytes(Fetch(units, 0, v1::ENCODING_FP32)),
                                    Bytes(Fetch(0, 0, v1::ENCODING_INT4, 64)),
                                    Bytes(Fetch(1, 0, v1::ENCODING_INT8, 3)), "\x08"}));
  v1::FetchRequest tool = Fetch(2, 0, v1::ENCODING_BF16);
  tool.set_trainer_rank(-1);
  corpus.Add("fetch", "from_a_reader", FuzzRecords(kReader, {Bytes(tool)}));
}

void AddJoins(Corpus& corpus) {
  v1::JoinRequest first, quantized, reader, again, outside;
  first.set_trainer_rank(0);
  first.set_metrics_address("10.0.0.5:9401");
  quantized.set_trainer_rank(1);
  quantized.set_grad_encoding(v1::ENCODING_INT8);
  quantized.set_quant_block(64);
  reader.set_trainer_rank(-1);
  again.set_trainer_rank(0);
  again.set_metrics_address("10.0.0.6:9401");
  again.set_grad_encoding(v1::ENCODING_BF16);
  outside.set_trainer_rank(2);
  corpus.Add("join", "trainers", FuzzRecords(kTrainer, {Bytes(first), Bytes(quantized), Bytes(again), Bytes(outside)}));
  corpus.Add("join", "reader", FuzzRecords(kReader, {Bytes(reader), Bytes(first)}));
  corpus.Add("join", "no_token", FuzzRecords(kNoToken, {Bytes(first)}));
}

// A report whose sum of squares is that of the one value `gradient`.
v1::NormReport Report(int shard, int64_t step, float gradient, std::vector<int64_t> checkpoints) {
  v1::NormReport r;
  r.set_shard_index(shard);
  r.set_step(step);
  SquareSum sum;
  sum.AddSquares(std::span<const float>(&gradient, 1));
  r.set_sum_of_squares(sum.ToBytes());
  r.set_job_fingerprint(JobFingerprint(FuzzJob()));
  for (int64_t s : checkpoints) r.add_checkpoint_steps(s);
  return r;
}

void AddNorms(Corpus& corpus) {
  corpus.Add("agree_norm", "both_shards",
             FuzzRecords(kServer, {Bytes(Report(0, 0, 1.5f, {2, 4})), Bytes(Report(1, 0, 2.25f, {4}))}));
  v1::NormReport stranger = Report(1, 0, 1, {});
  stranger.set_job_fingerprint(7);
  v1::NormReport non_finite = Report(0, 1, 0, {});
  non_finite.set_non_finite(true);
  corpus.Add("agree_norm", "refused_and_waiting",
             FuzzRecords(kServer, {Bytes(stranger), Bytes(Report(1, 9, 1, {})), Bytes(Report(0, 0, 1, {3, 1})),
                                   Bytes(non_finite)}));
  corpus.Add("agree_norm", "from_a_trainer", FuzzRecords(kTrainer, {Bytes(Report(0, 0, 1, {}))}));
}

void AddStatus(Corpus& corpus) {
  corpus.Add("get_status", "reader", FuzzRecords(kReader, {""}));
  corpus.Add("get_status", "trainer_twice", FuzzRecords(kTrainer, {"", ""}));
  corpus.Add("get_status", "no_token", FuzzRecords(kNoToken, {""}));
}

void AddAnnouncements(Corpus& corpus) {
  v1::AnnounceRequest a;
  a.set_shard_index(1);
  a.set_port(7071);
  a.set_advertised_address("10.0.0.2:7071");
  a.set_job_fingerprint(JobFingerprint(FuzzJob()));
  v1::AnnounceRequest from_peer = a, itself = a, stranger = a;
  from_peer.clear_advertised_address();
  itself.set_shard_index(0);
  stranger.set_job_fingerprint(1);
  corpus.Add("announce", "shard_1", FuzzRecords(kServer, {Bytes(a)}));
  corpus.Add("announce", "refused", FuzzRecords(kServer, {Bytes(from_peer), Bytes(itself), Bytes(stranger)}));
  corpus.Add("announce", "from_a_trainer", FuzzRecords(kTrainer, {Bytes(a)}));
}

void AddPages(Corpus& corpus, const std::vector<int64_t>& lengths) {
  auto page = [](int unit, int64_t offset, int64_t max) {
    v1::ReadMasterRequest r;
    r.set_unit(unit);
    r.set_offset(offset);
    r.set_max_elements(max);
    return Bytes(r);
  };
  corpus.Add("read_master", "pages",
             FuzzRecords(kReader,
                         {page(0, 0, 0), page(1, 100, 16), page(3, lengths[3], 0), page(2, lengths[2] - 5, 0)}));
  corpus.Add("read_master", "refused", FuzzRecords(kReader, {page(2, -1, 0), page(9, 0, 0), page(0, 0, -4)}));
}

std::string Post(const std::string& group, int member, int size, const std::string& payload) {
  v1::RendezvousRequest r;
  r.set_group(group);
  r.set_member(member);
  r.set_size(size);
  r.set_payload(payload);
  return Bytes(r);
}

void AddRendezvous(Corpus& corpus) {
  corpus.Add("rendezvous", "pair",
             FuzzRecords(kTrainer,
                         {Post("fabric:0,1", 0, 2, "10.0.0.1:29500"), Post("fabric:0,1", 1, 2, "10.0.0.2:29500")}));
  corpus.Add("rendezvous", "incomplete",
             FuzzRecords(kTrainer,
                         {Post("g", 0, 3, "a"), Post("g", 1, 3, "b"), Post("g", 1, 3, "b2"), Post("g", 2, 2, "c")}));
  corpus.Add("rendezvous", "from_a_server", FuzzRecords(kServer, {Post("g", 0, 1, "x")}));
}

v1::RollBackRequest RollBackTo(int64_t step, int rank) {
  v1::RollBackRequest r;
  r.set_step(step);
  r.set_trainer_rank(rank);
  r.set_job_fingerprint(JobFingerprint(FuzzJob()));
  return r;
}

void AddRollBacks(Corpus& corpus) {
  // The choices' bits 3-4: how many steps the shard closes first.
  auto after = [](int steps) { return static_cast<uint8_t>(kTrainer | steps << 3); };
  corpus.Add("rollback", "back_two_steps", FuzzRecords(after(3), {Bytes(RollBackTo(1, 0))}));
  corpus.Add("rollback", "twice", FuzzRecords(after(3), {Bytes(RollBackTo(2, 1)), Bytes(RollBackTo(1, 0))}));
  corpus.Add("rollback", "where_it_is", FuzzRecords(after(2), {Bytes(RollBackTo(2, 0))}));
  v1::RollBackRequest stranger = RollBackTo(1, 0);
  stranger.set_job_fingerprint(3);
  corpus.Add("rollback", "refused",
             FuzzRecords(after(2), {Bytes(stranger), Bytes(RollBackTo(5, 0)), Bytes(RollBackTo(0, 1))}));
  corpus.Add("rollback", "from_a_reader", FuzzRecords(static_cast<uint8_t>(kReader | 2 << 3), {Bytes(RollBackTo(1, 0))}));
}

// A session record: the rpc, then the choices byte (caller, piece size), then the request.
std::string SessionCall(Method method, uint8_t choices, const std::string& request) {
  return std::string{static_cast<char>(method), static_cast<char>(choices)} + request;
}

void AddSessions(Corpus& corpus, const std::vector<int64_t>& lengths) {
  const int units = static_cast<int>(lengths.size());
  v1::JoinRequest join, rejoin;
  join.set_trainer_rank(0);
  rejoin.set_trainer_rank(1);
  // The calls that push step `s` (a push's request is its frames as records).
  auto push_step = [&](int64_t s, std::vector<std::string>& calls) {
    for (const PushSpec& p : WholeStep(WireFormat(WireEncoding::kBf16), true, units, s)) {
      const std::string frames = FuzzRecords(0, PushFrames(p, lengths[p.unit])).substr(1);
      calls.push_back(SessionCall(Method::kPush, kTrainer | kPieces5, frames));
    }
  };
  std::vector<std::string> step = {SessionCall(Method::kJoin, kTrainer, Bytes(join))};
  push_step(0, step);
  for (int u = 0; u < units; ++u) {
    step.push_back(SessionCall(Method::kFetch, kTrainer, Bytes(Fetch(u, 1, v1::ENCODING_INT8, 64))));
  }
  step.push_back(SessionCall(Method::kGetStatus, kReader, ""));
  corpus.Add("session", "join_step_fetch", FuzzRecords(0, step));
  // Two steps, back to the first, trainer 1 refused until it joins again.
  std::vector<std::string> back = {SessionCall(Method::kJoin, kTrainer, Bytes(join))};
  push_step(0, back);
  push_step(1, back);
  back.push_back(SessionCall(Method::kRollBack, kTrainer, Bytes(RollBackTo(1, 0))));
  v1::FetchRequest as_1 = Fetch(2, 1, v1::ENCODING_FP32);
  as_1.set_trainer_rank(1);
  back.push_back(SessionCall(Method::kFetch, kTrainer, Bytes(as_1)));
  back.push_back(SessionCall(Method::kJoin, kTrainer, Bytes(rejoin)));
  back.push_back(SessionCall(Method::kFetch, kTrainer, Bytes(as_1)));
  corpus.Add("session", "roll_back_and_rejoin", FuzzRecords(0, back));
  v1::AnnounceRequest a;
  a.set_shard_index(1);
  a.set_port(7071);
  a.set_advertised_address("10.0.0.2:7071");
  a.set_job_fingerprint(JobFingerprint(FuzzJob()));
  corpus.Add("session", "control",
             FuzzRecords(0, {SessionCall(Method::kAnnounce, kServer, Bytes(a)),
                             SessionCall(Method::kAgreeNorm, kServer, Bytes(Report(1, 0, 1, {}))),
                             SessionCall(Method::kRendezvous, kTrainer, Post("fabric:0", 0, 1, "p")),
                             SessionCall(Method::kReadMaster, kReader, ""),
                             SessionCall(Method::kGetStatus, kServer, "")}));
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void AddCheckpoints(Corpus& corpus, const std::vector<int64_t>& lengths) {
  const std::string dir = ScratchFolder() + "/checkpoints";
  InProcessShard shard;
  absl::StatusOr<std::string> fresh = shard.state().SaveCheckpoint(dir, 4);
  Require(fresh.ok(), fresh.status().ToString());
  // And one of step 1, after a step closed.
  const std::string pushes =
      FuzzRecords(0, PushRecords(WholeStep(WireFormat(), true, static_cast<int>(lengths.size())), lengths));
  FuzzInput input(pushes);
  for (const RawCall& push : PushCalls(input, Caller::kTrainer, 0, 16)) {
    Require(shard.Call(push).status.ok(), "a seed push was refused");
  }
  Require(shard.CloseStepIfComplete(), "the seed pushes did not close the step");
  absl::StatusOr<std::string> stepped = shard.state().SaveCheckpoint(dir, 4);
  Require(stepped.ok(), stepped.status().ToString());
  const std::string file = ReadFile(*fresh);
  const std::string unsealed = file.substr(0, file.size() - 4);
  corpus.Add("checkpoint", "step_0", std::string(1, '\0') + file);
  const std::string step_1 = ReadFile(*stepped);
  corpus.Add("checkpoint", "step_1_unsealed", std::string(1, '\1') + step_1.substr(0, step_1.size() - 4));
  corpus.Add("checkpoint", "step_0_unsealed", std::string(1, '\1') + unsealed);
  // Format 1: its own magic, no schedule end after the three counts.
  uint32_t layout_bytes = 0;
  std::memcpy(&layout_bytes, unsealed.data() + 8, sizeof(layout_bytes));
  const size_t schedule_end = 8 + 4 + layout_bytes + 2 * 4 + 3 * 8;
  std::string v1 = unsealed.substr(0, schedule_end) + unsealed.substr(schedule_end + 8);
  v1[7] = '1';
  corpus.Add("checkpoint", "format_1_unsealed", std::string(1, '\1') + v1);
  corpus.Add("checkpoint", "truncated", std::string(1, '\0') + file.substr(0, 64));
}

void AddTopologies(Corpus& corpus) {
  corpus.Add("topology", "documented", R"({"nodes": [{"name": "a", "servers": ["10.0.0.1:7000"], "trainers": [0, 1]},
           {"name": "b", "servers": ["10.0.0.2:7000"], "trainers": [2]}],
 "fabric_groups": [[0, 1]],
 "links": [{"between": ["a", "b"], "kind": "ethernet", "transport": "grpc", "rate": "10gbit", "delay": "1ms"}]}
)");
  corpus.Add("topology", "three_nodes", R"({
  "nodes": [
    {"name": "a", "servers": ["10.0.0.1:7000"], "trainers": [0, 1]},
    {"name": "b", "servers": ["10.0.0.2:7000"], "trainers": [2, 3]},
    {"name": "c", "servers": ["10.0.0.3:7000"]}
  ],
  "fabric_groups": [[0, 1], [2, 3]],
  "links": [
    {"between": ["a", "b"], "kind": "rdma", "transport": "ucx"},
    {"between": ["c", "a"], "kind": "nvlink", "transport": "auto", "rate": "800kbit"},
    {"between": ["b", "c"], "kind": "infiniband", "delay": "250us"}
  ]
})");
  corpus.Add("topology", "one_node",
             R"({"nodes":[{"name":"solo","servers":["127.0.0.1:7070","127.0.0.1:7071"],"trainers":[0]}]})");
  corpus.Add("topology", "shard_names", R"({"nodes": [{"name": "east", "servers": ["shard:0", "shard:2"], "trainers": [0, 1]},
           {"name": "west", "servers": ["shard:1"], "trainers": [2, 3]}],
 "fabric_groups": [[0, 1], [2, 3]],
 "links": [{"between": ["east", "west"], "kind": "ethernet", "rate": "1gbit", "delay": "20ms"}]}
)");
  corpus.Add("topology", "json_values",
             R"([0, -1.5e-3, 12345678901234567890, true, false, null, )"
             R"("esc \" \\ \/ \b\f\n\r\t \u00e9\u20ac", {"": {}}, [[]]])");
}

void AddEnvironments(Corpus& corpus) {
  corpus.Add("entrypoint", "compose_server",
             "server\nPSHARD_SERVERS=server-0:7070,server-1:7070,server-2:7070\nPSHARD_NUM_TRAINERS=2\n"
             "PSHARD_SHARD_INDEX=1\n@server-1\n!root\n?/etc/pshard/server.flags\n");
  corpus.Add("entrypoint", "k8s_trainer",
             "trainer\n--steps=300\nPSHARD_SERVER_TEMPLATE=pshard-server-{i}.pshard-server:7070\nPSHARD_NUM_SERVERS=4\n"
             "PSHARD_NUM_TRAINERS=8\nJOB_COMPLETION_INDEX=5\nPSHARD_JOIN_TIMEOUT=10m\n@pshard-trainer-5-x7k2q\n");
  corpus.Add("entrypoint", "statefulset_server",
             "PSHARD_ROLE=server\nPSHARD_SERVER_TEMPLATE=pshard-server-{i}.pshard-server:7070\nPSHARD_NUM_SERVERS=4\n"
             "WORLD_SIZE=8\nPSHARD_NUM_TRAINERS=8\nPSHARD_CHECKPOINT_EVERY=50\nPSHARD_RESUME_STEP=100\n"
             "@pshard-server-3\n");
  corpus.Add("entrypoint", "slow_link_trainer",
             "trainer\nPSHARD_SERVERS=s0:7070\nWORLD_SIZE=2\nRANK=1\nPSHARD_RANK=1\nPSHARD_LINK_RATE=50mbit\n"
             "PSHARD_LINK_SHAPER=tc\nPSHARD_LINK_DEVICE=eth1\nPSHARD_PORT=7171\nPSHARD_METRICS_PORT=9500\n!root\n");
  corpus.Add("entrypoint", "tls_health",
             "health\nPSHARD_TLS_DIR=/etc/pshard/tls\nPSHARD_TLS_SERVER_NAME=pshard-server\n?/etc/pshard/tls/tls.crt\n"
             "?/etc/pshard/tls/tls.key\n?/etc/pshard/tls/ca.crt\n");
  corpus.Add("entrypoint", "tokens_trainer",
             "trainer\nPSHARD_SERVERS=a:1,b:2\nPSHARD_NUM_TRAINERS=1\nPSHARD_AUTH_TOKEN_FILE=/run/secrets/tokens\n"
             "?/run/secrets/tokens\nPSHARD_CHECKPOINT_DIR=\n@host-0\n");
}

void AddLayouts(Corpus& corpus) {
  corpus.Add("layout", "fuzz_job", FormatLayoutJson(FuzzJob().model));
  corpus.Add("layout", "fuzz_job_one_line", FormatLayoutJson(FuzzJob().model, /*one_line=*/true));
  corpus.Add("layout", "by_hand", R"({"format": "pshard-layout/1", "model": "mlp",
 "units": [{"name": "fc", "tensors": [
   {"name": "fc.w", "shape": [3, 2], "init": "normal", "std": 0.5, "weight_decay": true},
   {"name": "fc.b", "shape": [3], "init": "zeros"}, {"name": "fc.s", "shape": [], "init": "ones"}]},
  {"name": "out", "tensors": [{"name": "out.w", "shape": [2, 3], "init": "given"}]}]}
)");
}

void AddSafetensors(Corpus& corpus) {
  const std::vector<float> w = {1.5f, -2.25f, 3.0f, 0.0f, -0.0f, 65504.0f}, b = {0.5f, -1.0f, 3.25f};
  const std::vector<uint16_t> b16 = {0x3f00, 0xbf80, 0x4050};
  auto bytes = [](const auto& v) {
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(v[0]));
  };
  // The fuzz harness's small layout (w [2, 3], b [3]), in F32 and in BF16,
  // and a file of another layout.
  const std::vector<SafetensorsTensorView> f32 = {{"w", SafetensorsDtype::kF32, {2, 3}, bytes(w)},
                                                  {"b", SafetensorsDtype::kF32, {3}, bytes(b)}};
  const std::vector<SafetensorsTensorView> mixed = {{"b", SafetensorsDtype::kBF16, {3}, bytes(b16)},
                                                    {"w", SafetensorsDtype::kF32, {2, 3}, bytes(w)}};
  const std::vector<SafetensorsTensorView> other = {{"w", SafetensorsDtype::kF32, {3, 2}, bytes(w)}};
  corpus.Add("safetensors", "layout_f32", *EncodeSafetensors(f32, {{"step", "3"}}));
  corpus.Add("safetensors", "layout_mixed", *EncodeSafetensors(mixed, {}));
  corpus.Add("safetensors", "another_layout", *EncodeSafetensors(other, {{"model", "x"}}));
}

// The UCX harness's records: which handler, whose token, the header's
// length, the header and the data (ucx_fuzzer.cc).
template <typename Header>
std::string UcxRecord(uint8_t which, uint8_t token, const Header& header, const std::string& data = "") {
  std::string record{static_cast<char>(which), static_cast<char>(token), static_cast<char>(sizeof(Header))};
  record.append(reinterpret_cast<const char*>(&header), sizeof(Header));
  return record + data;
}

void AddUcx(Corpus& corpus, const std::vector<int64_t>& lengths) {
  const int units = static_cast<int>(lengths.size());
  uint64_t request = 1;
  auto fetch = [&](uint8_t token, int unit, int64_t version, WireEncoding encoding, int64_t byte_offset = 0,
                   int64_t byte_length = 0) {
    ucx::FetchHeader h;
    h.byte_offset = byte_offset;
    h.byte_length = byte_length;
    h.request_id = request++;
    h.version = version;
    h.wait_ms = 1000;
    h.unit = unit;
    h.encoding = static_cast<int32_t>(EncodingToProto(encoding));
    h.quant_block = 64;
    return UcxRecord(1, token, h);
  };
  auto push = [&](uint8_t token, int rank, int unit, int64_t length_delta) {
    ucx::PushHeader h;
    h.request_id = request++;
    h.slice_length = lengths[unit];
    h.trainer = rank;
    h.unit = unit;
    h.encoding = static_cast<int32_t>(EncodingToProto(WireEncoding::kFp32));
    std::vector<float> values(static_cast<size_t>(lengths[unit] + length_delta), 1e-3f * static_cast<float>(unit + 1));
    return UcxRecord(2, token, h, std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float)));
  };
  const std::string hello = UcxRecord(0, 0, ucx::HelloHeader{.flags = ucx::kHelloSameHost});
  std::vector<std::string> fetches = {hello};
  for (int u = 0; u < units; ++u) {
    fetches.push_back(fetch(0, u, 0, WireEncoding::kFp32));
    fetches.push_back(fetch(2, u, 0, WireEncoding::kInt8));
  }
  fetches.push_back(fetch(0, 0, 1, WireEncoding::kBf16));  // a version not yet published
  fetches.push_back(fetch(3, 0, 0, WireEncoding::kFp32));  // a session never issued
  // Pieces: in the slice, past its end, in bf16 (refused).
  fetches.push_back(fetch(0, 0, 0, WireEncoding::kFp32, 4, 8));
  fetches.push_back(fetch(0, 0, 0, WireEncoding::kFp32, lengths[0] * 4 - 4, 8));
  fetches.push_back(fetch(0, 0, 0, WireEncoding::kBf16, 0, 8));
  corpus.Add("ucx", "fetches", FuzzRecords(0, fetches));
  std::vector<std::string> step = {hello};
  for (int rank = 0; rank < 2; ++rank) {
    for (int u = 0; u < units; ++u) step.push_back(push(static_cast<uint8_t>(rank), rank, u, 0));
  }
  step.push_back(fetch(0, 1, 1, WireEncoding::kFp32));
  corpus.Add("ucx", "step_fp32", FuzzRecords(0, step));
  corpus.Add("ucx", "refused_pushes",
             FuzzRecords(0, {push(2, 0, 0, 0), push(1, 0, 0, 0), push(0, 0, 1, -1), push(3, 0, 0, 0)}));
}

}  // namespace
}  // namespace pshard::fuzz

int main(int argc, char** argv) {
  using namespace pshard::fuzz;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT (the committed seeds: fuzz/corpus)\n", argv[0]);
    return 2;
  }
  Corpus corpus(argv[1]);
  const std::vector<int64_t> lengths = SliceLengths();
  const int units = static_cast<int>(lengths.size());
  AddJoins(corpus);
  AddFetches(corpus, units);
  AddPushes(corpus, lengths);
  AddNorms(corpus);
  AddStatus(corpus);
  AddAnnouncements(corpus);
  AddPages(corpus, lengths);
  AddRendezvous(corpus);
  AddRollBacks(corpus);
  AddSessions(corpus, lengths);
  AddCheckpoints(corpus, lengths);
  AddTopologies(corpus);
  AddEnvironments(corpus);
  AddLayouts(corpus);
  AddSafetensors(corpus);
  AddUcx(corpus, lengths);
  return 0;
}
