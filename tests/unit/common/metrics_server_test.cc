#include "common/metrics/metrics_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace pshard::metrics {
namespace {

struct HttpResponse {
  int status = 0;  ///< 0 when the request failed; see `error`
  std::string content_type;
  long content_length = -1;
  std::string body;
  std::string error;
};

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// A minimal HTTP/1.1 client: one request to 127.0.0.1:`port`, read to EOF.
HttpResponse HttpRequest(int port, const std::string& method, const std::string& path) {
  HttpResponse response;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return {.error = "socket failed"};
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return {.error = "connect failed"};
  }
  const std::string request =
      method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  if (write(fd, request.data(), request.size()) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return {.error = "write failed"};
  }
  std::string raw;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) raw.append(buf, n);
  close(fd);

  const size_t header_end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.1 ", 0) != 0 || header_end == std::string::npos) {
    return {.error = "malformed response: " + raw};
  }
  response.status = std::stoi(raw.substr(9, 3));
  response.body = raw.substr(header_end + 4);
  size_t line_start = raw.find("\r\n") + 2;
  while (line_start < header_end) {
    const size_t line_end = raw.find("\r\n", line_start);
    const std::string line = raw.substr(line_start, line_end - line_start);
    const size_t colon = line.find(':');
    if (colon != std::string::npos) {
      const std::string name = Lower(line.substr(0, colon));
      const std::string value = line.substr(line.find_first_not_of(' ', colon + 1));
      if (name == "content-type") response.content_type = value;
      if (name == "content-length") response.content_length = std::stol(value);
    }
    line_start = line_end + 2;
  }
  return response;
}

HttpResponse HttpGet(int port, const std::string& path) { return HttpRequest(port, "GET", path); }

class MetricsServerTest : public testing::Test {
 protected:
  void SetUp() override {
    auto& bytes = registry_.AddCounter("pshard_fetch_bytes_total", "Bytes fetched.");
    bytes.Add({{"transport", "grpc"}}).Increment(4096);
    registry_.AddHistogram("pshard_step_seconds", "Step time.", {0.1, 1}).Add({}).Observe(0.5);
  }

  Registry registry_;
};

TEST_F(MetricsServerTest, ServesMetricsOnAnyFreePort) {
  auto server = MetricsServer::Start("127.0.0.1:0", &registry_);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  EXPECT_GT(port, 0);
  EXPECT_EQ((*server)->address(), "127.0.0.1:" + std::to_string(port));

  HttpResponse response = HttpGet(port, "/metrics");
  ASSERT_EQ(response.status, 200) << response.error;
  EXPECT_EQ(response.content_type, "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(response.content_length, static_cast<long>(response.body.size()));
  EXPECT_EQ(response.body, registry_.Serialize());

  // A second scrape sees new values.
  registry_.AddGauge("pshard_up", "Whether the server is up.").Add({}).Set(1);
  response = HttpGet(port, "/metrics?ignored=1");
  ASSERT_EQ(response.status, 200) << response.error;
  EXPECT_EQ(response.body, registry_.Serialize());
  EXPECT_NE(response.body.find("pshard_up 1\n"), std::string::npos);
}

TEST_F(MetricsServerTest, OtherPathsAreNotFound) {
  auto server = MetricsServer::Start("127.0.0.1:0", &registry_);
  ASSERT_TRUE(server.ok()) << server.status();
  for (const char* path : {"/", "/metric", "/metrics/extra", "/favicon.ico"}) {
    const HttpResponse response = HttpGet((*server)->port(), path);
    EXPECT_EQ(response.status, 404) << path << " " << response.error;
  }
}

TEST_F(MetricsServerTest, HeadHasNoBodyAndOtherMethodsAreRejected) {
  auto server = MetricsServer::Start("127.0.0.1:0", &registry_);
  ASSERT_TRUE(server.ok()) << server.status();
  const HttpResponse head = HttpRequest((*server)->port(), "HEAD", "/metrics");
  ASSERT_EQ(head.status, 200) << head.error;
  EXPECT_EQ(head.content_length, static_cast<long>(registry_.Serialize().size()));
  EXPECT_EQ(head.body, "");
  EXPECT_EQ(HttpRequest((*server)->port(), "POST", "/metrics").status, 405);
}

TEST_F(MetricsServerTest, AcceptsHostNames) {
  auto server = MetricsServer::Start("localhost:0", &registry_);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->address(), "localhost:" + std::to_string((*server)->port()));
  EXPECT_EQ(HttpGet((*server)->port(), "/metrics").status, 200);
}

TEST_F(MetricsServerTest, AddressInUseIsAnError) {
  auto first = MetricsServer::Start("127.0.0.1:0", &registry_);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = (*first)->address();
  auto second = MetricsServer::Start(address, &registry_);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find(address), std::string::npos) << second.status();
  EXPECT_NE(second.status().message().find("Address already in use"), std::string::npos)
      << second.status();
  // The first server is unaffected.
  EXPECT_EQ(HttpGet((*first)->port(), "/metrics").status, 200);
}

TEST_F(MetricsServerTest, BadAddressesAreErrors) {
  for (const char* address : {"", "127.0.0.1", "127.0.0.1:", ":0", "127.0.0.1:x", "127.0.0.1:+80",
                              "127.0.0.1:65536", "127.0.0.1:-1", "999.0.0.1:0", "1.2.3:0",
                              "[::zz]:0", "a b:0", "8.8.8.8:0"}) {
    auto server = MetricsServer::Start(address, &registry_);
    ASSERT_FALSE(server.ok()) << address;
    EXPECT_NE(server.status().message().find(std::string("\"") + address + "\""),
              std::string::npos)
        << server.status();
  }
  EXPECT_FALSE(MetricsServer::Start("127.0.0.1:0", nullptr).ok());
}

TEST_F(MetricsServerTest, StopsServingWhenDestroyed) {
  auto server = MetricsServer::Start("127.0.0.1:0", &registry_);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  server->reset();
  const HttpResponse response = HttpGet(port, "/metrics");
  EXPECT_EQ(response.status, 0);
  EXPECT_EQ(response.error, "connect failed");
}

}  // namespace
}  // namespace pshard::metrics
