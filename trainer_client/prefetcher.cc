#include "trainer_client/prefetcher.h"

#include <algorithm>

namespace pshard {

std::vector<int> MemberShards(int num_shards, int size, int member) {
  std::vector<int> shards;
  for (int s = member; s < num_shards; s += size) shards.push_back(s);
  return shards;
}

Prefetcher::Prefetcher(ShardClient* client, GroupCollective* group, std::vector<int> schedule, int64_t version,
                       int depth, TransferLog* log)
    : client_(client), group_(group), schedule_(std::move(schedule)), version_(version), depth_(depth),
      log_(log), transfers_(schedule_.size()) {
  if (group_ != nullptr) my_shards_ = MemberShards(client->job().num_shards, group_->size(), group_->rank());
}

Prefetcher::~Prefetcher() {
  for (auto& t : transfers_) {
    if (t) t->Wait().IgnoreError();
  }
}

absl::StatusOr<std::shared_ptr<UnitTransfer>> Prefetcher::Get(size_t i) {
  // Issuing fetches is communication work done on this thread: exposed.
  const absl::Time wait_start = absl::Now();
  const size_t last = std::min(schedule_.size() - 1, i + static_cast<size_t>(depth_));
  for (; started_ <= last; ++started_) {
    transfers_[started_] = client_->StartFetch(schedule_[started_], version_, my_shards_);
  }
  std::shared_ptr<UnitTransfer> t = std::move(transfers_[i]);
  absl::Status s = t->Wait();
  log_->busy.Add(t->started(), t->finished());
  log_->fetch_latencies.push_back(t->finished() - t->started());
  log_->bytes_fetched += t->wire_bytes();
  log_->payload_fetched += t->payload_bytes();
  if (s.ok() && group_ != nullptr) {
    const absl::Time gather_start = absl::Now();
    const UnitPartition& p = client_->layout().partitions[schedule_[i]];
    const GroupOwnership owned = ShardOwnership(p, group_->size());
    absl::StatusOr<int64_t> gathered =
        AllGatherWeights(*group_, t->values(), owned, client_->options().encodings.weight_format());
    log_->busy.Add(gather_start, absl::Now());
    s = gathered.status();
    if (s.ok()) log_->fabric_gathered += *gathered;
  }
  // Time this thread spends issuing or waiting is communication too, so
  // busy time always covers exposed time.
  const absl::Time wait_end = absl::Now();
  log_->busy.Add(wait_start, wait_end);
  log_->waits.Add(wait_start, wait_end);
  if (!s.ok()) return s;
  return t;
}

}  // namespace pshard
