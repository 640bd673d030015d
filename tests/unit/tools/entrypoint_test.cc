// The container entrypoint's environment handling: every variable alone,
// the ones that must agree, and the clear error for each missing or bad
// value.
#include "tools/entrypoint.h"

#include <algorithm>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pshard::entrypoint {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

Facts With(Environment env, std::string hostname = "container") {
  Facts facts;
  facts.env = std::move(env);
  facts.hostname = std::move(hostname);
  facts.file_exists = [](const std::string&) { return false; };
  return facts;
}

// A trainer's environment with everything but the rank.
Environment TrainerBase() {
  return {{"PSHARD_SERVERS", "s0:7070,s1:7070,s2:7070"}, {"PSHARD_NUM_TRAINERS", "4"}};
}

std::string Error(const std::vector<std::string>& args, const Facts& facts) {
  absl::StatusOr<LaunchPlan> plan = Plan(args, facts);
  EXPECT_FALSE(plan.ok()) << plan->Summary();
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
  return std::string(plan.status().message());
}

LaunchPlan Ok(const std::vector<std::string>& args, const Facts& facts) {
  absl::StatusOr<LaunchPlan> plan = Plan(args, facts);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : LaunchPlan();
}

// --------------------------------------------------------------- servers ----

TEST(EntrypointServer, ExplicitListAndIndex) {
  LaunchPlan plan = Ok({"server"}, With({{"PSHARD_SERVERS", "a:7000, b:7001 ,c:7002"},
                                         {"PSHARD_SHARD_INDEX", "1"},
                                         {"PSHARD_NUM_TRAINERS", "2"}}));
  EXPECT_EQ(plan.program, "pshard-server");
  EXPECT_THAT(plan.args, Contains("--shard_index=1"));
  EXPECT_THAT(plan.args, Contains("--num_shards=3"));
  EXPECT_THAT(plan.args, Contains("--num_trainers=2"));
  EXPECT_THAT(plan.args, Contains("--coordinator=a:7000"));
  EXPECT_THAT(plan.args, Contains("--address=0.0.0.0:7070"));
  EXPECT_THAT(plan.args, Contains("--metrics_address=0.0.0.0:9400"));
  EXPECT_THAT(plan.args, Contains("--checkpoint_dir=/var/lib/pshard/checkpoints"));
  EXPECT_THAT(plan.index_source, HasSubstr("PSHARD_SHARD_INDEX"));
  EXPECT_EQ(plan.uid, -1);  // not root: nothing to drop
}

TEST(EntrypointServer, StatefulSetOrdinalAndTemplate) {
  LaunchPlan plan = Ok({"server"}, With({{"PSHARD_SERVER_TEMPLATE", "pshard-server-{i}.pshard-server:7070"},
                                         {"PSHARD_NUM_SERVERS", "4"},
                                         {"PSHARD_NUM_TRAINERS", "2"}},
                                        "pshard-server-3"));
  EXPECT_THAT(plan.args, Contains("--shard_index=3"));
  EXPECT_THAT(plan.args, Contains("--num_shards=4"));
  EXPECT_THAT(plan.args, Contains("--coordinator=pshard-server-0.pshard-server:7070"));
  EXPECT_THAT(plan.index_source, HasSubstr("hostname pshard-server-3"));
}

TEST(EntrypointServer, ShardZeroHasNoCoordinatorFlag) {
  LaunchPlan plan = Ok({"server"}, With({{"PSHARD_SERVERS", "a:1,b:2"}, {"PSHARD_NUM_TRAINERS", "1"}}, "srv-0"));
  EXPECT_THAT(plan.args, Contains("--shard_index=0"));
  for (const std::string& a : plan.args) EXPECT_THAT(a, Not(HasSubstr("--coordinator")));
}

TEST(EntrypointServer, ExplicitIndexWinsOverHostname) {
  LaunchPlan plan = Ok({"server"}, With({{"PSHARD_SERVERS", "a:1,b:2,c:3"},
                                         {"PSHARD_SHARD_INDEX", "2"},
                                         {"PSHARD_NUM_TRAINERS", "1"}},
                                        "pshard-server-0"));
  EXPECT_THAT(plan.args, Contains("--shard_index=2"));
}

TEST(EntrypointServer, ServerListErrors) {
  const Environment m = {{"PSHARD_NUM_TRAINERS", "1"}, {"PSHARD_SHARD_INDEX", "0"}};
  auto env = [&](Environment extra) {
    Environment e = m;
    e.insert(extra.begin(), extra.end());
    return With(e);
  };
  EXPECT_THAT(Error({"server"}, env({})), HasSubstr("PSHARD_SERVERS"));
  EXPECT_THAT(Error({"server"}, env({{"PSHARD_SERVERS", "a:1"}, {"PSHARD_SERVER_TEMPLATE", "s-{i}:1"}})),
              HasSubstr("both set"));
  EXPECT_THAT(Error({"server"}, env({{"PSHARD_SERVERS", "a:1,b:2"}, {"PSHARD_NUM_SERVERS", "3"}})),
              HasSubstr("PSHARD_NUM_SERVERS=3 but PSHARD_SERVERS lists 2"));
  EXPECT_THAT(Error({"server"}, env({{"PSHARD_SERVERS", "a:1,,b:2"}})), HasSubstr("empty entry"));
  EXPECT_THAT(Error({"server"}, env({{"PSHARD_SERVERS", "a:1,b"}})), HasSubstr("\"b\" is not host:port"));
  EXPECT_THAT(Error({"server"}, env({{"PSHARD_SERVERS", "a:99999"}})), HasSubstr("not host:port"));
  EXPECT_THAT(Error({"server"}, env({{"PSHARD_SERVER_TEMPLATE", "s:1"}, {"PSHARD_NUM_SERVERS", "2"}})),
              HasSubstr("no {i}"));
  EXPECT_THAT(Error({"server"}, env({{"PSHARD_SERVER_TEMPLATE", "s-{i}:1"}})), HasSubstr("needs PSHARD_NUM_SERVERS"));
  EXPECT_THAT(Error({"server"}, env({{"PSHARD_SERVER_TEMPLATE", "s-{i}:1"}, {"PSHARD_NUM_SERVERS", "0"}})),
              HasSubstr("at least 1"));
  // Found with fuzz/entrypoint_fuzzer (fuzz/corpus/entrypoint/timeout_millions_of_servers):
  // a template of three million servers took 23 s to expand under ASan (a hang to libFuzzer).
  EXPECT_THAT(Error({"server"}, env({{"PSHARD_SERVER_TEMPLATE", "a{i}:1"}, {"PSHARD_NUM_SERVERS", "3000000"},
                                     {"PSHARD_SHARD_INDEX", "0"}})),
              HasSubstr("PSHARD_NUM_SERVERS=3000000: must be at least 1 and at most 4096"));
  EXPECT_THAT(Error({"server"}, env({{"PSHARD_SERVER_TEMPLATE", "s-{i}:1"}, {"PSHARD_NUM_SERVERS", "two"}})),
              HasSubstr("PSHARD_NUM_SERVERS=\"two\" is not a non-negative integer"));
}

TEST(EntrypointServer, IndexErrors) {
  const Environment base = {{"PSHARD_SERVERS", "a:1,b:2"}, {"PSHARD_NUM_TRAINERS", "1"}};
  std::string missing = Error({"server"}, With(base, "box"));
  EXPECT_THAT(missing, HasSubstr("shard index is not set"));
  EXPECT_THAT(missing, HasSubstr("PSHARD_SHARD_INDEX"));
  EXPECT_THAT(missing, HasSubstr("\"box\""));
  Environment out_of_range = base;
  out_of_range["PSHARD_SHARD_INDEX"] = "2";
  EXPECT_THAT(Error({"server"}, With(out_of_range)), HasSubstr("shard index 2 (from PSHARD_SHARD_INDEX) is outside the 2"));
  EXPECT_THAT(Error({"server"}, With(base, "pshard-server-5")), HasSubstr("from hostname pshard-server-5"));
  Environment negative = base;
  negative["PSHARD_SHARD_INDEX"] = "-1";
  EXPECT_THAT(Error({"server"}, With(negative)), HasSubstr("not a non-negative integer"));
}

TEST(EntrypointServer, CheckpointVariables) {
  Environment env = {{"PSHARD_SERVERS", "a:1"},
                     {"PSHARD_NUM_TRAINERS", "1"},
                     {"PSHARD_SHARD_INDEX", "0"},
                     {"PSHARD_CHECKPOINT_DIR", "/data"},
                     {"PSHARD_CHECKPOINT_EVERY", "25"},
                     {"PSHARD_RESUME_STEP", "100"}};
  LaunchPlan plan = Ok({"server"}, With(env));
  EXPECT_THAT(plan.args, Contains("--checkpoint_dir=/data"));
  EXPECT_THAT(plan.args, Contains("--checkpoint_every=25"));
  EXPECT_THAT(plan.args, Contains("--resume_step=100"));

  env["PSHARD_CHECKPOINT_DIR"] = "";
  EXPECT_THAT(Error({"server"}, With(env)), HasSubstr("PSHARD_RESUME_STEP is set but PSHARD_CHECKPOINT_DIR is empty"));
  env.erase("PSHARD_RESUME_STEP");
  plan = Ok({"server"}, With(env));
  for (const std::string& a : plan.args) EXPECT_THAT(a, Not(HasSubstr("checkpoint")));
  env["PSHARD_CHECKPOINT_DIR"] = "/data";
  env["PSHARD_CHECKPOINT_EVERY"] = "often";
  EXPECT_THAT(Error({"server"}, With(env)), HasSubstr("PSHARD_CHECKPOINT_EVERY=\"often\""));
}

// -------------------------------------------------------------- trainers ----

TEST(EntrypointTrainer, EachRankVariableAlone) {
  for (const std::string name : {"PSHARD_RANK", "RANK", "JOB_COMPLETION_INDEX"}) {
    Environment env = TrainerBase();
    env[name] = "2";
    LaunchPlan plan = Ok({"trainer"}, With(env));
    EXPECT_EQ(plan.program, "pshard-trainer");
    EXPECT_THAT(plan.args, Contains("--rank=2")) << name;
    EXPECT_THAT(plan.args, Contains("--servers=s0:7070,s1:7070,s2:7070"));
    EXPECT_THAT(plan.args, Contains("--metrics_address=0.0.0.0:9400"));
    EXPECT_THAT(plan.index_source, HasSubstr(name));
  }
  LaunchPlan from_host = Ok({"trainer"}, With(TrainerBase(), "pshard-trainer-3"));
  EXPECT_THAT(from_host.args, Contains("--rank=3"));
  EXPECT_THAT(from_host.index_source, HasSubstr("hostname"));
}

TEST(EntrypointTrainer, RankVariablesMustAgree) {
  Environment env = TrainerBase();
  env["RANK"] = "1";
  env["JOB_COMPLETION_INDEX"] = "1";
  EXPECT_THAT(Ok({"trainer"}, With(env, "pshard-trainer-1")).args, Contains("--rank=1"));
  env["JOB_COMPLETION_INDEX"] = "2";
  const std::string conflict = Error({"trainer"}, With(env));
  EXPECT_THAT(conflict, HasSubstr("RANK=1"));
  EXPECT_THAT(conflict, HasSubstr("JOB_COMPLETION_INDEX=2"));
  EXPECT_THAT(conflict, HasSubstr("disagree"));
  // An explicit rank is taken over the hostname's ordinal.
  env.erase("JOB_COMPLETION_INDEX");
  EXPECT_THAT(Ok({"trainer"}, With(env, "pshard-trainer-3")).args, Contains("--rank=1"));
}

TEST(EntrypointTrainer, RankErrors) {
  const std::string missing = Error({"trainer"}, With(TrainerBase(), "4f2a9c"));
  EXPECT_THAT(missing, HasSubstr("trainer rank is not set"));
  EXPECT_THAT(missing, HasSubstr("PSHARD_RANK or RANK or JOB_COMPLETION_INDEX"));
  Environment env = TrainerBase();
  env["RANK"] = "4";
  EXPECT_THAT(Error({"trainer"}, With(env)), HasSubstr("rank 4 (from RANK) is outside the 4 trainers"));
  env["RANK"] = "x1";
  EXPECT_THAT(Error({"trainer"}, With(env)), HasSubstr("RANK=\"x1\""));
}

TEST(EntrypointTrainer, TrainerCountFromEitherVariable) {
  Environment env = {{"PSHARD_SERVERS", "s:1"}, {"RANK", "0"}, {"WORLD_SIZE", "2"}};
  EXPECT_TRUE(Plan({"trainer"}, With(env)).ok());
  env["PSHARD_NUM_TRAINERS"] = "2";
  EXPECT_TRUE(Plan({"trainer"}, With(env)).ok());
  env["PSHARD_NUM_TRAINERS"] = "3";
  const std::string conflict = Error({"trainer"}, With(env));
  EXPECT_THAT(conflict, HasSubstr("PSHARD_NUM_TRAINERS=3 and WORLD_SIZE=2 disagree"));
  env.erase("PSHARD_NUM_TRAINERS");
  env.erase("WORLD_SIZE");
  EXPECT_THAT(Error({"trainer"}, With(env)), HasSubstr("trainer count is not set"));
  env["WORLD_SIZE"] = "0";
  EXPECT_THAT(Error({"trainer"}, With(env)), HasSubstr("WORLD_SIZE must be at least 1"));
}

TEST(EntrypointTrainer, JoinTimeoutAndPorts) {
  Environment env = TrainerBase();
  env["RANK"] = "0";
  env["PSHARD_JOIN_TIMEOUT"] = "10m";
  env["PSHARD_METRICS_PORT"] = "9500";
  LaunchPlan plan = Ok({"trainer"}, With(env));
  EXPECT_THAT(plan.args, Contains("--join_timeout=10m"));
  EXPECT_THAT(plan.args, Contains("--metrics_address=0.0.0.0:9500"));
  env["PSHARD_METRICS_PORT"] = "70000";
  EXPECT_THAT(Error({"trainer"}, With(env)), HasSubstr("PSHARD_METRICS_PORT=70000 is not a port"));
}

// ------------------------------------------------------ role and config ----

TEST(EntrypointRole, FromArgumentOrEnvironment) {
  Environment env = TrainerBase();
  env["RANK"] = "0";
  env["PSHARD_ROLE"] = "trainer";
  EXPECT_EQ(Ok({}, With(env)).program, "pshard-trainer");
  EXPECT_EQ(Ok({"trainer"}, With(env)).program, "pshard-trainer");
  EXPECT_THAT(Error({"server"}, With(env)), HasSubstr("PSHARD_ROLE=trainer"));
  env.erase("PSHARD_ROLE");
  EXPECT_THAT(Error({}, With(env)), HasSubstr("no role"));
  EXPECT_THAT(Error({"--steps=3"}, With(env)), HasSubstr("no role"));
  EXPECT_THAT(Error({"trainr"}, With(env)), HasSubstr("unknown role \"trainr\""));
}

TEST(EntrypointRole, FlagFileFirstAndArgumentsLast) {
  Environment env = TrainerBase();
  env["RANK"] = "0";
  env["PSHARD_CONFIG_DIR"] = "/cfg";
  Facts facts = With(env);
  facts.file_exists = [](const std::string& path) { return path == "/cfg/trainer.flags"; };
  LaunchPlan plan = Ok({"trainer", "--steps=7", "--batch=2"}, facts);
  ASSERT_GE(plan.args.size(), 3u);
  EXPECT_EQ(plan.args.front(), "--flagfile=/cfg/trainer.flags");
  EXPECT_EQ(plan.args[plan.args.size() - 2], "--steps=7");
  EXPECT_EQ(plan.args.back(), "--batch=2");
  // No file: no flag.
  facts.file_exists = [](const std::string&) { return false; };
  plan = Ok({"trainer"}, facts);
  for (const std::string& a : plan.args) EXPECT_THAT(a, Not(HasSubstr("flagfile")));
}

TEST(EntrypointRole, HealthChecksTheLocalPort) {
  LaunchPlan plan = Ok({"health"}, With({{"PSHARD_PORT", "7100"}}));
  EXPECT_EQ(plan.health_address, "127.0.0.1:7100");
  EXPECT_EQ(Ok({"health"}, With({})).health_address, "127.0.0.1:7070");
  EXPECT_THAT(Error({"health", "--x"}, With({})), HasSubstr("no arguments"));
  EXPECT_THAT(Error({"health"}, With({{"PSHARD_PORT", "http"}})), HasSubstr("PSHARD_PORT=\"http\""));
}

// ------------------------------------------------------------ security ----

TEST(EntrypointSecurity, AMountedTlsFolderAndATokenFileBecomeFlags) {
  Environment env = TrainerBase();
  env["PSHARD_RANK"] = "0";
  env["PSHARD_TLS_DIR"] = "/etc/pshard/tls";
  env["PSHARD_TLS_SERVER_NAME"] = "pshard-server";
  env["PSHARD_AUTH_TOKEN_FILE"] = "/etc/pshard/tokens";
  Facts facts = With(env);
  facts.file_exists = [](const std::string& path) { return path.rfind("/etc/pshard/", 0) == 0; };
  LaunchPlan plan = Ok({"trainer"}, facts);
  EXPECT_THAT(plan.args, ::testing::IsSupersetOf({std::string("--tls_cert=/etc/pshard/tls/tls.crt"),
                                                 std::string("--tls_key=/etc/pshard/tls/tls.key"),
                                                 std::string("--tls_ca=/etc/pshard/tls/ca.crt"),
                                                 std::string("--tls_server_name=pshard-server"),
                                                 std::string("--auth_token_file=/etc/pshard/tokens")}));
  // The health check verifies the server with the CA, and sends nothing.
  facts.env = {{"PSHARD_TLS_DIR", "/etc/pshard/tls"}};
  plan = Ok({"health"}, facts);
  EXPECT_EQ(plan.health_tls_ca, "/etc/pshard/tls/ca.crt");
  EXPECT_EQ(plan.health_tls_server_name, "localhost");
}

TEST(EntrypointSecurity, MissingFilesAndANameWithoutTlsAreRefused) {
  Environment env = TrainerBase();
  env["PSHARD_RANK"] = "0";
  env["PSHARD_TLS_SERVER_NAME"] = "pshard-server";
  EXPECT_THAT(Error({"trainer"}, With(env)), HasSubstr("PSHARD_TLS_SERVER_NAME is set but PSHARD_TLS_DIR is not"));
  env = TrainerBase();
  env["PSHARD_RANK"] = "0";
  env["PSHARD_TLS_DIR"] = "/secrets";
  Facts facts = With(env);
  facts.file_exists = [](const std::string& path) { return path != "/secrets/tls.key"; };
  EXPECT_THAT(Error({"trainer"}, facts), HasSubstr("PSHARD_TLS_DIR=/secrets has no readable tls.key"));
  env = TrainerBase();
  env["PSHARD_RANK"] = "0";
  env["PSHARD_AUTH_TOKEN_FILE"] = "/secrets/tokens";
  facts = With(env);
  facts.file_exists = [](const std::string&) { return false; };
  EXPECT_THAT(Error({"trainer"}, facts), HasSubstr("PSHARD_AUTH_TOKEN_FILE=/secrets/tokens cannot be read"));
}

// -------------------------------------------------------- link shaping ----

TEST(EntrypointShaping, RootShapesWithTbfAndDropsToThePshardUser) {
  Environment env = TrainerBase();
  env["RANK"] = "0";
  env["PSHARD_LINK_RATE"] = "100mbit";
  env["PSHARD_LINK_DELAY"] = "20ms";
  Facts facts = With(env);
  facts.is_root = true;
  LaunchPlan plan = Ok({"trainer"}, facts);
  ASSERT_TRUE(plan.shaping.has_value());
  EXPECT_EQ(plan.shaping->rate_bits_per_second, 100000000);
  EXPECT_EQ(plan.shaping->device, "eth0");
  EXPECT_GE(plan.shaping->burst_bytes, 100000000 / 8 / 100);
  EXPECT_TRUE(plan.shaping_may_fall_back);
  EXPECT_THAT(plan.unset_env, Contains("PSHARD_LINK_RATE"));
  EXPECT_THAT(plan.unset_env, Not(Contains("PSHARD_LINK_DELAY")));  // latency stays in process
  const std::vector<std::string> tc = plan.shaping->TcCommand();
  EXPECT_EQ(tc[0], "tc");
  EXPECT_THAT(tc, Contains("tbf"));
  EXPECT_THAT(tc, Contains("100000000bit"));
  EXPECT_EQ(plan.uid, 10001);
  EXPECT_EQ(plan.gid, 10001);

  env["PSHARD_RUN_AS_ROOT"] = "1";
  facts.env = env;
  EXPECT_EQ(Ok({"trainer"}, facts).uid, -1);
}

TEST(EntrypointShaping, WithoutRootTheRateIsEmulatedInProcess) {
  Environment env = TrainerBase();
  env["RANK"] = "0";
  env["PSHARD_LINK_RATE"] = "10mbit";
  LaunchPlan plan = Ok({"trainer"}, With(env));
  EXPECT_FALSE(plan.shaping.has_value());
  EXPECT_TRUE(plan.unset_env.empty());  // the trainer reads PSHARD_LINK_RATE itself
  env["PSHARD_LINK_SHAPER"] = "tc";
  absl::StatusOr<LaunchPlan> strict = Plan({"trainer"}, With(env));
  ASSERT_FALSE(strict.ok());
  EXPECT_THAT(strict.status().message(), HasSubstr("needs the container to start as root with NET_ADMIN"));
  env["PSHARD_LINK_SHAPER"] = "kernel";
  EXPECT_THAT(Error({"trainer"}, With(env)), HasSubstr("expected auto, tc or process"));
  env["PSHARD_LINK_SHAPER"] = "process";
  Facts root = With(env);
  root.is_root = true;
  EXPECT_FALSE(Ok({"trainer"}, root).shaping.has_value());
}

TEST(EntrypointShaping, BadRatesAreRefused) {
  Environment env = TrainerBase();
  env["RANK"] = "0";
  for (const std::string bad : {"fast", "100", "-5mbit", "0mbit", "mbit", "1e20gbit", "99999gbit"}) {
    env["PSHARD_LINK_RATE"] = bad;
    const std::string error = Error({"trainer"}, With(env));
    EXPECT_THAT(error, HasSubstr("PSHARD_LINK_RATE: ")) << bad;
    EXPECT_THAT(error, HasSubstr(bad)) << bad;
  }
}

TEST(EntrypointShaping, RateUnits) {
  EXPECT_EQ(*ParseRate("1gbit"), 1000000000);
  EXPECT_EQ(*ParseRate("2.5Mbit"), 2500000);
  EXPECT_EQ(*ParseRate("800kbit"), 800000);
  EXPECT_EQ(*ParseRate("5000bit"), 5000);
  EXPECT_EQ(*ParseRate("10mbps"), 80000000);
  EXPECT_EQ(*ParseRate(" 1kbps "), 8000);
}

}  // namespace
}  // namespace pshard::entrypoint
