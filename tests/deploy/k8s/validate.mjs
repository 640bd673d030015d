// Validates the Kubernetes deployment in deploy/k8s without a cluster.
//
// For every overlay under deploy/k8s/overlays: renders it with
// `kubectl kustomize`, validates every object against the schema of its
// apiVersion and kind (Kubernetes, Prometheus Operator), and checks what the
// pshard programs rely on: server count and Job size agree with the
// environment, names resolve, probes and ports line up, the dashboard is the
// project's, and what each component of the overlay promises is there.
//
//   node validate.mjs              validate every overlay
//   node validate.mjs --self-test  show that broken input is rejected
//
// Exits 0 when everything holds, 1 otherwise.

import { execFileSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { isDeepStrictEqual } from "node:util";
import yaml from "js-yaml";

const kHere = path.dirname(fileURLToPath(import.meta.url));
const kRepo = path.resolve(kHere, "../../..");
const kK8sDir = path.join(kRepo, "deploy/k8s");
const kOverlaysDir = path.join(kK8sDir, "overlays");
const kComponentsDir = path.join(kK8sDir, "components");
const kDashboard = "dashboards/grafana/pshard.json";

const kServerName = "pshard-server";
const kTrainerName = "pshard-trainer";
const kUid = 10001;
const kStateDir = "/var/lib/pshard";
const kDefaultConfigDir = "/etc/pshard";
const kTlsHealthCommand = ["/usr/local/bin/pshard-entrypoint", "health"];
// Where each role's flags are defined, and the flags the entrypoint derives
// from the environment (a flagfile setting them would be overridden).
const kRoleFlags = {
  server: {
    main: "shard_server/server_main.cc",
    from_env: ["shard_index", "num_shards", "num_trainers", "address", "metrics_address", "coordinator",
               "checkpoint_dir"],
  },
  trainer: {
    main: "trainer_client/trainer_main.cc",
    from_env: ["servers", "rank", "metrics_address", "join_timeout"],
  },
};

// ---------------------------------------------------------------------------
// Schema validation

// The models module of an apiVersion, or null when no installed package
// models its group.
function ModelModule(api_version) {
  if (!/^([a-z0-9.-]+\/)?v[0-9a-z]+$/.test(api_version)) return null;
  if (api_version.startsWith("monitoring.coreos.com/")) {
    return `@kubernetes-models/prometheus-operator/${api_version}`;
  }
  if (api_version.startsWith("cert-manager.io/")) {
    return `@kubernetes-models/cert-manager/${api_version}`;
  }
  return `kubernetes-models/${api_version}`;
}

const model_modules = new Map();

// The model class of a document's apiVersion and kind; throws when there is
// none, so an object nothing can check is an error, not a pass.
async function ModelClass(doc) {
  const what = `${doc?.apiVersion}/${doc?.kind}`;
  const module_name = ModelModule(String(doc?.apiVersion ?? ""));
  if (module_name === null) throw new Error(`no schema for ${what}`);
  if (!model_modules.has(module_name)) {
    model_modules.set(module_name, await import(module_name).catch(() => null));
  }
  const cls = model_modules.get(module_name)?.[doc.kind];
  // Nested types (StatefulSetSpec, ...) are exported too; only top-level
  // kinds carry their own apiVersion and kind.
  if (typeof cls !== "function" || cls.apiVersion !== doc.apiVersion || cls.kind !== doc.kind) {
    throw new Error(`no schema for ${what}`);
  }
  return cls;
}

// Schema errors of one object ([] when valid).
async function SchemaErrors(doc) {
  const name = `${doc?.kind ?? "?"} ${doc?.metadata?.name ?? "?"}`;
  try {
    const cls = await ModelClass(doc);
    new cls(doc).validate();
    return [];
  } catch (err) {
    return [`${name}: ${err.message}`];
  }
}

// ---------------------------------------------------------------------------
// Reading rendered objects

function Find(docs, kind, name) {
  return docs.find((d) => d.kind === kind && d.metadata?.name === name);
}

// True when every label the selector asks for is on `labels`.
function Selects(match_labels, labels) {
  const wanted = Object.entries(match_labels ?? {});
  return wanted.length > 0 && wanted.every(([k, v]) => labels?.[k] === v);
}

function ConfigMapData(docs, name) {
  return Find(docs, "ConfigMap", name)?.data;
}

// A container's environment as the kubelet builds it (envFrom, then env on
// top), with ConfigMap references resolved. Unresolvable references are
// reported through `errors`.
function ContainerEnv(docs, container, where, errors) {
  const env = new Map();
  for (const source of container.envFrom ?? []) {
    const ref = source.configMapRef?.name;
    if (!ref) continue;
    const data = ConfigMapData(docs, ref);
    if (!data) errors.push(`${where}: envFrom names ConfigMap ${ref}, which is not rendered`);
    for (const [k, v] of Object.entries(data ?? {})) env.set((source.prefix ?? "") + k, v);
  }
  for (const e of container.env ?? []) {
    if (e.value !== undefined) {
      env.set(e.name, e.value);
    } else if (e.valueFrom?.configMapKeyRef) {
      const { name, key } = e.valueFrom.configMapKeyRef;
      const value = ConfigMapData(docs, name)?.[key];
      if (value === undefined) errors.push(`${where}: ${e.name} refers to ${name}[${key}], which is not rendered`);
      env.set(e.name, value);
    } else {
      env.set(e.name, undefined);  // from a field or a secret
    }
  }
  return env;
}

function EnvSource(container, name) {
  return (container.env ?? []).find((e) => e.name === name);
}

function PortOf(container, port_name) {
  return (container.ports ?? []).find((p) => p.name === port_name)?.containerPort;
}

function MountPath(container, volume_name) {
  return (container.volumeMounts ?? []).find((m) => m.name === volume_name)?.mountPath;
}

function GpuLimit(container) {
  return Number(container.resources?.limits?.["nvidia.com/gpu"] ?? 0);
}

// Every pod template in the rendered output, with where it came from.
function PodTemplates(docs) {
  return docs
    .filter((d) => d.spec?.template?.spec?.containers)
    .map((d) => ({ where: `${d.kind} ${d.metadata.name}`, template: d.spec.template }));
}

// A flagfile as a Map flag -> value; format errors go to `errors`.
function ParseFlagfile(text, where, errors) {
  const flags = new Map();
  text.split("\n").forEach((raw, i) => {
    const line = raw.trim();
    if (line === "" || line.startsWith("#")) return;
    const m = /^--([A-Za-z0-9_]+)=(.*)$/.exec(line);
    if (!m) {
      errors.push(`${where}:${i + 1}: not a --flag=value line: ${line}`);
    } else if (flags.has(m[1])) {
      errors.push(`${where}:${i + 1}: --${m[1]} given twice`);
    } else {
      flags.set(m[1], m[2]);
    }
  });
  return flags;
}

const defined_flags = new Map();

// Names of the flags a program defines (ABSL_FLAG in its main file).
function DefinedFlags(main_file) {
  if (!defined_flags.has(main_file)) {
    const source = fs.readFileSync(path.join(kRepo, main_file), "utf8");
    defined_flags.set(main_file, new Set([...source.matchAll(/ABSL_FLAG\(\s*[^,]+,\s*(\w+)\s*,/g)].map((m) => m[1])));
  }
  return defined_flags.get(main_file);
}

// Flags of a role's flagfile that its program lacks or the entrypoint sets.
function CheckFlags(role, flags, where, errors) {
  const { main, from_env } = kRoleFlags[role];
  const known = DefinedFlags(main);
  for (const name of flags.keys()) {
    if (!known.has(name)) errors.push(`${where}: --${name} is not a flag of ${main}`);
    if (from_env.includes(name)) errors.push(`${where}: --${name} is set by the entrypoint from the environment`);
  }
}

// ---------------------------------------------------------------------------
// What every overlay must have

// Checks one pshard role's pod (server or trainer) and returns its container
// and environment.
function CheckRolePod(docs, owner, role, errors) {
  const where = `${owner.kind} ${owner.metadata.name}`;
  const pod = owner.spec.template;
  const labels = pod.metadata?.labels ?? {};
  if (labels["app.kubernetes.io/name"] !== owner.metadata.name ||
      labels["app.kubernetes.io/part-of"] !== "pshard" ||
      labels["app.kubernetes.io/component"] !== role) {
    errors.push(`${where}: pod labels must be app.kubernetes.io/name=${owner.metadata.name}, ` +
                `part-of=pshard, component=${role}; got ${JSON.stringify(labels)}`);
  }
  const container = pod.spec.containers.find((c) => c.name === role);
  if (!container) {
    errors.push(`${where}: no container named ${role}`);
    return null;
  }
  const cwhere = `${where} container ${role}`;
  if (!/^pshard:/.test(container.image ?? "") && !/\/pshard:/.test(container.image ?? "")) {
    errors.push(`${cwhere}: image ${container.image} is not a pshard image`);
  }
  if (container.command !== undefined) errors.push(`${cwhere}: command replaces the image's entrypoint`);
  if (container.args?.[0] !== role) errors.push(`${cwhere}: first argument must be "${role}", got ${container.args?.[0]}`);

  const env = ContainerEnv(docs, container, cwhere, errors);
  const metrics_port = PortOf(container, "metrics");
  if (metrics_port === undefined) errors.push(`${cwhere}: no port named metrics`);
  if (env.has("PSHARD_METRICS_PORT") && env.get("PSHARD_METRICS_PORT") !== String(metrics_port)) {
    errors.push(`${cwhere}: PSHARD_METRICS_PORT=${env.get("PSHARD_METRICS_PORT")} but port metrics is ${metrics_port}`);
  }
  if (pod.spec.enableServiceLinks !== false) {
    errors.push(`${where}: enableServiceLinks must be false (service variables could shadow PSHARD_*)`);
  }

  // The role's flagfile, where the entrypoint looks for it.
  const config_dir = env.get("PSHARD_CONFIG_DIR") ?? kDefaultConfigDir;
  const config_volume = (pod.spec.volumes ?? []).find(
    (v) => v.configMap && MountPath(container, v.name) === config_dir);
  const flags_text = config_volume && ConfigMapData(docs, config_volume.configMap.name)?.[`${role}.flags`];
  let flags = new Map();
  if (flags_text === undefined) {
    errors.push(`${cwhere}: no ConfigMap with ${role}.flags mounted at ${config_dir}`);
  } else {
    const fwhere = `${config_volume.configMap.name}/${role}.flags`;
    flags = ParseFlagfile(flags_text, fwhere, errors);
    CheckFlags(role, flags, fwhere, errors);
  }
  return { container, env, flags, where: cwhere };
}

function CheckServers(docs, errors) {
  const sts = Find(docs, "StatefulSet", kServerName);
  if (!sts) {
    errors.push(`no StatefulSet ${kServerName}`);
    return null;
  }
  const where = `StatefulSet ${kServerName}`;
  const svc = Find(docs, "Service", sts.spec.serviceName);
  if (!svc) {
    errors.push(`${where}: serviceName ${sts.spec.serviceName} is not a rendered Service`);
  } else {
    if (svc.spec.clusterIP !== "None") errors.push(`Service ${svc.metadata.name}: must be headless (clusterIP: None)`);
    if (svc.spec.publishNotReadyAddresses !== true) {
      errors.push(`Service ${svc.metadata.name}: publishNotReadyAddresses must be true`);
    }
    if (!Selects(svc.spec.selector, sts.spec.template.metadata?.labels)) {
      errors.push(`Service ${svc.metadata.name}: selector does not select the server pods`);
    }
  }
  if (sts.spec.podManagementPolicy !== "Parallel") errors.push(`${where}: podManagementPolicy must be Parallel`);

  const role = CheckRolePod(docs, sts, "server", errors);
  if (!role) return null;
  const { container, env } = role;
  const num_servers = env.get("PSHARD_NUM_SERVERS");
  if (num_servers === undefined || String(sts.spec.replicas) !== num_servers) {
    errors.push(`${where}: replicas ${sts.spec.replicas} != PSHARD_NUM_SERVERS ${num_servers}`);
  }

  const grpc_port = PortOf(container, "grpc");
  if (grpc_port === undefined) errors.push(`${role.where}: no port named grpc`);
  if (env.has("PSHARD_PORT") && env.get("PSHARD_PORT") !== String(grpc_port)) {
    errors.push(`${role.where}: PSHARD_PORT=${env.get("PSHARD_PORT")} but port grpc is ${grpc_port}`);
  }
  // Kubernetes' gRPC probes speak plaintext: a TLS server is probed by the
  // image's own health check, which speaks TLS.
  for (const probe of ["readinessProbe", "livenessProbe"]) {
    if (env.get("PSHARD_TLS_DIR")) {
      if (!isDeepStrictEqual(container[probe]?.exec?.command, kTlsHealthCommand)) {
        errors.push(`${role.where}: ${probe} of a TLS server must run ${JSON.stringify(kTlsHealthCommand)}`);
      }
    } else if (container[probe]?.grpc?.port !== grpc_port) {
      errors.push(`${role.where}: ${probe} must be a gRPC probe on port ${grpc_port}`);
    }
  }

  // The addresses every process is given must be these pods.
  const expected = [...Array(Number(num_servers) || 0).keys()].map(
    (i) => `${sts.metadata.name}-${i}.${sts.spec.serviceName}:${grpc_port}`);
  const addresses = ServerAddresses(env);
  if (!isDeepStrictEqual(addresses, expected)) {
    errors.push(`${role.where}: server addresses ${JSON.stringify(addresses)} are not the StatefulSet's pods ` +
                `${JSON.stringify(expected)}`);
  }

  const claim = (sts.spec.volumeClaimTemplates ?? []).find((c) => MountPath(container, c.metadata.name) === kStateDir);
  if (!claim) {
    errors.push(`${where}: no volumeClaimTemplate mounted at ${kStateDir}`);
  } else if (!claim.spec.accessModes?.includes("ReadWriteOnce") || !claim.spec.resources?.requests?.storage) {
    errors.push(`${where}: claim ${claim.metadata.name} must be ReadWriteOnce with a storage request`);
  }
  return { sts, ...role };
}

// The server addresses a pshard process derives from its environment.
function ServerAddresses(env) {
  if (env.get("PSHARD_SERVERS")) return env.get("PSHARD_SERVERS").split(",");
  const template = env.get("PSHARD_SERVER_TEMPLATE");
  const n = Number(env.get("PSHARD_NUM_SERVERS"));
  if (!template || !template.includes("{i}") || !Number.isInteger(n)) return null;
  return [...Array(n).keys()].map((i) => template.replaceAll("{i}", String(i)));
}

function CheckTrainers(docs, servers, errors) {
  const job = Find(docs, "Job", kTrainerName);
  if (!job) {
    errors.push(`no Job ${kTrainerName}`);
    return null;
  }
  const where = `Job ${kTrainerName}`;
  const pod = job.spec.template;
  if (job.spec.completionMode !== "Indexed") errors.push(`${where}: completionMode must be Indexed`);
  // A dead trainer is replaced by a pod of its index, a few times per
  // rank; one that exited 1 or 2 on its own fails its index at once (a
  // pod failure policy, which needs restartPolicy Never).
  if (pod.spec.restartPolicy !== "Never") errors.push(`${where}: restartPolicy must be Never`);
  if (!(job.spec.backoffLimitPerIndex >= 1 && job.spec.backoffLimitPerIndex <= 10)) {
    errors.push(`${where}: backoffLimitPerIndex must be set and small (1..10), got ${job.spec.backoffLimitPerIndex}`);
  }
  if (job.spec.maxFailedIndexes !== 0) {
    errors.push(`${where}: maxFailedIndexes must be 0 (a rank that fails fails the job), got ${job.spec.maxFailedIndexes}`);
  }
  const failIndex = (job.spec.podFailurePolicy?.rules ?? []).find((r) => r.action === "FailIndex");
  const codes = failIndex?.onExitCodes;
  if (!codes || codes.operator !== "In" || !codes.values.includes(1) || !codes.values.includes(2) ||
      (codes.containerName && !pod.spec.containers.some((c) => c.name === codes.containerName))) {
    errors.push(`${where}: podFailurePolicy must fail the index on the trainer's exit codes 1 and 2`);
  }
  const svc = pod.spec.subdomain && Find(docs, "Service", pod.spec.subdomain);
  if (!svc) {
    errors.push(`${where}: the pods' subdomain (${pod.spec.subdomain ?? "none"}) must be a rendered Service`);
  } else {
    if (svc.spec.clusterIP !== "None") errors.push(`Service ${svc.metadata.name}: must be headless (clusterIP: None)`);
    if (!Selects(svc.spec.selector, pod.metadata?.labels)) {
      errors.push(`Service ${svc.metadata.name}: selector does not select the trainer pods`);
    }
  }

  const role = CheckRolePod(docs, job, "trainer", errors);
  if (!role) return null;
  const { env, flags } = role;
  const num_trainers = env.get("PSHARD_NUM_TRAINERS");
  if (num_trainers === undefined || String(job.spec.completions) !== num_trainers ||
      String(job.spec.parallelism) !== num_trainers) {
    errors.push(`${where}: completions ${job.spec.completions} and parallelism ${job.spec.parallelism} ` +
                `must both equal PSHARD_NUM_TRAINERS ${num_trainers}`);
  }
  if (env.has("WORLD_SIZE") && env.get("WORLD_SIZE") !== num_trainers) {
    errors.push(`${role.where}: WORLD_SIZE ${env.get("WORLD_SIZE")} != PSHARD_NUM_TRAINERS ${num_trainers}`);
  }
  if (servers) {
    for (const name of ["PSHARD_NUM_SERVERS", "PSHARD_NUM_TRAINERS"]) {
      if (env.get(name) !== servers.env.get(name)) {
        errors.push(`${name}: ${env.get(name)} on trainers, ${servers.env.get(name)} on servers`);
      }
    }
    if (!isDeepStrictEqual(ServerAddresses(env), ServerAddresses(servers.env))) {
      errors.push(`${role.where}: server addresses differ from the servers' own`);
    }
    const context = Number(servers.flags.get("context"));
    const seq_len = Number(flags.get("seq_len"));
    if (seq_len > context) errors.push(`trainer --seq_len=${seq_len} exceeds the servers' --context=${context}`);
  }
  return { job, ...role };
}

// Security and resources of every pod template, pshard's or not.
function CheckPods(docs, errors) {
  for (const { where, template } of PodTemplates(docs)) {
    const pod_sc = template.spec.securityContext ?? {};
    if (pod_sc.runAsNonRoot !== true || pod_sc.runAsUser !== kUid || pod_sc.fsGroup !== kUid) {
      errors.push(`${where}: pod securityContext needs runAsNonRoot: true, runAsUser and fsGroup ${kUid}`);
    }
    const containers = [
      ...(template.spec.initContainers ?? []).map((c) => ({ c, init: true })),
      ...template.spec.containers.map((c) => ({ c, init: false })),
    ];
    for (const { c, init } of containers) {
      const cwhere = `${where} ${init ? "initContainer" : "container"} ${c.name}`;
      const sc = c.securityContext ?? {};
      if (sc.allowPrivilegeEscalation !== false) errors.push(`${cwhere}: allowPrivilegeEscalation must be false`);
      for (const kind of ["requests", "limits"]) {
        if (!c.resources?.[kind]?.cpu || !c.resources?.[kind]?.memory) {
          errors.push(`${cwhere}: resources.${kind} needs cpu and memory`);
        }
      }
      const added = sc.capabilities?.add ?? [];
      const root = sc.runAsUser === 0 || sc.runAsNonRoot === false;
      if (root || added.length > 0) {
        // The one exception: an init container that shapes the network.
        if (!init || !isDeepStrictEqual(added, ["NET_ADMIN"]) || !sc.capabilities?.drop?.includes("ALL")) {
          errors.push(`${cwhere}: only an init container may run as root or add capabilities, ` +
                      `and then only NET_ADMIN with ALL dropped`);
        }
      }
      // Kubernetes leaves $(VAR) as it is when VAR is not in the container's env.
      const defined = new Set([
        ...(c.env ?? []).map((e) => e.name),
        ...(c.envFrom ?? []).flatMap((s) => Object.keys(ConfigMapData(docs, s.configMapRef?.name) ?? {})),
      ]);
      for (const arg of [...(c.command ?? []), ...(c.args ?? [])]) {
        for (const [, name] of String(arg).matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
          if (!defined.has(name)) errors.push(`${cwhere}: $(${name}) in its command is not in its environment`);
        }
      }
    }
  }
}

function CheckPodMonitor(docs, pods, errors) {
  const monitors = docs.filter((d) => d.kind === "PodMonitor");
  if (monitors.length === 0) {
    errors.push("no PodMonitor");
    return;
  }
  for (const { owner, container } of pods) {
    const labels = owner.spec.template.metadata?.labels;
    const scraped = monitors.some((m) => Selects(m.spec.selector?.matchLabels, labels) &&
      (m.spec.podMetricsEndpoints ?? []).some((e) => e.port === "metrics" && (e.path ?? "/metrics") === "/metrics") &&
      PortOf(container, "metrics") !== undefined);
    if (!scraped) errors.push(`${owner.kind} ${owner.metadata.name}: no PodMonitor scrapes its port metrics at /metrics`);
  }
}

function CheckDashboard(docs, errors) {
  const maps = docs.filter((d) => d.kind === "ConfigMap" && d.metadata?.labels?.grafana_dashboard === "1");
  if (maps.length !== 1) {
    errors.push(`expected one ConfigMap labelled grafana_dashboard: "1", found ${maps.length}`);
    return;
  }
  const keys = Object.keys(maps[0].data ?? {}).filter((k) => k.endsWith(".json"));
  if (keys.length !== 1) {
    errors.push(`ConfigMap ${maps[0].metadata.name}: expected one .json key, found ${keys.length}`);
    return;
  }
  let rendered;
  try {
    rendered = JSON.parse(maps[0].data[keys[0]]);
  } catch (err) {
    errors.push(`ConfigMap ${maps[0].metadata.name}: ${keys[0]} is not JSON: ${err.message}`);
    return;
  }
  const source = JSON.parse(fs.readFileSync(path.join(kRepo, kDashboard), "utf8"));
  if (!isDeepStrictEqual(rendered, source)) {
    errors.push(`ConfigMap ${maps[0].metadata.name}: dashboard differs from ${kDashboard}`);
  }
}

// Every rendered object is pshard's.
function CheckLabels(docs, errors) {
  for (const d of docs) {
    if (d.metadata?.labels?.["app.kubernetes.io/part-of"] !== "pshard") {
      errors.push(`${d.kind} ${d.metadata?.name}: no label app.kubernetes.io/part-of=pshard`);
    }
  }
}

// ---------------------------------------------------------------------------
// What each component promises, and what its absence means

function CheckGpu(ctx, errors, present) {
  const { trainers, servers } = ctx;
  if (!trainers || !servers) return;
  const pod = trainers.job.spec.template.spec;
  if (present) {
    if (GpuLimit(trainers.container) < 1) errors.push(`${trainers.where}: no nvidia.com/gpu limit`);
    if (!/:gpu$/.test(trainers.container.image)) errors.push(`${trainers.where}: image ${trainers.container.image} is not :gpu`);
    for (const name of ["NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_DEBUG"]) {
      if (!trainers.env.get(name)) errors.push(`${trainers.where}: ${name} not set`);
    }
    const on_gpu_nodes = Object.keys(pod.nodeSelector ?? {}).some((k) => k.startsWith("nvidia.com/gpu")) &&
      (pod.tolerations ?? []).some((t) => t.key === "nvidia.com/gpu");
    if (!on_gpu_nodes) errors.push(`${trainers.where}: needs a nodeSelector and a toleration for GPU nodes`);
  }
  for (const { template, where } of PodTemplates(ctx.docs)) {
    for (const c of template.spec.containers) {
      const is_gpu_trainer = present && c === trainers.container;
      if (!is_gpu_trainer && GpuLimit(c) > 0) errors.push(`${where} container ${c.name}: asks for a GPU`);
    }
  }
}

function CheckSlowLink(ctx, errors, present) {
  const { servers, trainers, docs } = ctx;
  if (!trainers || !servers) return;
  const link_vars = ["PSHARD_LINK_RATE", "PSHARD_LINK_DELAY", "PSHARD_LINK_JITTER"];
  if (!present) {
    for (const { where, template } of PodTemplates(docs)) {
      if ((template.spec.initContainers ?? []).length > 0) errors.push(`${where}: unexpected init containers`);
    }
    for (const role of [servers, trainers]) {
      for (const name of link_vars) {
        if (role.env.has(name)) errors.push(`${role.where}: ${name} set without the slow-link component`);
      }
    }
    return;
  }
  const rate_sources = [];
  for (const role of [servers, trainers]) {
    const owner = role.sts ?? role.job;
    const where = `${owner.kind} ${owner.metadata.name}`;
    const shaper = (owner.spec.template.spec.initContainers ?? []).find((c) => {
      const argv = [...(c.command ?? []), ...(c.args ?? [])].map(String);
      const rate_at = argv.indexOf("rate");
      return argv[0] === "tc" && argv.includes("tbf") && argv.includes("eth0") &&
        argv[rate_at + 1] === "$(PSHARD_LINK_RATE)";
    });
    if (!shaper) {
      errors.push(`${where}: no init container running tc ... tbf rate $(PSHARD_LINK_RATE) on eth0`);
      continue;
    }
    if (!isDeepStrictEqual(shaper.securityContext?.capabilities?.add, ["NET_ADMIN"])) {
      errors.push(`${where} initContainer ${shaper.name}: must add the capability NET_ADMIN, and only it`);
    }
    rate_sources.push(EnvSource(shaper, "PSHARD_LINK_RATE")?.valueFrom?.configMapKeyRef);
    if (ContainerEnv(docs, shaper, where, errors).get("PSHARD_LINK_RATE") === undefined) {
      errors.push(`${where} initContainer ${shaper.name}: PSHARD_LINK_RATE has no value`);
    }
    // The kernel limits the rate; pshard limiting it too would halve it.
    if (role.env.has("PSHARD_LINK_RATE")) errors.push(`${role.where}: PSHARD_LINK_RATE belongs to the init container only`);
  }
  if (rate_sources.length === 2 && (!rate_sources[0] || !isDeepStrictEqual(rate_sources[0], rate_sources[1]))) {
    errors.push("servers and trainers must take PSHARD_LINK_RATE from the same ConfigMap key");
  }
  for (const name of ["PSHARD_LINK_DELAY", "PSHARD_LINK_JITTER"]) {
    if (!trainers.env.get(name)) errors.push(`${trainers.where}: ${name} not set`);
    if (!EnvSource(trainers.container, name)?.valueFrom?.configMapKeyRef) {
      errors.push(`${trainers.where}: ${name} must come from the link ConfigMap`);
    }
  }
}

// The Secret volume mounted whole at a role's PSHARD_TLS_DIR, or null with
// the reason in `errors`.
function TlsSecret(role, errors) {
  const owner = role.sts ?? role.job;
  const dir = role.env.get("PSHARD_TLS_DIR");
  if (!dir) {
    errors.push(`${role.where}: PSHARD_TLS_DIR not set`);
    return null;
  }
  const mount = (role.container.volumeMounts ?? []).find((m) => m.mountPath === dir);
  const volume = mount && (owner.spec.template.spec.volumes ?? []).find((v) => v.name === mount.name);
  if (!volume?.secret?.secretName) {
    errors.push(`${role.where}: no Secret volume mounted at PSHARD_TLS_DIR=${dir}`);
    return null;
  }
  // A subPath (or items) mount is never updated: rotation would not reach it.
  if (mount.subPath !== undefined || mount.subPathExpr !== undefined || volume.secret.items !== undefined) {
    errors.push(`${role.where}: Secret ${volume.secret.secretName} must be mounted whole (no subPath, no items)`);
  }
  if (mount.readOnly !== true) errors.push(`${role.where}: the TLS mount must be readOnly`);
  if (volume.secret.defaultMode !== 0o440) {
    errors.push(`${role.where}: Secret ${volume.secret.secretName} needs defaultMode 0440 (got ` +
                `${volume.secret.defaultMode === undefined ? "none" : "0" + volume.secret.defaultMode.toString(8)})`);
  }
  return volume.secret.secretName;
}

function CheckTls(ctx, errors, present) {
  const { servers, trainers } = ctx;
  if (!trainers || !servers) return;
  if (!present) {
    for (const role of [servers, trainers]) {
      if (role.env.has("PSHARD_TLS_DIR")) errors.push(`${role.where}: PSHARD_TLS_DIR set without the tls component`);
    }
    return;
  }
  const server_secret = TlsSecret(servers, errors);
  const trainer_secret = TlsSecret(trainers, errors);
  if (server_secret && server_secret === trainer_secret) {
    errors.push(`servers and trainers mount the same Secret ${server_secret}: each role needs its own certificate`);
  }
  ctx.tls_secrets = { server: server_secret, trainer: trainer_secret };
}

// True when a certificate name (possibly *.x) covers `host`.
function NameCovers(pattern, host) {
  if (pattern.startsWith("*.")) {
    const rest = host.split(".").slice(1).join(".");
    return host.includes(".") && rest === pattern.slice(2);
  }
  return pattern === host;
}

function CheckCertManager(ctx, errors, present) {
  const { docs, servers } = ctx;
  const ours = docs.filter((d) => String(d.apiVersion ?? "").startsWith("cert-manager.io/"));
  if (!present) {
    for (const d of ours) errors.push(`${d.kind} ${d.metadata?.name}: cert-manager objects without the component`);
    return;
  }
  if (!ctx.tls_secrets) {
    errors.push("the cert-manager component issues the tls component's Secrets: include both");
    return;
  }
  const certificates = ours.filter((d) => d.kind === "Certificate");
  const issuer_of = new Map();
  for (const [role, secret] of Object.entries(ctx.tls_secrets)) {
    if (!secret) continue;
    const cert = certificates.find((c) => c.spec?.secretName === secret);
    if (!cert) {
      errors.push(`no Certificate writes the ${role}s' Secret ${secret}`);
      continue;
    }
    const where = `Certificate ${cert.metadata.name}`;
    if (!isDeepStrictEqual(cert.spec.subject?.organizationalUnits, [role])) {
      errors.push(`${where}: subject.organizationalUnits must be exactly [${role}] (the role), got ` +
                  `${JSON.stringify(cert.spec.subject?.organizationalUnits)}`);
    }
    const usages = cert.spec.usages ?? [];
    if (!usages.includes("client auth")) errors.push(`${where}: usages must include client auth`);
    if (role === "server") {
      if (!usages.includes("server auth")) errors.push(`${where}: usages must include server auth`);
      const names = cert.spec.dnsNames ?? [];
      const hosts = ["localhost", ...(ServerAddresses(servers.env) ?? []).map((a) => a.replace(/:[0-9]+$/, ""))];
      for (const host of hosts) {
        if (!names.some((n) => NameCovers(n, host))) errors.push(`${where}: dnsNames do not cover ${host}`);
      }
    }
    if (cert.spec.isCA) errors.push(`${where}: a role's certificate must not be a CA`);
    const ref = cert.spec.issuerRef ?? {};
    const issuer = Find(docs, ref.kind ?? "Issuer", ref.name);
    if (!issuer) errors.push(`${where}: issuerRef ${ref.kind ?? "Issuer"} ${ref.name} is not rendered`);
    issuer_of.set(role, `${ref.kind ?? "Issuer"}/${ref.name}`);
    // The issuer must be a CA whose key is itself a rendered CA certificate.
    const ca_secret = issuer?.spec?.ca?.secretName;
    if (issuer && !ca_secret) errors.push(`${where}: issuer ${ref.name} is not a CA issuer (spec.ca)`);
    if (ca_secret && !certificates.some((c) => c.spec?.secretName === ca_secret && c.spec?.isCA === true)) {
      errors.push(`Issuer ${ref.name}: no CA Certificate (isCA: true) writes its Secret ${ca_secret}`);
    }
  }
  if (new Set(issuer_of.values()).size > 1) {
    errors.push(`servers and trainers are issued by different issuers (${[...issuer_of.values()].join(", ")}): ` +
                "each checks the other against one CA");
  }
}

// Component directory name -> its check; `present` says whether the overlay
// includes it. An overlay naming a component without a check here fails.
// tls comes before cert-manager, which checks the Secrets tls mounts.
const kComponentChecks = { gpu: CheckGpu, "slow-link": CheckSlowLink, tls: CheckTls, "cert-manager": CheckCertManager };

// ---------------------------------------------------------------------------
// Putting it together

// All errors of one rendered overlay; `components` are the names of the
// components it includes.
async function CheckRendered(docs, components) {
  const errors = [];
  for (const doc of docs) errors.push(...await SchemaErrors(doc));
  for (const name of components) {
    if (!(name in kComponentChecks)) errors.push(`component ${name} has no checks in validate.mjs`);
  }
  const servers = CheckServers(docs, errors);
  const trainers = CheckTrainers(docs, servers, errors);
  CheckPods(docs, errors);
  CheckPodMonitor(docs, [servers, trainers].filter(Boolean).map(
    (r) => ({ owner: r.sts ?? r.job, container: r.container })), errors);
  CheckDashboard(docs, errors);
  CheckLabels(docs, errors);
  const ctx = { docs, servers, trainers };
  for (const [name, check] of Object.entries(kComponentChecks)) check(ctx, errors, components.includes(name));
  return errors;
}

function KustomizationFile(dir) {
  return ["kustomization.yaml", "kustomization.yml", "Kustomization"]
    .map((f) => path.join(dir, f)).find((f) => fs.existsSync(f));
}

function Overlays() {
  return fs.readdirSync(kOverlaysDir, { withFileTypes: true })
    .filter((e) => e.isDirectory()).map((e) => path.join(kOverlaysDir, e.name)).sort();
}

// Names of the components under deploy/k8s/components an overlay includes.
function ComponentsOf(overlay_dir) {
  const kustomization = yaml.load(fs.readFileSync(KustomizationFile(overlay_dir), "utf8")) ?? {};
  return (kustomization.components ?? []).map((c) => path.relative(kComponentsDir, path.resolve(overlay_dir, c)));
}

function Render(overlay_dir) {
  try {
    const out = execFileSync("kubectl", ["kustomize", overlay_dir],
                             { encoding: "utf8", maxBuffer: 64 << 20, stdio: ["ignore", "pipe", "pipe"] });
    return yaml.loadAll(out).filter((d) => d != null);
  } catch (err) {
    throw new Error(`kubectl kustomize ${path.relative(kRepo, overlay_dir)} failed: ${(err.stderr || err.message).trim()}`);
  }
}

function Summary(docs) {
  const counts = new Map();
  for (const d of docs) counts.set(d.kind, (counts.get(d.kind) ?? 0) + 1);
  return [...counts].sort().map(([k, n]) => `${n} ${k}`).join(", ");
}

async function ValidateAll() {
  let failed = false;
  const fail = (msg) => { failed = true; console.error(`FAIL ${msg}`); };

  const overlays = Overlays();
  if (overlays.length === 0) fail(`no overlays under ${path.relative(kRepo, kOverlaysDir)}`);
  const used_components = new Set();
  for (const dir of overlays) {
    const name = path.basename(dir);
    if (!KustomizationFile(dir)) {
      fail(`${name}: no kustomization.yaml`);
      continue;
    }
    const components = ComponentsOf(dir);
    components.forEach((c) => used_components.add(c));
    let docs;
    try {
      docs = Render(dir);
    } catch (err) {
      fail(`${name}: ${err.message}`);
      continue;
    }
    const errors = await CheckRendered(docs, components);
    const label = components.length ? ` [components: ${components.join(", ")}]` : "";
    if (errors.length === 0) {
      console.log(`ok   ${name}${label}: ${docs.length} objects (${Summary(docs)})`);
    } else {
      errors.forEach((e) => fail(`${name}: ${e}`));
    }
  }
  if (fs.existsSync(kComponentsDir)) {
    for (const e of fs.readdirSync(kComponentsDir, { withFileTypes: true })) {
      if (e.isDirectory() && !used_components.has(e.name)) {
        fail(`component ${e.name} is in no overlay, so nothing validates it`);
      }
    }
  }
  return !failed;
}

// ---------------------------------------------------------------------------
// Self-test: the same checks, fed input that must be refused

const kBrokenObjects = [
  ["a StatefulSet with replicas: \"four\"", {
    apiVersion: "apps/v1", kind: "StatefulSet", metadata: { name: "s" },
    spec: { replicas: "four", serviceName: "s", selector: { matchLabels: { a: "b" } },
            template: { metadata: { labels: { a: "b" } }, spec: { containers: [{ name: "c", image: "i" }] } } },
  }],
  ["a Pod whose container has no name", {
    apiVersion: "v1", kind: "Pod", metadata: { name: "p" }, spec: { containers: [{ image: "i" }] },
  }],
  ["a kind of an unknown group", { apiVersion: "example.com/v1", kind: "Widget", metadata: { name: "w" } }],
  ["a kind unknown to a known group", { apiVersion: "v1", kind: "Servce", metadata: { name: "s" } }],
  ["a nested type posing as a kind", { apiVersion: "apps/v1", kind: "StatefulSetSpec", metadata: { name: "s" } }],
  ["a Certificate with a string for its usages", {
    apiVersion: "cert-manager.io/v1", kind: "Certificate", metadata: { name: "c" },
    spec: { secretName: "s", issuerRef: { name: "i" }, usages: "client auth" },
  }],
  ["a PodMonitor with a string for its endpoints", {
    apiVersion: "monitoring.coreos.com/v1", kind: "PodMonitor", metadata: { name: "m" },
    spec: { selector: {}, podMetricsEndpoints: "metrics" },
  }],
];

const Server = (docs) => Find(docs, "StatefulSet", kServerName);
const Trainer = (docs) => Find(docs, "Job", kTrainerName);

// Changes to a correct rendering, each of which must be caught.
const kBrokenRenderings = [
  ["server replicas one more than PSHARD_NUM_SERVERS", (d) => { Server(d).spec.replicas += 1; }],
  ["Job completions one less than PSHARD_NUM_TRAINERS", (d) => { Trainer(d).spec.completions -= 1; }],
  ["the Job not Indexed", (d) => { delete Trainer(d).spec.completionMode; }],
  ["no StatefulSet", (d) => { d.splice(d.indexOf(Server(d)), 1); }],
  ["the server Service not headless", (d) => { delete Find(d, "Service", kServerName).spec.clusterIP; }],
  ["the server Service hiding unready pods",
   (d) => { Find(d, "Service", kServerName).spec.publishNotReadyAddresses = false; }],
  ["no subdomain on trainers", (d) => { delete Trainer(d).spec.template.spec.subdomain; }],
  ["a liveness probe on another port",
   (d) => { Server(d).spec.template.spec.containers[0].livenessProbe.grpc.port = 7071; }],
  ["a trainer that may escalate privileges",
   (d) => { Trainer(d).spec.template.spec.containers[0].securityContext.allowPrivilegeEscalation = true; }],
  ["a server without memory limit",
   (d) => { delete Server(d).spec.template.spec.containers[0].resources.limits.memory; }],
  ["an edited dashboard", (d) => {
    const cm = d.find((x) => x.metadata?.labels?.grafana_dashboard === "1");
    const key = Object.keys(cm.data)[0];
    cm.data[key] = JSON.stringify({ ...JSON.parse(cm.data[key]), title: "edited" });
  }],
  ["a PodMonitor that selects nothing",
   (d) => { d.find((x) => x.kind === "PodMonitor").spec.selector.matchLabels = { nothing: "here" }; }],
  ["a bad line in server.flags", (d) => {
    const cm = d.find((x) => x.data?.["server.flags"] !== undefined);
    cm.data["server.flags"] += "layers 4\n";
  }],
  ["a flag the trainer does not have", (d) => {
    const cm = d.find((x) => x.data?.["trainer.flags"] !== undefined);
    cm.data["trainer.flags"] += "--sequence_length=64\n";
  }],
  ["a flag the entrypoint sets in server.flags", (d) => {
    const cm = d.find((x) => x.data?.["server.flags"] !== undefined);
    cm.data["server.flags"] += "--num_shards=4\n";
  }],
  ["an object of an unknown kind", (d) => { d.push({ apiVersion: "example.com/v1", kind: "Widget",
                                                     metadata: { name: "w", labels: { "app.kubernetes.io/part-of": "pshard" } } }); }],
  ["a trainer asking for a GPU outside the gpu component", (d) => {
    Trainer(d).spec.template.spec.containers[0].resources.limits["nvidia.com/gpu"] = 1;
  }],
  ["a root init container outside the slow-link component", (d) => {
    const c = structuredClone(Server(d).spec.template.spec.containers[0]);
    Object.assign(c, { name: "x", securityContext: { runAsUser: 0, allowPrivilegeEscalation: false } });
    Server(d).spec.template.spec.initContainers = [c];
  }],
];

const ServerContainer = (docs) => Server(docs).spec.template.spec.containers[0];
const TlsVolume = (owner) => owner.spec.template.spec.volumes.find((v) => v.secret);
const CertificateOf = (docs, name) => Find(docs, "Certificate", name);

// Changes to the rendered tls overlay, each of which must be caught.
const kBrokenTlsRenderings = [
  ["the servers' Secret mounted by subPath", (d) => {
    const mount = ServerContainer(d).volumeMounts.find((m) => m.name === TlsVolume(Server(d)).name);
    mount.subPath = "tls.crt";
  }],
  ["a Secret readable by all", (d) => { TlsVolume(Trainer(d)).secret.defaultMode = 0o644; }],
  ["trainers mounting the servers' Secret",
   (d) => { TlsVolume(Trainer(d)).secret.secretName = TlsVolume(Server(d)).secret.secretName; }],
  ["a plaintext gRPC probe on a TLS server",
   (d) => { ServerContainer(d).readinessProbe = { grpc: { port: 7070 }, periodSeconds: 5 }; }],
  ["a trainer certificate with the server role",
   (d) => { CertificateOf(d, "pshard-trainer-tls").spec.subject.organizationalUnits = ["server"]; }],
  ["a server certificate without localhost", (d) => {
    const spec = CertificateOf(d, "pshard-server-tls").spec;
    spec.dnsNames = spec.dnsNames.filter((n) => n !== "localhost");
  }],
  ["a server certificate not for the names dialled",
   (d) => { CertificateOf(d, "pshard-server-tls").spec.dnsNames = ["localhost", "*.pshard-servers"]; }],
  ["a trainer certificate from another issuer",
   (d) => { CertificateOf(d, "pshard-trainer-tls").spec.issuerRef.name = "pshard-selfsigned"; }],
];

async function SelfTest() {
  let failed = false;
  const fail = (msg) => { failed = true; console.error(`FAIL self-test: ${msg}`); };

  for (const [what, doc] of kBrokenObjects) {
    const errors = await SchemaErrors(doc);
    if (errors.length === 0) fail(`${what} passed schema validation`);
    else console.log(`ok   rejected ${what}: ${errors[0]}`);
  }

  // Renderings: a plain overlay (no components) must pass as it is, then
  // fail with each change.
  const plain = Overlays().find((dir) => KustomizationFile(dir) && ComponentsOf(dir).length === 0);
  if (!plain) {
    fail("no overlay without components to break");
    return false;
  }
  const docs = Render(plain);
  const baseline = await CheckRendered(docs, []);
  if (baseline.length > 0) {
    fail(`overlay ${path.basename(plain)} must pass before it can be broken, but it fails ` +
         `(${baseline.length} errors, first: ${baseline[0]}); run node validate.mjs for all of them`);
    return false;
  }
  for (const [what, mutate] of kBrokenRenderings) {
    const broken = structuredClone(docs);
    mutate(broken);
    const errors = await CheckRendered(broken, []);
    if (errors.length === 0) fail(`${path.basename(plain)} with ${what} passed`);
    else console.log(`ok   rejected ${what}: ${errors[0]}`);
  }
  // The TLS overlay: passes as it is, fails with each change.
  const tls = Overlays().find((dir) => path.basename(dir) === "tls");
  if (!tls) {
    fail("no overlay tls to break");
  } else {
    const tls_docs = Render(tls);
    const tls_components = ComponentsOf(tls);
    const tls_baseline = await CheckRendered(tls_docs, tls_components);
    if (tls_baseline.length > 0) {
      fail(`overlay tls must pass before it can be broken, but it fails (first: ${tls_baseline[0]})`);
    } else {
      for (const [what, mutate] of kBrokenTlsRenderings) {
        const broken = structuredClone(tls_docs);
        mutate(broken);
        const errors = await CheckRendered(broken, tls_components);
        if (errors.length === 0) fail(`tls with ${what} passed`);
        else console.log(`ok   rejected ${what}: ${errors[0]}`);
      }
    }
  }
  // The component checks, asked about an overlay that lacks the component.
  for (const name of Object.keys(kComponentChecks)) {
    const errors = await CheckRendered(docs, [name]);
    if (errors.length === 0) fail(`${path.basename(plain)} passed as if it included component ${name}`);
    else console.log(`ok   rejected ${path.basename(plain)} claiming component ${name}: ${errors[0]}`);
  }
  if (!failed) {
    console.log(`self-test: ${kBrokenObjects.length + kBrokenRenderings.length + kBrokenTlsRenderings.length +
                            Object.keys(kComponentChecks).length} ` +
                `broken inputs, all rejected`);
  }
  return !failed;
}

const self_test = process.argv.includes("--self-test");
try {
  const ok = self_test ? await SelfTest() : await ValidateAll();
  if (!ok) {
    console.error(self_test ? "self-test FAILED" : "deploy/k8s validation FAILED");
    process.exit(1);
  }
} catch (err) {
  console.error(`FAIL ${err.message}`);
  process.exit(1);
}
