#include "shard_server/rendezvous.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pshard {

namespace {

absl::Status CheckPost(const std::string& group, int member, int size, const std::string& payload,
                       int max_group_size) {
  if (group.empty()) return absl::InvalidArgumentError("rendezvous: the group has no name");
  if (group.size() > RendezvousTable::kMaxGroupNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous: a group name of ", group.size(), " bytes; at most ",
                                                   RendezvousTable::kMaxGroupNameBytes));
  }
  if (size < 1 || size > max_group_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous ", group, ": size ", size, " is outside [1, ", max_group_size, "]"));
  }
  if (member < 0 || member >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous ", group, ": member ", member, " is outside [0, ", size, ")"));
  }
  if (payload.size() > RendezvousTable::kMaxPayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous ", group, ": payload of ", payload.size(),
                                                   " bytes exceeds ", RendezvousTable::kMaxPayloadBytes));
  }
  return absl::OkStatus();
}

}  // namespace

RendezvousTable::Withdraw RendezvousTable::Post(const std::string& group, int member, int size, std::string payload,
                                                absl::Time deadline, Done done) {
  if (absl::Status bad = CheckPost(group, member, size, payload, limits_.max_group_size); !bad.ok()) {
    done(bad);
    return [] {};
  }
  auto waiter = std::make_shared<Waiter>();
  waiter->done = std::move(done);
  std::vector<std::shared_ptr<Waiter>> to_finish;
  std::vector<std::string> payloads;
  std::shared_ptr<Waiter> replaced;
  absl::Status refused;
  int64_t round_id = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = rounds_.find(group);
    if (closed_) {
      refused = absl::UnavailableError(absl::StrCat("rendezvous ", group, ": the server is shutting down"));
    } else if (it == rounds_.end() && static_cast<int>(rounds_.size()) >= limits_.max_open_rounds) {
      refused = absl::ResourceExhaustedError(absl::StrCat("rendezvous ", group, ": ", rounds_.size(),
                                                          " rounds are open already, the most this server holds"));
    } else if (it != rounds_.end() && it->second.size != size) {
      refused = absl::InvalidArgumentError(absl::StrCat("rendezvous ", group, ": member ", member, " says ", size,
                                                        " members, others said ", it->second.size));
    } else {
      if (it == rounds_.end()) {
        it = rounds_.emplace(group, Round{size, next_id_++, std::vector<std::optional<std::string>>(size),
                                          std::vector<std::shared_ptr<Waiter>>(size)})
                 .first;
      }
      Round& round = it->second;
      round_id = round.id;
      replaced = std::move(round.waiters[member]);
      round.payloads[member] = std::move(payload);
      round.waiters[member] = waiter;
      bool complete = true;
      for (const auto& p : round.payloads) complete = complete && p.has_value();
      if (complete) {
        for (auto& p : round.payloads) payloads.push_back(std::move(*p));
        to_finish = std::move(round.waiters);
        rounds_.erase(it);
      }
    }
  }
  if (!refused.ok()) {
    waiter->Fire(refused);
    return [] {};
  }
  if (replaced) {
    replaced->Fire(absl::AbortedError(absl::StrCat("rendezvous ", group, ": member ", member, " posted again")));
  }
  if (!to_finish.empty()) {
    for (auto& w : to_finish) w->Fire(payloads);
    return [] {};
  }
  timer_.Schedule(deadline, [this, group, round_id, member, waiter] {
    TakeOut(group, round_id, member, waiter, [&group](const std::vector<int>& missing) {
      return absl::DeadlineExceededError(
          absl::StrCat("rendezvous ", group, ": member(s) ", absl::StrJoin(missing, ","), " did not arrive"));
    });
  });
  return [this, group, round_id, member, waiter] {
    TakeOut(group, round_id, member, waiter, [&group, member](const std::vector<int>&) {
      return absl::CancelledError(absl::StrCat("rendezvous ", group, ": member ", member, " went away"));
    });
  };
}

void RendezvousTable::TakeOut(const std::string& group, int64_t round_id, int member,
                              const std::shared_ptr<Waiter>& waiter,
                              const std::function<absl::Status(const std::vector<int>& missing)>& why) {
  std::vector<int> missing;
  {
    absl::MutexLock lock(&mu_);
    if (waiter->fired) return;
    auto it = rounds_.find(group);
    // A round that completed (or a post that was replaced) answers itself.
    if (it == rounds_.end() || it->second.id != round_id || it->second.waiters[member] != waiter) return;
    Round& round = it->second;
    for (int m = 0; m < round.size; ++m) {
      if (!round.payloads[m].has_value()) missing.push_back(m);
    }
    round.payloads[member].reset();
    round.waiters[member] = nullptr;
    bool empty = true;
    for (const auto& p : round.payloads) empty = empty && !p.has_value();
    if (empty) rounds_.erase(it);
  }
  waiter->Fire(why(missing));
}

void RendezvousTable::Close() {
  std::vector<std::shared_ptr<Waiter>> waiting;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    for (auto& [group, round] : rounds_) {
      for (auto& w : round.waiters) {
        if (w) waiting.push_back(std::move(w));
      }
    }
    rounds_.clear();
  }
  for (auto& w : waiting) w->Fire(absl::UnavailableError("rendezvous: the server is shutting down"));
}

int RendezvousTable::open_rounds() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(rounds_.size());
}

}  // namespace pshard
