#include "trainer_client/group/host/host_group.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/reduction_tree.h"

namespace pshard {
namespace {

// Where members of an in-process group meet: each call publishes the
// member's buffer, waits for all, works on the others' buffers in place,
// then waits again so that no buffer changes while another member reads it.
class Rendezvous {
 public:
  using Parts = std::vector<std::vector<float>>;

  Rendezvous(int size, absl::Duration timeout) : size_(size), timeout_(timeout), buffers_(size), outgoing_(size) {}

  /// Phase barrier: returns once all members arrived at this `generation`.
  /// Publishes `buffer` (or `outgoing`, an exchange's parts) when given.
  absl::Status Arrive(int member, int64_t generation, std::span<float> buffer, const char* what,
                      const Parts* outgoing = nullptr) {
    absl::MutexLock lock(&mu_);
    if (buffer.data() != nullptr) buffers_[member] = buffer;
    if (outgoing != nullptr) outgoing_[member] = outgoing;
    arrived_[generation].push_back(member);
    const absl::Time deadline = absl::Now() + timeout_;
    auto all_here = [this, generation] { return static_cast<int>(arrived_[generation].size()) >= size_; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&all_here), deadline)) {
      std::vector<int> missing;
      for (int m = 0; m < size_; ++m) {
        const auto& here = arrived_[generation];
        if (std::find(here.begin(), here.end(), m) == here.end()) missing.push_back(m);
      }
      return absl::DeadlineExceededError(absl::StrCat("fabric group ", what, ": member(s) ",
                                                      absl::StrJoin(missing, ","), " did not arrive within ",
                                                      absl::FormatDuration(timeout_)));
    }
    // The last to leave a generation forgets it.
    if (++left_[generation] == size_) {
      arrived_.erase(generation);
      left_.erase(generation);
    }
    return absl::OkStatus();
  }

  std::span<float> buffer(int member) {
    absl::MutexLock lock(&mu_);
    return buffers_[member];
  }

  const Parts& outgoing(int member) {
    absl::MutexLock lock(&mu_);
    return *outgoing_[member];
  }

 private:
  const int size_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  std::vector<std::span<float>> buffers_ ABSL_GUARDED_BY(mu_);
  std::vector<const Parts*> outgoing_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::vector<int>> arrived_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, int> left_ ABSL_GUARDED_BY(mu_);
};

class HostGroupMember final : public GroupCollective {
 public:
  HostGroupMember(std::shared_ptr<Rendezvous> rendezvous, int size, int rank)
      : rendezvous_(std::move(rendezvous)), size_(size), rank_(rank) {}

  int size() const override { return size_; }
  int rank() const override { return rank_; }

  absl::Status AllGather(std::span<float> buffer, const GroupOwnership& owned) override {
    if (absl::Status s = Check(buffer, owned); !s.ok()) return s;
    const int64_t call = calls_++;
    if (absl::Status s = rendezvous_->Arrive(rank_, 2 * call, buffer, "all-gather"); !s.ok()) return s;
    for (int m = 0; m < size_; ++m) {
      if (m == rank_) continue;
      const std::span<float> theirs = rendezvous_->buffer(m);
      for (const ElementRange& r : owned[m]) {
        std::memcpy(buffer.data() + r.begin, theirs.data() + r.begin, r.length * sizeof(float));
      }
    }
    return rendezvous_->Arrive(rank_, 2 * call + 1, {}, "all-gather");
  }

  absl::Status ReduceScatter(std::span<float> buffer, const GroupOwnership& owned) override {
    if (absl::Status s = Check(buffer, owned); !s.ok()) return s;
    const int64_t call = calls_++;
    if (absl::Status s = rendezvous_->Arrive(rank_, 2 * call, buffer, "reduce-scatter"); !s.ok()) return s;
    std::vector<std::vector<float>> sums;
    for (const ElementRange& r : owned[rank_]) {
      std::vector<std::vector<float>> parts;
      for (int m = 0; m < size_; ++m) {
        const std::span<float> b = rendezvous_->buffer(m);
        parts.emplace_back(b.begin() + r.begin, b.begin() + r.begin + r.length);
      }
      sums.push_back(TreeSum(std::move(parts)));
    }
    // Others may still read this member's buffer: write only after they are done.
    if (absl::Status s = rendezvous_->Arrive(rank_, 2 * call + 1, {}, "reduce-scatter"); !s.ok()) return s;
    for (size_t i = 0; i < sums.size(); ++i) {
      std::memcpy(buffer.data() + owned[rank_][i].begin, sums[i].data(), sums[i].size() * sizeof(float));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::vector<float>>> Exchange(const std::vector<std::vector<float>>& outgoing,
                                                           const std::vector<int64_t>& expected) override {
    if (static_cast<int>(outgoing.size()) != size_ || static_cast<int>(expected.size()) != size_) {
      return absl::InvalidArgumentError(absl::StrCat("fabric group exchange: parts for ", outgoing.size(),
                                                     " members and sizes for ", expected.size(), "; the group has ",
                                                     size_));
    }
    const int64_t call = calls_++;
    if (absl::Status s = rendezvous_->Arrive(rank_, 2 * call, {}, "exchange", &outgoing); !s.ok()) return s;
    std::vector<std::vector<float>> received(size_);
    absl::Status status;
    for (int m = 0; m < size_; ++m) {
      if (m == rank_) continue;
      const std::vector<float>& theirs = rendezvous_->outgoing(m)[rank_];
      if (static_cast<int64_t>(theirs.size()) != expected[m] && status.ok()) {
        status = absl::InternalError(absl::StrCat("fabric group exchange: member ", m, " handed ", theirs.size(),
                                                  " elements to member ", rank_, ", which expected ", expected[m]));
      }
      received[m] = theirs;
    }
    // Others may still read this member's parts: leave only when they are done.
    if (absl::Status s = rendezvous_->Arrive(rank_, 2 * call + 1, {}, "exchange"); !s.ok()) return s;
    if (!status.ok()) return status;
    return received;
  }

 private:
  absl::Status Check(std::span<float> buffer, const GroupOwnership& owned) const {
    return CheckOwnership(static_cast<int64_t>(buffer.size()), owned, size_);
  }

  std::shared_ptr<Rendezvous> rendezvous_;
  const int size_;
  const int rank_;
  int64_t calls_ = 0;
};

}  // namespace

std::vector<std::unique_ptr<GroupCollective>> CreateHostGroup(int size, absl::Duration timeout) {
  auto rendezvous = std::make_shared<Rendezvous>(size, timeout);
  std::vector<std::unique_ptr<GroupCollective>> members;
  for (int r = 0; r < size; ++r) members.push_back(std::make_unique<HostGroupMember>(rendezvous, size, r));
  return members;
}

}  // namespace pshard
