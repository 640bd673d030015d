// A job's weights taken out of pshard and its checkpoints moved between
// shard counts: `pshard export` (from live servers or a checkpoint folder,
// to one safetensors file) and `pshard reshard` (N shards' checkpoints to
// N' shards').
#ifndef PSHARD_TOOLS_WEIGHTS_H_
#define PSHARD_TOOLS_WEIGHTS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/model_spec.h"
#include "common/safetensors.h"
#include "common/security/security.h"

namespace pshard {

/// The weights of a job at one step: its layout and every unit's fp32
/// master values, unpadded. A plain value.
struct JobWeights {
  ModelSpec layout;
  int64_t step = 0;
  std::vector<std::vector<float>> units;
};

/// From the checkpoint of `step` (-1: the newest complete one) of
/// `num_shards` servers (0: the folder's only count) in `dir`.
absl::StatusOr<JobWeights> WeightsFromCheckpoints(const std::string& dir, int num_shards = 0, int64_t step = -1);

/// From a running job: every shard server (found from `address`, any one
/// of them), read at one version, the one they are all at; if training
/// moves on while it reads, it starts again (a few times at most, then
/// Aborted). `security`: the reader's credentials (null: plaintext).
absl::StatusOr<JobWeights> WeightsFromServers(const std::string& address,
                                              std::shared_ptr<const ClientSecurity> security,
                                              absl::Duration timeout);

/// From a file WriteWeightsFile wrote: its layout (metadata "layout", or,
/// for a file without it, the GPT its "model" words name), checked against
/// its "layout_fingerprint", and its tensors (F32, or BF16 widened).
/// InvalidArgument when the file does not say its layout or does not match
/// it; NotFound when it cannot be read.
absl::StatusOr<JobWeights> WeightsFromFile(const std::string& path);

/// Writes the weights as one safetensors file: a tensor per tensor of the
/// layout, in its order, named as the layout names them, in `dtype` (bf16:
/// rounded to nearest even); metadata "step", "layout_fingerprint" (0x and
/// 16 hex digits), "model" (the layout's words) and "layout" (the layout
/// document, on one line); for a GPT's layout also "architecture" (the
/// computation, in words: docs/gpt.md) and its sizes "gpt.layers",
/// "gpt.d_model", "gpt.heads", "gpt.context", "gpt.vocab",
/// "gpt.layer_norm_eps". Whole or not at all.
absl::Status WriteWeightsFile(const JobWeights& weights, SafetensorsDtype dtype, const std::string& path);

/// Writes the checkpoint of `step` (-1: the newest complete one) of
/// `from_shards` servers (0: the only count) in `from` as the checkpoint of
/// `to_shards` servers into the new folder `to` (absent, or empty). Every
/// input file is read and checked first: on any error nothing is written.
/// Training resumed from the result is bit-identical to training that
/// never changed N.
absl::Status ReshardCheckpoints(const std::string& from, int from_shards, int64_t step, const std::string& to,
                                int to_shards);

}  // namespace pshard

#endif  // PSHARD_TOOLS_WEIGHTS_H_
