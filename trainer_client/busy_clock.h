// Wall time during which at least one of a set of intervals was open: the
// "communication busy" time of a step, however many transfers overlapped;
// and, with unions of unions, the time one kind of work was exposed (open
// while another kind was not).
#ifndef PSHARD_TRAINER_CLIENT_BUSY_CLOCK_H_
#define PSHARD_TRAINER_CLIENT_BUSY_CLOCK_H_

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace pshard {

/// Length of the union of [start, end) intervals. Not thread-safe.
class IntervalUnion {
 public:
  void Add(absl::Time start, absl::Time end) {
    if (end > start) intervals_.emplace_back(start, end);
  }
  void Add(const std::vector<std::pair<absl::Time, absl::Time>>& intervals) {
    for (const auto& [start, end] : intervals) Add(start, end);
  }
  void Add(const IntervalUnion& other) { Add(other.intervals_); }
  absl::Duration Total() const {
    std::vector<std::pair<absl::Time, absl::Time>> sorted = intervals_;
    std::sort(sorted.begin(), sorted.end());
    absl::Duration total;
    absl::Time covered = absl::InfinitePast();
    for (const auto& [start, end] : sorted) {
      const absl::Time from = std::max(start, covered);
      if (end > from) total += end - from;
      covered = std::max(covered, end);
    }
    return total;
  }

 private:
  std::vector<std::pair<absl::Time, absl::Time>> intervals_;
};

}  // namespace pshard

#endif  // PSHARD_TRAINER_CLIENT_BUSY_CLOCK_H_
