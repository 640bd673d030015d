// The data plane between a trainer and one shard server: fetch a slice of a
// unit, push a slice of a gradient. One Transport per (trainer, shard) link;
// gRPC is always there, other backends (UCX) are optional. This header
// includes no backend's headers.
#ifndef PSHARD_TRAINER_CLIENT_TRANSPORT_TRANSPORT_H_
#define PSHARD_TRAINER_CLIENT_TRANSPORT_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/partition.h"
#include "common/wire_encoding.h"

namespace pshard {

/// Called exactly once when a transfer ends, with the bytes it moved.
using TransferDone = std::function<void(absl::Status status, int64_t wire_bytes)>;

struct FetchArgs {
  int unit = 0;
  int64_t version = 0;
  WireFormat format;
  int trainer = 0;    ///< the fetching trainer's rank (-1: a tool)
  SliceRange slice;   ///< this server's slice of the unit
};

struct PushArgs {
  int unit = 0;
  int64_t step = 0;
  WireFormat format;
  int first_rank = 0;  ///< trainers [first_rank, first_rank + rank_count) summed in
  int rank_count = 1;
  int micro_batch = 0;
  SliceRange slice;    ///< this server's slice of the unit
  /// The slice held an infinity or a NaN that `format` cannot carry
  /// (quantized): it is sent as zero blocks, flagged non-finite.
  bool non_finite = false;
};

/// Thread-safe; transfers may overlap.
class Transport {
 public:
  virtual ~Transport() = default;
  /// The label this transport has in metrics ("grpc", "ucx").
  virtual std::string name() const = 0;
  /// Fetches the slice into `dest` (slice.length elements, verified against
  /// the published checksum). `dest` must stay valid until `done` runs.
  virtual void Fetch(const FetchArgs& args, float* dest, TransferDone done) = 0;
  /// Pushes the slice of `grads` (the unit's whole padded gradient).
  virtual void Push(const PushArgs& args, std::shared_ptr<const std::vector<float>> grads, TransferDone done) = 0;
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_TRANSPORT_TRANSPORT_H_
