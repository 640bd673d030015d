#include "trainer_client/join.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grpcpp/client_context.h"
#include "proto/rpc_util.h"

namespace pshard {
namespace {

// One Join attempt waits at most this long, so that a server that does not
// answer at all does not hold up the others' attempts for long.
constexpr absl::Duration kAttemptDeadline = absl::Seconds(2);
constexpr absl::Duration kRetryPause = absl::Milliseconds(250);

std::string Seconds(absl::Duration d) { return absl::StrCat(absl::ToInt64Seconds(d), " s"); }

}  // namespace

JoinFailure ClassifyJoinFailure(const grpc::Status& status) {
  const std::string& message = status.error_message();
  JoinFailure f;
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    f.reason = "not answering";
  } else if (status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
             absl::StrContains(message, "live sessions")) {
    // Every session of this rank is in use (another process joined as it):
    // one falls idle within seconds unless that process keeps using it.
    f.reason = absl::StrCat("every session of this rank is in use (", message, ")");
  } else if (status.error_code() != grpc::StatusCode::UNAVAILABLE) {
    // The server answered and said no (another job's rules, not a pshard
    // server, a bad rank): retrying cannot change that.
    f.transient = false;
    f.reason = FromGrpcStatus(status).ToString();
  } else if (absl::StrContains(message, "DNS resolution failed") ||
             absl::StrContains(message, "Name or service not known") ||
             absl::StrContains(message, "Domain name not found")) {
    f.name_unresolved = true;
    // The resolver's own words come last ("...: Domain name not found").
    const size_t colon = message.rfind(": ");
    f.reason = absl::StrCat("no such name (", colon == std::string::npos ? message : message.substr(colon + 2), ")");
  } else if (absl::StrContains(message, "handshaker shutdown")) {
    // gRPC abandoned a connection attempt of its own (the call ended first);
    // what the attempt before it met is the better reason.
    f.informative = false;
    f.reason = "not answering (no connection yet)";
  } else if (absl::StrContains(message, "Connection refused")) {
    f.reason = "connection refused (nothing listens on that port yet)";
  } else if (absl::StrContains(message, "SSL") || absl::StrContains(message, "TLS") ||
             absl::StrContains(message, "Handshake failed")) {
    f.reason = absl::StrCat("TLS handshake failed (", message, ")");
  } else {
    f.reason = absl::StrCat("unavailable (", message, ")");
  }
  return f;
}

grpc::ChannelArguments ServerChannelArguments(int max_receive_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_receive_bytes);
  // gRPC's defaults (back off up to 2 minutes between connection attempts,
  // re-resolve a name at most every 30 s) would keep a trainer waiting long
  // after a late server, or its DNS name, came up.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 250);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 250);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_DNS_MIN_TIME_BETWEEN_RESOLUTIONS_MS, 1000);
  // A channel stays connected however long it goes without a call (gRPC
  // drops an idle one after 30 minutes): a UCX link over shared memory takes
  // its channel's disconnection as its server's death.
  args.SetInt(GRPC_ARG_CLIENT_IDLE_TIMEOUT_MS, std::numeric_limits<int>::max());
  // Each channel its own connection: a rejoin starts on a fresh one rather
  // than on the connection (and its reconnect state) of the client it
  // dropped, and clients in one process do not share one.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // No transparent retries: a call started while its connection was being
  // reset was retried by gRPC on a connection that never came back, and
  // stalled until --rpc_timeout. Without it the call fails at once and the
  // trainer's own rejoin (which counts against --server_retry_limit) runs.
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  for (const auto& [name, value] : DataPathTransportArguments()) args.SetInt(name, value);
  return args;
}

absl::StatusOr<std::vector<v1::JoinResponse>> JoinServers(const JoinSpec& spec) {
  const size_t n = spec.addresses.size();
  if (spec.stubs.size() != n) return absl::InternalError("JoinServers: one stub per address is needed");
  const auto log = [&](const std::string& line) {
    if (spec.log) {
      spec.log(line);
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
  };
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + spec.timeout;
  absl::Time next_log = start + spec.log_every;
  std::vector<std::optional<v1::JoinResponse>> joined(n);
  std::vector<std::string> why(n, "not tried yet");
  std::vector<std::optional<absl::Time>> unresolved_since(n);
  const auto waiting_list = [&] {
    std::vector<std::string> parts;
    for (size_t i = 0; i < n; ++i) {
      if (!joined[i]) parts.push_back(absl::StrCat(spec.addresses[i], " (", why[i], ")"));
    }
    return absl::StrJoin(parts, "; ");
  };
  size_t remaining = n;
  while (true) {
    for (size_t i = 0; i < n; ++i) {
      if (joined[i]) continue;
      grpc::ClientContext ctx;
      const absl::Time attempt_deadline = std::min(deadline, absl::Now() + kAttemptDeadline);
      ctx.set_deadline(absl::ToChronoTime(attempt_deadline));
      v1::JoinRequest request;
      request.set_trainer_rank(spec.trainer_rank);
      request.set_metrics_address(spec.metrics_address);
      if (i < spec.previous_tokens.size()) request.set_previous_session_token(spec.previous_tokens[i]);
      if (spec.grad_format) {
        request.set_grad_encoding(EncodingToProto(spec.grad_format->encoding()));
        request.set_quant_block(spec.grad_format->block());
      }
      v1::JoinResponse response;
      const grpc::Status s = spec.stubs[i]->Join(&ctx, request, &response);
      if (s.ok()) {
        if (spec.accept) {
          if (absl::Status accepted = spec.accept(i, response); !accepted.ok()) return accepted;
        }
        joined[i] = std::move(response);
        --remaining;
        continue;
      }
      const JoinFailure failure = ClassifyJoinFailure(s);
      if (!failure.transient) {
        return absl::Status(FromGrpcStatus(s).code(),
                            absl::StrCat("join ", spec.addresses[i], ": ", s.error_message()));
      }
      // An attempt cut short by the join's own deadline says nothing new.
      const bool cut_short = attempt_deadline == deadline;
      if ((failure.informative && !cut_short) || why[i] == "not tried yet") why[i] = failure.reason;
      if (!failure.name_unresolved) {
        unresolved_since[i].reset();
        continue;
      }
      const absl::Time now = absl::Now();
      if (!unresolved_since[i]) unresolved_since[i] = now;
      if (now - *unresolved_since[i] >= spec.resolve_grace) {
        return absl::NotFoundError(absl::StrCat("join ", spec.addresses[i], ": the name does not resolve (for ",
                                                Seconds(now - *unresolved_since[i]),
                                                "): check the address, or that the server's host or service "
                                                "exists; ",
                                                failure.reason));
      }
    }
    if (remaining == 0) break;
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("join: ", remaining, " of ", n,
                                                      " shard servers did not answer within ", Seconds(spec.timeout),
                                                      ": ", waiting_list()));
    }
    if (now >= next_log) {
      log(absl::StrCat("joining: waiting for ", remaining, " of ", n,
                       " shard servers (", Seconds(now - start), " of ", Seconds(spec.timeout),
                       "): ", waiting_list()));
      next_log = now + spec.log_every;
    }
    absl::SleepFor(std::min(kRetryPause, deadline - now));
  }
  std::vector<v1::JoinResponse> out;
  out.reserve(n);
  for (auto& r : joined) out.push_back(std::move(*r));
  return out;
}

}  // namespace pshard
