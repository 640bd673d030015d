// The canonical order in which contributions to one gradient slice are
// summed, so that results are bit-identical however the work is grouped.
//
// For n contributions indexed 0..n-1, sum(lo, hi) = sum(lo, lo + h) +
// sum(lo + h, hi), where h is the largest power of two below hi - lo; a
// single contribution is its own sum. A range [begin, begin + count) that is
// a node of this tree can be summed anywhere — by a fabric group before it
// pushes, or by a trainer over its micro-batches — without changing a bit of
// the total. Aligned power-of-two groups are always nodes.
#ifndef PSHARD_COMMON_REDUCTION_TREE_H_
#define PSHARD_COMMON_REDUCTION_TREE_H_

#include <cstdint>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/reduction_values.h"

namespace pshard {

/// True if [begin, begin + count) is a node of the tree over n leaves.
bool IsReductionTreeNode(int n, int begin, int count);

/// Sums `leaves` (all the same length) in tree order. For references.
std::vector<float> TreeSum(std::vector<std::vector<float>> leaves);

/// Folds node sums into the total as they arrive, in any order, combining
/// two siblings as soon as both are present (so in-order arrival holds only
/// O(log n) buffers). Not thread-safe.
class TreeReducer {
 public:
  explicit TreeReducer(int n) : n_(n) {}

  /// Adds the sum of leaves [begin, begin + count). InvalidArgument if that
  /// is not a node or overlaps what was added; the reducer is then unchanged.
  /// Values held encoded stay so until a sibling is added to them.
  absl::Status Add(int begin, int count, ReductionValues values);
  absl::Status Add(int begin, int count, std::vector<float> values) {
    return Add(begin, count, ReductionValues(std::move(values)));
  }
  /// True if the node [begin, begin + count) is covered by what was added.
  bool Covers(int begin, int count) const;
  bool complete() const { return done_.size() == 1 && done_.begin()->first == 0 && done_.begin()->second.count == n_; }
  /// The total; valid once complete(). Leaves the reducer empty.
  std::vector<float> TakeTotal() { return std::move(TakeTotalValues()).TakeFloats(); }
  /// The same, still encoded when it is a single leaf that arrived encoded.
  ReductionValues TakeTotalValues();
  int leaves() const { return n_; }

 private:
  struct Node {
    int count = 0;
    ReductionValues values;
  };
  // The parent of node [begin, begin + count), or {-1, 0} for the root.
  std::pair<int, int> Parent(int begin, int count) const;

  int n_;
  std::map<int, Node> done_;  // begin -> node; disjoint, maximal
};

/// The tree's sum of leaves that arrive in order 0..n-1, kept as a stack of
/// partial sums in fixed buffers ("slots", slot 0 at the bottom): what
/// TreeReducer does with in-order arrival, for a caller (a device) that
/// does the additions itself. Leaf i is written to slot NextSlot(); then
/// AddLeaf() names the merges to do. Not thread-safe.
class InOrderTreeSum {
 public:
  explicit InOrderTreeSum(int n) : n_(n) {}

  /// The slot the next leaf is to be written to.
  int NextSlot() const { return static_cast<int>(stack_.size()); }
  /// Records the next leaf and returns the merges it completes, in order:
  /// for each s, slot s - 1 += slot s (slot s is then free). After the last
  /// leaf, slot 0 holds the total.
  std::vector<int> AddLeaf();
  /// The most slots in use at once while summing n leaves.
  static int SlotsNeeded(int n);

 private:
  struct Node {
    int begin;
    int count;
  };
  int n_;
  int next_leaf_ = 0;
  std::vector<Node> stack_;
};

}  // namespace pshard

#endif  // PSHARD_COMMON_REDUCTION_TREE_H_
