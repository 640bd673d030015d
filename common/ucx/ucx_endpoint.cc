#include "common/ucx/ucx_endpoint.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/ucx/ucx_worker.h"

namespace pshard::ucx {
namespace {

absl::StatusOr<ucp_ep_h> CreateEp(ucp_worker_h worker, const void* address, ucp_err_handling_mode_t mode,
                                  ucp_err_handler_cb_t on_error, void* arg) {
  ucp_ep_params_t params{};
  params.field_mask =
      UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = static_cast<const ucp_address_t*>(address);
  params.err_mode = mode;
  params.err_handler.cb = on_error;
  params.err_handler.arg = arg;
  ucp_ep_h ep = nullptr;
  if (ucs_status_t s = ucp_ep_create(worker, &params, &ep); s != UCS_OK) return PSHARD_UCX_ERROR("ucp_ep_create", s);
  return ep;
}

// ucp_ep_print_info's text: the only place UCX 1.13 names an endpoint's lanes.
std::string PrintInfo(ucp_ep_h ep) {
  char* text = nullptr;
  size_t length = 0;
  FILE* stream = open_memstream(&text, &length);
  if (stream == nullptr) return "";
  ucp_ep_print_info(ep, stream);
  std::fclose(stream);
  std::string info(text, length);
  std::free(text);
  return info;
}

}  // namespace

std::vector<std::string> LaneTransports(absl::string_view ep_info) {
  // A lane reads "#   lane[0]:  3:sysv/memory.0 md[2]  -> md[2]/sysv/... am am_bw#0".
  std::vector<std::string> transports;
  for (absl::string_view line : absl::StrSplit(ep_info, '\n')) {
    const size_t lane = line.find("lane[");
    if (lane == absl::string_view::npos) continue;
    const size_t colon = line.find("]:", lane);
    if (colon == absl::string_view::npos) continue;
    absl::string_view rest = absl::StripLeadingAsciiWhitespace(line.substr(colon + 2));
    if (const size_t index_end = rest.find(':'); index_end != absl::string_view::npos) rest = rest.substr(index_end + 1);
    absl::string_view name = rest.substr(0, rest.find_first_of(" \t"));
    // "sysv/memory.0": the trailing ".0" numbers the device's interfaces.
    if (const size_t dot = name.rfind('.'); dot != absl::string_view::npos && dot > name.find('/')) {
      name = name.substr(0, dot);
    }
    if (name.empty() || name.find('/') == absl::string_view::npos) continue;
    std::string transport(name);
    bool seen = false;
    for (const std::string& t : transports) seen |= t == transport;
    if (!seen) transports.push_back(std::move(transport));
  }
  return transports;
}

std::string Endpoint::Describe() const {
  return absl::StrCat(transports.empty() ? "no lanes" : absl::StrJoin(transports, " + "),
                      detects_peer_failure ? " (UCX peer failure detection)" : " (no peer failure detection)");
}

absl::StatusOr<Endpoint> Connect(ucp_worker_h worker, const void* address, PeerFailure mode,
                                 ucp_err_handler_cb_t on_error, void* arg) {
  Endpoint endpoint;
  endpoint.detects_peer_failure = mode == PeerFailure::kUcx;
  absl::StatusOr<ucp_ep_h> ep =
      CreateEp(worker, address, endpoint.detects_peer_failure ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE,
               on_error, arg);
  if (!ep.ok()) return ep.status();
  endpoint.ep = *ep;
  endpoint.transports = LaneTransports(PrintInfo(endpoint.ep));
  return endpoint;
}

void CloseLater(ucp_ep_h ep) {
  if (ep == nullptr) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
  if (request != nullptr && !UCS_PTR_IS_ERR(request)) ucp_request_free(request);  // completes on its own
}

void CloseNow(ucp_worker_h worker, ucp_ep_h ep) {
  if (ep == nullptr) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &param);
  if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
  // A forced close completes locally; progress it here, briefly.
  for (int i = 0; i < 100000 && ucp_request_check_status(request) == UCS_INPROGRESS; ++i) {
    ucp_worker_progress(worker);
  }
  ucp_request_free(request);
}

}  // namespace pshard::ucx
