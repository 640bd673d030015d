#include "tools/weights.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "common/bf16.h"
#include "common/initial_weights.h"
#include "common/layout_file.h"
#include "common/status_macros.h"
#include "shard_server/checkpoint_set.h"
#include "tools/cluster_status.h"
#include "trainer_client/model/gpt_spec.h"
#include "trainer_client/shard_client.h"

namespace pshard {

absl::StatusOr<JobWeights> WeightsFromCheckpoints(const std::string& dir, int num_shards, int64_t step) {
  ASSIGN_OR_RETURN(JobCheckpoint checkpoint, ReadJobCheckpoint(dir, num_shards, step));
  return JobWeights{std::move(checkpoint.layout), checkpoint.step, std::move(checkpoint.master)};
}

absl::StatusOr<JobWeights> WeightsFromServers(const std::string& address,
                                              std::shared_ptr<const ClientSecurity> security,
                                              absl::Duration timeout) {
  ASSIGN_OR_RETURN(const std::vector<std::string> addresses,
                   DiscoverShardAddresses(address, timeout, security.get()));
  constexpr int kAttempts = 4;
  absl::Status last;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    ShardClient::Options options;
    options.server_addresses = addresses;
    options.trainer_rank = -1;
    options.encodings = WireEncoding::kFp32;
    options.transport = "grpc";
    options.join_timeout = timeout;
    options.rpc_timeout = timeout;
    options.security = security;
    options.join_log = [](const std::string&) {};
    ASSIGN_OR_RETURN(std::unique_ptr<ShardClient> client, ShardClient::Connect(std::move(options)));
    JobWeights weights;
    weights.layout = client->job().model;
    weights.step = client->joined_step();
    last = absl::OkStatus();
    for (size_t u = 0; u < weights.layout.units.size() && last.ok(); ++u) {
      absl::StatusOr<std::vector<float>> unit = client->ReadMasterUnit(static_cast<int>(u), weights.step);
      if (unit.ok()) {
        weights.units.push_back(*std::move(unit));
      } else {
        last = unit.status();
      }
    }
    if (last.ok()) return weights;
    // The job moved past the version while it was read: read the next.
    if (!absl::IsFailedPrecondition(last) && !absl::IsAborted(last)) return last;
  }
  return absl::AbortedError(absl::StrCat("the job moved on while its weights were read, ", kAttempts,
                                         " times (", last.message(),
                                         "); export from its checkpoint folder instead"));
}

absl::Status WriteWeightsFile(const JobWeights& weights, SafetensorsDtype dtype, const std::string& path) {
  if (weights.units.size() != weights.layout.units.size()) {
    return absl::InvalidArgumentError("the weights do not hold one vector per unit of the layout");
  }
  std::vector<std::vector<uint16_t>> bf16;  // the rounded copies, when asked for
  std::vector<SafetensorsTensorView> views;
  for (size_t u = 0; u < weights.units.size(); ++u) {
    const UnitSpec& unit = weights.layout.units[u];
    const std::vector<float>& values = weights.units[u];
    if (static_cast<int64_t>(values.size()) < unit.numel) {
      return absl::InvalidArgumentError(absl::StrCat("unit ", unit.name, " holds ", values.size(), " values, not ",
                                                     unit.numel));
    }
    for (const TensorSpec& t : unit.tensors) {
      const float* data = values.data() + t.offset;
      std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(data), t.numel * sizeof(float));
      if (dtype == SafetensorsDtype::kBF16) {
        std::vector<uint16_t>& rounded = bf16.emplace_back(t.numel);
        for (int64_t i = 0; i < t.numel; ++i) rounded[i] = FloatToBf16(data[i]);
        bytes = {reinterpret_cast<const uint8_t*>(rounded.data()), rounded.size() * sizeof(uint16_t)};
      }
      views.push_back({t.name, dtype, t.shape, bytes});
    }
  }
  std::map<std::string, std::string> metadata = {
      {"step", absl::StrCat(weights.step)},
      {"layout_fingerprint", FingerprintHex(LayoutFingerprint(weights.layout))},
      {"model", weights.layout.model},
      {"layout", std::string(absl::StripTrailingAsciiWhitespace(FormatLayoutJson(weights.layout, /*one_line=*/true)))}};
  if (absl::StatusOr<GptConfig> gpt = GptConfigFromSpec(weights.layout); gpt.ok()) {
    metadata["architecture"] = kGptArchitecture;
    metadata["gpt.layers"] = absl::StrCat(gpt->num_layers);
    metadata["gpt.d_model"] = absl::StrCat(gpt->d_model);
    metadata["gpt.heads"] = absl::StrCat(gpt->num_heads);
    metadata["gpt.context"] = absl::StrCat(gpt->context);
    metadata["gpt.vocab"] = absl::StrCat(gpt->vocab);
    metadata["gpt.layer_norm_eps"] = "1e-05";
  }
  return WriteSafetensors(path, views, metadata);
}

absl::StatusOr<JobWeights> WeightsFromFile(const std::string& path) {
  ASSIGN_OR_RETURN(const SafetensorsIndex index, ReadSafetensorsIndex(path));
  auto meta = [&](const std::string& key) -> const std::string* {
    auto it = index.metadata.find(key);
    return it == index.metadata.end() ? nullptr : &it->second;
  };
  JobWeights weights;
  if (const std::string* layout = meta("layout")) {
    absl::StatusOr<ModelSpec> spec = ParseLayoutJson(*layout);
    if (!spec.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": its \"layout\" metadata: ", spec.status().message()));
    }
    weights.layout = *std::move(spec);
  } else if (const std::string* model = meta("model")) {
    // An export of before the layout was written into the file: a GPT's
    // words are enough to make its layout again.
    absl::StatusOr<GptConfig> gpt = ParseGptModelName(*model);
    if (!gpt.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(path, " has no \"layout\" metadata, and its model \"", *model,
                                                     "\" is not a GPT's: pshard cannot tell its layout"));
    }
    ASSIGN_OR_RETURN(weights.layout, MakeGptSpec(*gpt));
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " does not say its layout (no \"layout\" or \"model\" metadata): pshard reads the files "
              "`pshard export` writes; a file of given weights starts a job with --layout and --init_from"));
  }
  if (const std::string* fingerprint = meta("layout_fingerprint");
      fingerprint != nullptr && *fingerprint != FingerprintHex(LayoutFingerprint(weights.layout))) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": its layout's fingerprint is ",
                                                   FingerprintHex(LayoutFingerprint(weights.layout)),
                                                   ", the file says ", *fingerprint, ": the metadata was changed"));
  }
  if (const std::string* step = meta("step"); step == nullptr || !absl::SimpleAtoi(*step, &weights.step)) {
    weights.step = 0;
  }
  ASSIGN_OR_RETURN(const InitialWeights file, InitialWeights::Load(path, weights.layout));
  for (const UnitSpec& unit : weights.layout.units) {
    std::vector<float>& values = weights.units.emplace_back(unit.numel);
    RETURN_IF_ERROR(file.ReadUnitRange(unit, 0, values));
  }
  return weights;
}

absl::Status ReshardCheckpoints(const std::string& from, int from_shards, int64_t step, const std::string& to,
                                int to_shards) {
  if (to_shards < 1) return absl::InvalidArgumentError(absl::StrCat("cannot reshard to ", to_shards, " shards"));
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists(to, ec) && (!fs::is_directory(to, ec) || !fs::is_empty(to, ec))) {
    return absl::FailedPreconditionError(
        absl::StrCat(to, " exists and is not an empty folder: reshard writes a new checkpoint folder"));
  }
  if (!from.empty() && fs::exists(to, ec) && fs::equivalent(from, to, ec)) {
    return absl::InvalidArgumentError("reshard writes into another folder than it reads");
  }
  // Everything is read and checked before anything is written.
  ASSIGN_OR_RETURN(const JobCheckpoint checkpoint, ReadJobCheckpoint(from, from_shards, step));
  // Written beside the destination, then renamed into place: a folder that
  // appears is complete.
  const fs::path target = fs::absolute(to, ec);
  const fs::path partial = target.parent_path() / absl::StrCat(".", target.filename().string(), ".partial-", getpid());
  fs::remove_all(partial, ec);
  if (absl::Status s = WriteJobCheckpoint(checkpoint, to_shards, partial.string()); !s.ok()) {
    fs::remove_all(partial, ec);
    return s;
  }
  fs::remove(target, ec);  // an empty folder, if any
  fs::rename(partial, target, ec);
  if (ec) {
    const absl::Status s = absl::InternalError(absl::StrCat("cannot move ", partial.string(), " to ", to, ": ",
                                                            ec.message()));
    fs::remove_all(partial, ec);
    return s;
  }
  return absl::OkStatus();
}

}  // namespace pshard
