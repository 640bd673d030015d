#!/usr/bin/env python3
"""Tests of deploy/compose, by running it.

  compose_test.py config   the shipped files are the generator's output, and
                           every file and variant passes `docker-compose config`
  compose_test.py e2e      builds the CPU image, brings the stack up with
                           podman-compose (3 servers, 2 trainers, Prometheus)
                           with mutual TLS (compose.tls.yaml), waits for health, lets training run and checks the
                           loss, that Prometheus scraped every process, that a
                           restart resumes from the checkpoints on the volumes
                           and that the stack tears down cleanly; then the
                           slow-link variant at a low rate, whose exposed
                           communication must rise as the rate predicts.

Exit status 77 means "skipped" (no root, no podman); ctest reads it so.
"""

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

import yaml  # python3-yaml, which docker-compose depends on

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
COMPOSE_DIR = os.path.join(ROOT, "deploy", "compose")
SKIP = 77
BASE_IMAGE = os.environ.get("PSHARD_BASE_IMAGE", "localhost/debian:bookworm")
IMAGE = "localhost/pshard:cpu"
PROMETHEUS_IMAGE = "localhost/pshard-test-prometheus:latest"
# Steps per run: enough for the loss to fall, short enough for CI.
STEPS = 60
SLOW_STEPS = 8
SLOW_RATE_BITS = 20_000_000  # 20 Mbit/s per container egress


def log(message):
    print(f"compose_test: {message}", flush=True)


class Failure(Exception):
    pass


def check(condition, message):
    if not condition:
        raise Failure(message)


def run(cmd, *, env=None, timeout=600, cwd=None, capture=True):
    """Runs a command; raises Failure naming it when it fails or times out."""
    try:
        result = subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, text=True,
                                stdout=subprocess.PIPE if capture else None,
                                stderr=subprocess.STDOUT if capture else None)
    except subprocess.TimeoutExpired:
        raise Failure(f"`{' '.join(cmd)}` did not finish within {timeout} s")
    if result.returncode != 0:
        tail = (result.stdout or "")[-3000:]
        raise Failure(f"`{' '.join(cmd)}` exited with {result.returncode}:\n{tail}")
    return result.stdout or ""


def compose_services(path):
    """Service names of a generated compose file, in order."""
    names = []
    in_services = False
    with open(path) as f:
        for line in f:
            if line.startswith("services:"):
                in_services = True
            elif in_services and re.match(r"^\S", line):
                in_services = False
            elif in_services:
                m = re.match(r"^  ([a-z0-9-]+):\s*$", line)
                if m:
                    names.append(m.group(1))
    return names


# ---------------------------------------------------------------- config ----

VARIANTS = [["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"], ["compose.yaml", "compose.slow-link.yaml"],
            ["compose.yaml", "compose.gpu.yaml", "compose.slow-link.yaml"], ["compose.yaml", "compose.tls.yaml"],
            ["compose.yaml", "compose.gpu.yaml", "compose.slow-link.yaml", "compose.tls.yaml"]]


def test_config():
    # The shipped files are exactly what the generator writes for 3 and 2
    # (generated in place, then put back as they were).
    generated = ["compose.yaml", "compose.gpu.yaml", "compose.slow-link.yaml", "compose.tls.yaml", "prometheus.yml"]
    shipped = {}
    for name in generated:
        with open(os.path.join(COMPOSE_DIR, name)) as f:
            shipped[name] = f.read()
    try:
        run([os.path.join(COMPOSE_DIR, "generate.sh"), "--servers", "3", "--trainers", "2"])
        for name in generated:
            with open(os.path.join(COMPOSE_DIR, name)) as f:
                check(f.read() == shipped[name], f"deploy/compose/{name} differs from generate.sh's output: "
                      f"run deploy/compose/generate.sh")
    finally:
        for name, text in shipped.items():
            with open(os.path.join(COMPOSE_DIR, name), "w") as f:
                f.write(text)
    log("shipped files equal generate.sh --servers 3 --trainers 2")
    # Other sizes render to valid files with the right services.
    with generated_dir("config-services", ["--servers", "5", "--trainers", "4"]) as out:
        services = compose_services(os.path.join(out, "compose.yaml"))
        check(services == [f"server-{i}" for i in range(5)] + [f"trainer-{r}" for r in range(4)] +
              ["prometheus", "grafana"], f"generate.sh --servers 5 --trainers 4 gave services {services}")
    with generated_dir("config-5x4", ["--servers", "5", "--trainers", "4"]) as out:
        validate_variants(out, expect_servers=5, expect_trainers=4)
    with generated_dir("config-hosts", ["--server-hosts", "10.0.0.1,10.0.0.2,10.0.0.1",
                                        "--trainer-hosts", "10.0.0.3,10.0.0.4"]) as out:
        validate_variants(out, expect_servers=3, expect_trainers=2)
        rendered = run(["docker-compose", "-f", os.path.join(out, "compose.yaml"), "config"], cwd=out)
        check("PSHARD_SERVERS: 10.0.0.1:7070,10.0.0.2:7071,10.0.0.1:7072" in rendered,
              "several hosts: the server list is not the hosts' addresses")
        check(rendered.count("network_mode: host") == 7, "several hosts: not every service uses host networking")
        with open(os.path.join(out, "compose.tls.yaml")) as f:
            text = f.read()
        check("--hosts=localhost,127.0.0.1,10.0.0.1,10.0.0.2 " in text,
              f"several hosts: compose.tls.yaml's make-certs line does not name each server host once:\n{text[:900]}")
        with open(os.path.join(out, "prometheus.yml")) as f:
            text = f.read()
        check("'10.0.0.1:9402'" in text and "'10.0.0.4:9501'" in text, f"several hosts: prometheus.yml\n{text}")
    validate_variants(COMPOSE_DIR, expect_servers=3, expect_trainers=2)
    # Bad arguments are refused with a reason.
    for args, reason in [(["--servers", "0"], "positive integers"),
                         (["--server-hosts", "a,b"], "go together"),
                         (["--server-hosts", "a,b", "--trainer-hosts", "c", "--servers", "3"], "but 2 server hosts"),
                         (["--server-hosts", "a;b", "--trainer-hosts", "c"], "not a host name"),
                         (["--out", "/tmp"], "inside the repository"),
                         (["--servers"], "needs a value")]:
        bad = subprocess.run([os.path.join(COMPOSE_DIR, "generate.sh")] + args, capture_output=True, text=True)
        check(bad.returncode != 0 and reason in bad.stderr, f"generate.sh {' '.join(args)}: {bad.stderr}")


@contextlib.contextmanager
def generated_dir(name, args):
    """Compose files generated into a scratch folder inside the repository
    (they mount deploy/compose/config and dashboards/ by relative path)."""
    out = os.path.join(COMPOSE_DIR, f".e2e-{name}-{os.getpid()}")
    try:
        run([os.path.join(COMPOSE_DIR, "generate.sh"), *args, "--out", out])
        yield out
    finally:
        shutil.rmtree(out, ignore_errors=True)


def validate_variants(folder, expect_servers, expect_trainers):
    docker_compose = shutil.which("docker-compose")
    check(docker_compose is not None, "docker-compose is not installed (tools/setup.sh installs it)")
    for files in VARIANTS:
        args = [docker_compose]
        for f in files:
            args += ["-f", os.path.join(folder, f)]
        rendered = run(args + ["config"], cwd=folder)
        services = list(yaml.safe_load(rendered)["services"])
        check(len([s for s in services if s.startswith("server-")]) == expect_servers, f"{files}: {services}")
        check(len([s for s in services if s.startswith("trainer-")]) == expect_trainers, f"{files}: {services}")
        if "compose.gpu.yaml" in files:
            check("driver: nvidia" in rendered and "capabilities:" in rendered, f"{files}: no GPU reservation")
        if "compose.slow-link.yaml" in files:
            check(rendered.count("NET_ADMIN") == expect_servers + expect_trainers, f"{files}: NET_ADMIN missing")
            check("PSHARD_LINK_DELAY" in rendered, f"{files}: no in-process latency")
        if "compose.tls.yaml" in files:
            check_tls_rendering(rendered, files, expect_servers, expect_trainers)
        log(f"docker-compose config: {' + '.join(files)} in {os.path.relpath(folder, ROOT)}: ok")


def check_tls_rendering(rendered, files, expect_servers, expect_trainers):
    """Every pshard service has PSHARD_TLS_DIR and its role's folder mounted
    whole and read-only there, next to (not instead of) its other volumes."""
    services = yaml.safe_load(rendered)["services"]
    pshard = {n: s for n, s in services.items() if n.startswith(("server-", "trainer-"))}
    check(len(pshard) == expect_servers + expect_trainers, f"{files}: services {sorted(pshard)}")
    for name, service in pshard.items():
        role = name.split("-")[0]
        check(service.get("environment", {}).get("PSHARD_TLS_DIR") == "/etc/pshard-tls",
              f"{files}: {name} has no PSHARD_TLS_DIR=/etc/pshard-tls")
        volumes = [str(v) for v in service.get("volumes", [])]
        check(any(v.endswith(f"/{role}:/etc/pshard-tls:ro") for v in volumes),
              f"{files}: {name} does not mount the {role} folder read-only at /etc/pshard-tls: {volumes}")
        check(any(v.endswith(":/etc/pshard:ro") for v in volumes), f"{files}: {name} lost its config mount: {volumes}")
    for name in set(services) - set(pshard):
        check("PSHARD_TLS_DIR" not in str(services[name]), f"{files}: {name} is not pshard's but got TLS")


# ------------------------------------------------------------------- e2e ----

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """One podman-compose project of the shipped compose files."""

    def __init__(self, name, files, env):
        self.name = name
        self.files = files
        self.env = env

    def compose(self, *args, timeout=600):
        cmd = ["podman-compose", "-p", self.name]
        for f in self.files:
            cmd += ["-f", f]
        return run(cmd + list(args), env=self.env, cwd=COMPOSE_DIR, timeout=timeout)

    def container(self, service):
        return f"{self.name}_{service}_1"

    def containers(self):
        out = run(["podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={self.name}",
                   "--format", "{{.Names}}"], env=self.env)
        return out.split()

    def logs(self, service):
        return run(["podman", "logs", self.container(service)], env=self.env)

    def exit_code(self, service):
        out = run(["podman", "inspect", self.container(service), "--format", "{{.State.ExitCode}}"], env=self.env)
        return int(out.strip())

    def wait_healthy(self, services, limit_s):
        deadline = time.time() + limit_s
        pending = list(services)
        while pending:
            # Without systemd, Podman does not run health checks on a timer:
            # run each one, as the timer would.
            pending = [s for s in pending if subprocess.run(
                ["podman", "healthcheck", "run", self.container(s)], env=self.env,
                capture_output=True).returncode != 0]
            if pending and time.time() > deadline:
                raise Failure(f"{', '.join(pending)} not healthy after {limit_s} s (grpc.health.v1 through "
                              f"`pshard-entrypoint health`)")
            if pending:
                time.sleep(1)

    def state(self, service):
        """(running, exit code) of a service's container."""
        out = run(["podman", "inspect", self.container(service), "--format", "{{.State.Running}} {{.State.ExitCode}}"],
                  env=self.env)
        running, code = out.split()
        return running == "true", int(code)

    def wait_exited(self, services, limit_s, poll_s=3):
        """Waits for every service to exit 0. Fails as soon as one exits with
        another code or logs an error (within a few seconds), or at the limit."""
        deadline = time.time() + limit_s
        pending = list(services)
        while pending:
            for s in list(pending):
                running, code = self.state(s)
                text = self.logs(s)
                error = TRAINER_ERROR.search(text)
                if not running and code != 0:
                    raise Failure(f"{s} exited with {code}; its log ends:\n{text[-3000:]}")
                if error:
                    raise Failure(f"{s} logged an error: {error.group(0)}\nits log ends:\n{text[-3000:]}")
                if not running:
                    pending.remove(s)
            if pending and time.time() > deadline:
                raise Failure(f"{', '.join(pending)} still running after {limit_s} s; the log of {pending[0]} "
                              f"ends:\n{self.logs(pending[0])[-2000:]}")
            if pending:
                time.sleep(poll_s)


# A trainer's fatal error line: "pshard-trainer: UNAVAILABLE: ..." or
# "pshard-trainer 1: step 12 failed: ...".
TRAINER_ERROR = re.compile(r"^pshard-trainer(?: \d+)?: (?:[A-Z][A-Z_]+: |step \d+ failed).*$", re.M)


def check_name_resolution(env):
    """Containers on one Podman network must find each other by name, or no
    compose service reaches another: checked in seconds, before any build."""
    backend = run(["podman", "info", "--format", "{{.Host.NetworkBackend}}"], env=env).strip()
    network = f"pshard-dns-check-{os.getpid()}"
    peer = f"pshard-dns-peer-{os.getpid()}"
    run(["podman", "network", "create", network], env=env)
    try:
        run(["podman", "run", "-d", "--rm", "--name", peer, "--network", network, BASE_IMAGE, "sleep", "60"],
            env=env, timeout=60)
        looked_up = subprocess.run(["podman", "run", "--rm", "--network", network, BASE_IMAGE, "getent", "hosts",
                                    peer], env=env, capture_output=True, text=True, timeout=60)
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", peer], env=env, capture_output=True)
        subprocess.run(["podman", "network", "rm", "-f", network], env=env, capture_output=True)
    if looked_up.returncode != 0:
        missing = ("the CNI plugin dnsname (Debian package golang-github-containernetworking-plugin-dnsname, "
                   "in tools/debian-packages.txt)" if backend == "cni" else
                   "aardvark-dns (Debian package aardvark-dns)")
        raise Failure(f"containers on a Podman network do not resolve each other's names (network backend "
                      f"{backend}; `getent hosts {peer}` from a second container: exit {looked_up.returncode} "
                      f"{looked_up.stderr.strip()}): install {missing}, e.g. with tools/setup.sh")
    log(f"containers resolve each other's names (network backend {backend})")


def prometheus_query(port, expr):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise Failure(f"Prometheus query {expr}: {body}")
    return body["data"]["result"]


def wait_prometheus_ready(port, limit_s):
    deadline = time.time() + limit_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=3) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            raise Failure(f"Prometheus on port {port} not ready after {limit_s} s")
        time.sleep(1)


TARGET_SAMPLES = []


def targets_report(port):
    """Each scrape target's health and last error, for failure messages."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets", timeout=10) as r:
            targets = json.load(r)["data"]["activeTargets"]
        return "; ".join(f"{t['scrapeUrl']} {t['health']} {t['lastError']}".strip() for t in targets)
    except OSError as e:
        return f"(targets unavailable: {e})"


def wait_for_series(port, expr, instances, limit_s=30):
    """Polls until `expr` has a series for every instance (Prometheus may
    still be ingesting the last scrapes); returns them by instance."""
    deadline = time.time() + limit_s
    while True:
        got = by_instance(prometheus_query(port, expr))
        if all(i in got for i in instances):
            return got
        if time.time() > deadline:
            raise Failure(f"Prometheus has no {expr} for {sorted(set(instances) - set(got))} after {limit_s} s; "
                          f"targets now: {targets_report(port)}; while training:\n" + "\n".join(TARGET_SAMPLES))
        time.sleep(2)


def by_instance(results):
    return {r["metric"].get("instance", ""): float(r["value"][1]) for r in results}


def trainer_losses(log_text):
    """(first logged loss, final mean loss, unigram entropy) from a trainer's log."""
    losses = [float(m) for m in re.findall(r"^step \d+/\d+ \| loss ([0-9.]+)", log_text, re.M)]
    final = re.search(r"final loss ([0-9.]+) \(mean of last \d+ steps\) \| unigram entropy ([0-9.]+)", log_text)
    check(losses and final, f"trainer log has no progress or summary lines:\n{log_text[-2000:]}")
    return losses[0], float(final.group(1)), float(final.group(2))


def exposed_comm_per_step(port, trainer_instances):
    """Mean exposed communication per step over the trainers, and push bytes per step, from Prometheus."""
    exposed = wait_for_series(
        port, 'last_over_time(pshard_trainer_phase_seconds_total{phase="comm_exposed"}[30m])', trainer_instances)
    steps = wait_for_series(port, "last_over_time(pshard_trainer_step_seconds_count[30m])", trainer_instances)
    pushed = wait_for_series(
        port, 'sum by (instance) (last_over_time(pshard_trainer_transfer_bytes_total{direction="push"}[30m]))',
        trainer_instances)
    per_step, push_per_step = [], []
    for inst in trainer_instances:
        check(steps.get(inst, 0) > 0, f"Prometheus has no completed steps of {inst}: {steps}")
        per_step.append(exposed[inst] / steps[inst])
        push_per_step.append(pushed[inst] / steps[inst])
    return sum(per_step) / len(per_step), sum(push_per_step) / len(push_per_step)


def build_images(env):
    started = time.time()
    log(f"building {IMAGE} from deploy/docker/Dockerfile on {BASE_IMAGE}")
    run(["podman", "build", "-f", os.path.join(ROOT, "deploy/docker/Dockerfile"), "-t", IMAGE,
         "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", ROOT], env=env, timeout=1800)
    log(f"  built in {time.time() - started:.0f} s")
    started = time.time()
    run(["podman", "build", "-f", os.path.join(ROOT, "tests/deploy/compose/prometheus.Dockerfile"),
         "-t", PROMETHEUS_IMAGE, "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", os.path.dirname(__file__)],
        env=env, timeout=900)
    log(f"  Prometheus stand-in (Debian's package) built in {time.time() - started:.0f} s")
    # Users of pshard:cpu must get a non-root user by default.
    user = run(["podman", "image", "inspect", IMAGE, "--format", "{{.Config.User}}"], env=env).strip()
    check(user == "10001:10001", f"{IMAGE} runs as \"{user}\", expected the pshard user 10001:10001")


def steps_override(folder, steps):
    """A compose override that sets the trainers' step count (the shipped trainer.flags say 300)."""
    path = os.path.join(folder, f"steps-{steps}.yaml")
    services = [s for s in compose_services(os.path.join(COMPOSE_DIR, "compose.yaml")) if s.startswith("trainer-")]
    with open(path, "w") as f:
        f.write("services:\n")
        for s in services:
            f.write(f"  {s}:\n    command: [\"trainer\", \"--steps={steps}\"]\n")
    return path


def run_training(stack, port, servers, trainers, limit_s):
    """Servers and Prometheus first, then trainers once the servers are healthy; returns trainer logs.
    Every `up` names its services and starts nothing else, as on several hosts."""
    stack.compose("up", "-d", "--no-deps", *servers, "prometheus")
    stack.wait_healthy(servers, 120)
    wait_prometheus_ready(port, 60)
    log(f"{stack.name}: {len(servers)} servers healthy, Prometheus ready; starting {len(trainers)} trainers")
    started = time.time()
    stack.compose("up", "-d", "--no-deps", *trainers)
    # What Prometheus saw of the trainers while they ran, for failure messages.
    sampling = threading.Event()

    def sample():
        while not sampling.wait(3):
            TARGET_SAMPLES.append(f"+{time.time() - started:.0f}s: {targets_report(port)}")

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        stack.wait_exited(trainers, limit_s)
    finally:
        sampling.set()
        sampler.join()
    log(f"{stack.name}: trainers finished in {time.time() - started:.0f} s")
    logs = {t: stack.logs(t) for t in trainers}
    for t in trainers:
        check(stack.exit_code(t) == 0, f"{t} exited with {stack.exit_code(t)}:\n{logs[t][-3000:]}")
    # One more scrape interval so the trainers' last values are in.
    time.sleep(6)
    return logs


def check_scraped(port, server_targets, trainer_targets):
    up = prometheus_query(port, "max_over_time(up[30m])")
    scraped = {(r["metric"]["job"], r["metric"]["instance"]): float(r["value"][1]) for r in up}
    for s in server_targets:
        check(scraped.get(("pshard-server", s)) == 1.0,
              f"Prometheus never scraped server {s}: {scraped}; targets: {targets_report(port)}")
    for t in trainer_targets:
        check(scraped.get(("pshard-trainer", t)) == 1.0,
              f"Prometheus never scraped trainer {t}: {scraped}; targets now: {targets_report(port)}; "
              f"while training:\n" + "\n".join(TARGET_SAMPLES))
    server_steps = by_instance(prometheus_query(port, "last_over_time(pshard_server_step[30m])"))
    check(len(server_steps) == len(server_targets),
          f"pshard_server_step from {sorted(server_steps)}, want {server_targets}")
    log(f"Prometheus scraped {len(server_targets)} servers and {len(trainer_targets)} trainers; "
        f"server steps {server_steps}")


def teardown_keeps_checkpoints(stack, servers, steps):
    """Stops the stack, removes its containers but not volumes, restarts the
    servers and checks that they resume from the checkpoints there."""
    stack.compose("stop", timeout=120)
    for s in servers:
        code = stack.exit_code(s)
        text = stack.logs(s)
        check(code == 0, f"{s} exited with {code} on stop:\n{text[-2000:]}")
        check(re.search(rf"checkpoint of step {steps} written", text), f"{s} wrote no checkpoint of step {steps}:\n"
              f"{text[-2000:]}")
    stack.compose("down", timeout=120)  # containers and network; the volumes stay
    check(not stack.containers(), f"containers left after down: {stack.containers()}")
    stack.compose("up", "-d", *servers)
    stack.wait_healthy(servers, 120)
    for s in servers:
        text = stack.logs(s)
        check(re.search(rf"resumed at step {steps} from /var/lib/pshard/checkpoints/", text),
              f"{s} did not resume from its volume:\n{text[-2000:]}")
    log(f"{stack.name}: restarted servers resumed at step {steps} from their volumes")


def remove_stale_stacks(env):
    """Removes the stacks that earlier runs of this test left behind: a run
    killed mid-way (a timeout, a machine that restarted) never tears down,
    and its containers keep publishing a host port, so that every later
    connection to that port on this machine is forwarded into a container
    and a local server that is given the port cannot be reached."""
    projects = run(["podman", "ps", "-a", "--filter", "label=io.podman.compose.project", "--format",
                    '{{index .Labels "io.podman.compose.project"}}'], env=env).split()
    for project in sorted(set(projects)):
        m = re.fullmatch(r"pshard-e2e-(?:slow-)?(\d+)", project)
        if not m or os.path.exists(f"/proc/{m.group(1)}"):
            continue  # not this test's, or its run is still going
        label = f"label=io.podman.compose.project={project}"
        containers = run(["podman", "ps", "-a", "-q", "--filter", label], env=env).split()
        if containers:
            run(["podman", "rm", "-f", *containers], env=env, timeout=180)
        volumes = run(["podman", "volume", "ls", "-q", "--filter", label], env=env).split()
        if volumes:
            run(["podman", "volume", "rm", "-f", *volumes], env=env)
        network = f"{project}_default"
        if subprocess.run(["podman", "network", "exists", network], env=env).returncode == 0:
            run(["podman", "network", "rm", "-f", network], env=env)
        log(f"removed {project}, left behind by a run that did not end: {len(containers)} containers, "
            f"{len(volumes)} volumes")


def teardown(stack):
    stack.compose("down", "-v", timeout=180)
    left = stack.containers()
    check(not left, f"containers left after down -v: {left}")
    # podman-compose 1.0 leaves the project's network behind (docker compose
    # removes it): remove it as docs/deploy.md says.
    network = f"{stack.name}_default"
    if subprocess.run(["podman", "network", "exists", network], env=stack.env).returncode == 0:
        run(["podman", "network", "rm", network], env=stack.env)
    check(subprocess.run(["podman", "network", "exists", network], env=stack.env).returncode != 0,
          f"network {network} is left")
    volumes = run(["podman", "volume", "ls", "--filter", f"label=io.podman.compose.project={stack.name}",
                   "--format", "{{.Name}}"], env=stack.env).split()
    check(not volumes, f"volumes left after down -v: {volumes}")
    log(f"{stack.name}: torn down (no containers, volumes or network left)")


def check_losses(logs, falls_below_unigram):
    for t, text in logs.items():
        first, final, unigram = trainer_losses(text)
        log(f"{t}: loss {first:.3f} at the first report -> {final:.3f} at the end (unigram entropy {unigram:.3f})")
        check(final < 0.85 * first, f"{t}: loss did not fall enough: {first} -> {final}")
        if falls_below_unigram:
            check(final < unigram, f"{t}: final loss {final} is not below the unigram entropy {unigram}")


def test_e2e():
    if os.geteuid() != 0:
        log("skipping: Podman's networks and tc need root here")
        return SKIP
    for tool in ["podman", "podman-compose", "debootstrap", "runc"]:
        if shutil.which(tool) is None:
            log(f"skipping: {tool} is not installed (tools/setup.sh installs it)")
            return SKIP
    total_start = time.time()
    setup = run([os.path.join(ROOT, "tools/containers-setup.sh")], timeout=900)
    env = dict(os.environ)
    m = re.search(r"export CONTAINERS_CONF=(\S+)", setup)
    check(m, f"containers-setup.sh printed no CONTAINERS_CONF: {setup}")
    env["CONTAINERS_CONF"] = m.group(1)
    check_name_resolution(env)
    remove_stale_stacks(env)
    build_images(env)

    services = compose_services(os.path.join(COMPOSE_DIR, "compose.yaml"))
    servers = [s for s in services if s.startswith("server-")]
    trainers = [s for s in services if s.startswith("trainer-")]
    check(len(servers) == 3 and len(trainers) == 2, f"compose.yaml services: {services}")

    with tempfile.TemporaryDirectory() as scratch:
        # ---- the unshaped stack, with mutual TLS (compose.tls.yaml) ----
        # Certificates as the file's header says, owned by the image's user.
        certs = os.path.join(scratch, "certs")
        run([os.path.join(ROOT, "tools/make-certs.sh"), certs,
             "--hosts=localhost,127.0.0.1," + ",".join(servers), "--owner=10001"])
        port = free_port()
        env_run = dict(env, PSHARD_IMAGE=IMAGE, PROMETHEUS_IMAGE=PROMETHEUS_IMAGE,
                       PSHARD_PROMETHEUS_PORT=str(port), PSHARD_CERTS=certs)
        stack = Stack(f"pshard-e2e-{os.getpid()}",
                      ["compose.yaml", "compose.tls.yaml", steps_override(scratch, STEPS)], env_run)
        try:
            logs = run_training(stack, port, servers, trainers, 600)
            for s in servers:
                text = stack.logs(s)
                check("TLS, client certificates required" in text, f"{s} did not serve mutual TLS:\n{text[:2000]}")
            log(f"{', '.join(servers)} served mutual TLS (certificates from make-certs.sh --owner=10001)")
            check_losses(logs, falls_below_unigram=True)
            check_scraped(port, [f"{s}:9400" for s in servers], [f"{t}:9400" for t in trainers])
            plain_exposed, plain_push = exposed_comm_per_step(port, [f"{t}:9400" for t in trainers])
            log(f"unshaped: exposed communication {plain_exposed * 1000:.1f} ms per step, "
                f"{plain_push / 1e6:.2f} MB pushed per trainer-step")
            teardown_keeps_checkpoints(stack, servers, STEPS)
        finally:
            teardown(stack)

        # ---- the slow-link variant ----
        port = free_port()
        env_slow = dict(env, PSHARD_IMAGE=IMAGE, PROMETHEUS_IMAGE=PROMETHEUS_IMAGE, PSHARD_PROMETHEUS_PORT=str(port),
                        PSHARD_LINK_RATE=f"{SLOW_RATE_BITS}bit", PSHARD_LINK_DELAY="2ms")
        slow = Stack(f"pshard-e2e-slow-{os.getpid()}",
                     ["compose.yaml", "compose.slow-link.yaml", steps_override(scratch, SLOW_STEPS)], env_slow)
        try:
            logs = run_training(slow, port, servers, trainers, 600)
            for s in servers:
                text = slow.logs(s)
                check(f"egress of eth0 shaped to {SLOW_RATE_BITS} bit/s; as uid 10001" in text,
                      f"{s} did not shape its link with tc and drop root:\n{text[:2000]}")
            check_scraped(port, [f"{s}:9400" for s in servers], [f"{t}:9400" for t in trainers])
            slow_exposed, slow_push = exposed_comm_per_step(port, [f"{t}:9400" for t in trainers])
            # A trainer's own pushes leave through its shaped egress: at least
            # push bytes / rate of every step is communication it waits for.
            predicted = slow_push * 8 / SLOW_RATE_BITS
            log(f"shaped to {SLOW_RATE_BITS / 1e6:.0f} Mbit/s: exposed communication {slow_exposed * 1000:.0f} ms per "
                f"step (unshaped {plain_exposed * 1000:.1f} ms; pushes alone need {predicted * 1000:.0f} ms)")
            check(slow_exposed > 5 * plain_exposed,
                  f"exposed communication rose only from {plain_exposed:.4f} s to {slow_exposed:.4f} s per step")
            check(slow_exposed > 0.7 * predicted,
                  f"exposed communication {slow_exposed:.3f} s per step is below the {predicted:.3f} s that "
                  f"{slow_push / 1e6:.2f} MB of pushes need at {SLOW_RATE_BITS} bit/s")
        finally:
            teardown(slow)
    log(f"all container checks passed in {time.time() - total_start:.0f} s")
    return 0


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in ("config", "e2e"):
        print(__doc__)
        return 2
    try:
        return test_config() or 0 if sys.argv[1] == "config" else test_e2e()
    except Failure as f:
        print(f"compose_test: FAILED: {f}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
