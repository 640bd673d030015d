#include "common/reduction_tree.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pshard {
namespace {

// Largest power of two strictly below n (n >= 2).
int SplitPoint(int n) {
  int h = 1;
  while (h * 2 < n) h *= 2;
  return h;
}

void AddInto(std::vector<float>& left, const std::vector<float>& right) {
  for (size_t i = 0; i < left.size(); ++i) left[i] = left[i] + right[i];
}

std::vector<float> SumRange(std::vector<std::vector<float>>& leaves, int lo, int hi) {
  if (hi - lo == 1) return std::move(leaves[lo]);
  const int mid = lo + SplitPoint(hi - lo);
  std::vector<float> left = SumRange(leaves, lo, mid);
  AddInto(left, SumRange(leaves, mid, hi));
  return left;
}

}  // namespace

bool IsReductionTreeNode(int n, int begin, int count) {
  int lo = 0;
  int hi = n;
  while (true) {
    if (begin == lo && count == hi - lo) return true;
    if (hi - lo <= 1 || begin < lo || begin + count > hi) return false;
    const int mid = lo + SplitPoint(hi - lo);
    if (begin + count <= mid) {
      hi = mid;
    } else if (begin >= mid) {
      lo = mid;
    } else {
      return false;  // straddles the split
    }
  }
}

std::vector<float> TreeSum(std::vector<std::vector<float>> leaves) {
  if (leaves.empty()) return {};
  return SumRange(leaves, 0, static_cast<int>(leaves.size()));
}

std::pair<int, int> TreeReducer::Parent(int begin, int count) const {
  int lo = 0;
  int hi = n_;
  std::pair<int, int> parent{-1, 0};
  while (!(begin == lo && count == hi - lo)) {
    parent = {lo, hi - lo};
    const int mid = lo + SplitPoint(hi - lo);
    if (begin + count <= mid) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return parent;
}

bool TreeReducer::Covers(int begin, int count) const {
  auto it = done_.upper_bound(begin);
  if (it == done_.begin()) return false;
  --it;
  return it->first <= begin && begin + count <= it->first + it->second.count;
}

absl::Status TreeReducer::Add(int begin, int count, ReductionValues values) {
  if (count < 1 || !IsReductionTreeNode(n_, begin, count)) {
    return absl::InvalidArgumentError(absl::StrCat("contributions [", begin, ", ", begin + count,
                                                   ") do not form a node of the reduction over ", n_));
  }
  // Overlap with anything present (nodes are disjoint or nested).
  auto next = done_.lower_bound(begin);
  if (next != done_.end() && next->first < begin + count) {
    return absl::InvalidArgumentError(absl::StrCat("contributions [", begin, ", ", begin + count,
                                                   ") overlap ones already received"));
  }
  if (next != done_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.count > begin) {
      return absl::InvalidArgumentError(absl::StrCat("contributions [", begin, ", ", begin + count,
                                                     ") overlap ones already received"));
    }
  }
  done_[begin] = Node{count, std::move(values)};
  // Combine upwards while the sibling is present.
  while (true) {
    const Node& node = done_[begin];
    auto [parent_begin, parent_count] = Parent(begin, node.count);
    if (parent_begin < 0) break;
    const int left = parent_begin;
    const int right = parent_begin + SplitPoint(parent_count);
    auto l = done_.find(left);
    auto r = done_.find(right);
    if (l == done_.end() || r == done_.end() || l->second.count != right - left ||
        r->second.count != parent_count - (right - left)) {
      break;
    }
    l->second.values.Add(r->second.values);
    l->second.count = parent_count;
    done_.erase(r);
    begin = left;
  }
  return absl::OkStatus();
}

ReductionValues TreeReducer::TakeTotalValues() {
  ReductionValues out = std::move(done_.begin()->second.values);
  done_.clear();
  return out;
}

std::vector<int> InOrderTreeSum::AddLeaf() {
  stack_.push_back({next_leaf_++, 1});
  // Two adjacent nodes whose union is a node are that node's children
  // (nodes nest or are disjoint), so merging them is the tree's own sum.
  std::vector<int> merges;
  while (stack_.size() >= 2) {
    const Node& left = stack_[stack_.size() - 2];
    const Node& right = stack_.back();
    if (!IsReductionTreeNode(n_, left.begin, left.count + right.count)) break;
    merges.push_back(static_cast<int>(stack_.size()) - 1);
    stack_[stack_.size() - 2].count += right.count;
    stack_.pop_back();
  }
  return merges;
}

int InOrderTreeSum::SlotsNeeded(int n) {
  InOrderTreeSum sum(n);
  int most = 0;
  for (int i = 0; i < n; ++i) {
    most = std::max(most, sum.NextSlot() + 1);
    sum.AddLeaf();
  }
  return most;
}

}  // namespace pshard
