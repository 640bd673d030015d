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

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/partition.h"
#include "common/wire_encoding.h"

namespace pshard {

/// Called exactly once when a transfer ends, with the bytes it moved.
using TransferDone = std::function<void(absl::Status status, int64_t wire_bytes)>;

/// Ends a set of transfers early (the other slices of a unit, once one
/// failed): each transfer registers how to cancel itself. Thread-safe.
class CancelScope {
 public:
  /// `cancel` runs once, from Cancel(), or at once if Cancel() ran already.
  /// It must stay safe to call for as long as the scope lives (capture what
  /// it needs by shared pointer).
  void OnCancel(std::function<void()> cancel) {
    {
      absl::MutexLock lock(&mu_);
      if (!cancelled_) {
        pending_.push_back(std::move(cancel));
        return;
      }
    }
    cancel();
  }
  /// Cancels every transfer registered, and every one registered later.
  void Cancel() {
    std::vector<std::function<void()>> run;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      run.swap(pending_);
    }
    for (auto& cancel : run) cancel();
  }

 private:
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::function<void()>> pending_ ABSL_GUARDED_BY(mu_);
};

struct FetchArgs {
  int unit = 0;
  int64_t version = 0;
  WireFormat format;
  int trainer = 0;    ///< the fetching trainer's rank (-1: a tool)
  SliceRange slice;   ///< this server's slice of the unit
  /// Cancelling it ends the fetch at once with Cancelled (null: no scope).
  std::shared_ptr<CancelScope> cancel;
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
  /// Cancelling it ends the push at once with Cancelled (null: no scope).
  std::shared_ptr<CancelScope> cancel;
};

/// Thread-safe; transfers may overlap.
class Transport {
 public:
  virtual ~Transport() = default;
  /// The label this transport has in metrics ("grpc", "ucx").
  virtual std::string name() const = 0;
  /// What carries the link, for logs: name(), and where the backend knows
  /// them, the transports beneath it.
  virtual std::string description() const { return name(); }
  /// Fetches the slice into `dest` (slice.length elements, verified against
  /// the published checksum). `dest` must stay valid until `done` runs.
  virtual void Fetch(const FetchArgs& args, float* dest, TransferDone done) = 0;
  /// Pushes the slice of `grads` (the unit's whole padded gradient).
  virtual void Push(const PushArgs& args, std::shared_ptr<const std::vector<float>> grads, TransferDone done) = 0;
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_TRANSPORT_TRANSPORT_H_
