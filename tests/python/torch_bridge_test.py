"""The PyTorch bridge: a torch model trained through pshard matches the same
model trained in one process with torch.optim.AdamW, and bad use gets a
clear Python exception.

Run with the bridge on the path: PYTHONPATH=build/python python3 -m unittest
tests/python/torch_bridge_test.py (ctest does).
"""
import math
import os
import subprocess
import sys
import tempfile
import unittest
import urllib.request

import torch
from torch import nn

import pshard.torch as pt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from torch_train import Block, TransformerLM, wrap_policy as policy  # noqa: E402  the example's model

STEPS = 5
LR, MIN_LR, WARMUP, WEIGHT_DECAY, CLIP = 1e-2, 1e-3, 2, 0.1, 0.5
BATCH, SEQ, VOCAB, WIDTH = 4, 16, 64, 32
# The two sides never differ by more than this after 5 steps. Their
# forwards and backwards run the same torch code on the same values; they
# round differently only in the optimizer step (the norm summed exactly
# against torch's float norms, the clip factor applied as a float, AdamW's
# operations in another order), by a few ulp. From the second step on the
# weights differ by those ulp, and so do the gradients, by a few ulp of the
# terms they sum; AdamW then divides each gradient by its own size
# (sqrt(v) + eps), so a small gradient that is a sum of cancelling terms
# turns that rounding into the same relative change of its update, which
# is about LR = 1e-2 whatever the gradient's size. Measured over the cases
# below: at most 2.7e-6 after 5 steps. The bound is 0.2% of one update: a
# wrong average, clip, decay (LR * 0.1 * |w| ~ 1e-4 a step), schedule (a
# step off changes LR by 10% or more), encoding (bf16: 2^-8 of a weight) or
# a missing push moves weights by far more. (A parameter whose exact
# gradient is zero but whose computed one is rounding noise, such as
# attention's key bias, would break this: AdamW scales the noise up to
# update size. The model has none.)
TOLERANCE = 2e-5


def fresh_model():
    torch.manual_seed(7)
    return TransformerLM(vocab=VOCAB, width=WIDTH, layers=2, heads=2, context=SEQ)


def batch(step, rank, micro=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, tokens, targets):
    return nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))



def lr_at(step):
    # pshard's schedule: linear warm-up, then cosine to MIN_LR at STEPS.
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * progress)) * (LR - MIN_LR)


def reference(trainers, micro_batches):
    """Single-process training: the mean gradient of every trainer's
    micro-batches, clipped, then AdamW with decay on matrices only."""
    model = fresh_model()
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for step in range(STEPS):
        total = [torch.zeros_like(p) for p in params]
        for rank in range(trainers):
            for micro in range(micro_batches):
                opt.zero_grad()
                loss = loss_of(model, *batch(step, rank, micro))
                loss.backward()
                for t, p in zip(total, params):
                    t += p.grad
                if rank == 0 and micro == 0:
                    losses.append(loss.item())
        for t, p in zip(total, params):
            p.grad = t / (trainers * micro_batches)
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def servers(shards, trainers, layout, init, **extra):
    return pt.LocalServers(shards, trainers, layout, init, lr=LR, min_lr=MIN_LR, warmup_steps=WARMUP,
                           total_steps=STEPS, weight_decay=WEIGHT_DECAY, grad_clip=CLIP, beta1=0.9, beta2=0.95,
                           eps=1e-8, **extra)


def train_through_pshard(shards, trainers, micro_batches=1, **levers):
    directory = tempfile.mkdtemp(prefix="pshard-torch-")
    layout, init = pt.write_job(fresh_model(), directory, policy)
    with servers(shards, trainers, layout, init, micro_batches=micro_batches) as job:
        models = [pt.ShardedModule(fresh_model(), job.addresses, rank, policy, **levers)
                  for rank in range(trainers)]
        losses = [[] for _ in range(trainers)]

        def train(rank):
            for step in range(STEPS):
                for micro in range(micro_batches):
                    loss = loss_of(models[rank], *batch(step, rank, micro))
                    loss.backward()
                    if micro == 0:
                        losses[rank].append(loss.item())
                models[rank].step(losses[rank][-1], BATCH * SEQ * micro_batches)

        pt.run_trainers(trainers, train)
        return models[0].gather_weights(), losses[0], models[0]


def one_step_each(levers):
    """One step of two micro-batches over 2 servers by a trainer for each
    entry of ``levers`` (its ShardedModule's keyword arguments), all at
    once; their step reports."""
    directory = tempfile.mkdtemp(prefix="pshard-torch-")
    layout, init = pt.write_job(fresh_model(), directory, policy)
    reports = [None] * len(levers)
    with servers(2, len(levers), layout, init, micro_batches=2) as job:
        models = [pt.ShardedModule(fresh_model(), job.addresses, rank, policy, **lever)
                  for rank, lever in enumerate(levers)]

        def train(rank):
            for micro in range(2):
                loss_of(models[rank], *batch(0, rank, micro)).backward()
            reports[rank] = models[rank].step()

        pt.run_trainers(len(levers), train)
    return reports


class ParityTest(unittest.TestCase):
    def check(self, shards, trainers, micro_batches=1, **levers):
        want, want_losses = reference(trainers, micro_batches)
        got, losses, model = train_through_pshard(shards, trainers, micro_batches, **levers)
        self.assertEqual(model.version, STEPS)
        initial = dict(fresh_model().named_parameters())
        moved = 0.0
        for name, w in want.items():
            self.assertEqual(got[name].shape, w.shape, name)
            error = (got[name] - w).abs().max().item()
            self.assertLessEqual(error, TOLERANCE, f"{name}: {error:.3g} from the reference")
            moved = max(moved, (w - initial[name].detach()).abs().max().item())
        # The comparison is of training, not of initial values.
        self.assertGreater(moved, 100 * TOLERANCE)
        for a, b in zip(losses, want_losses):
            self.assertAlmostEqual(a, b, delta=1e-5)

    def test_one_server_one_trainer(self):
        self.check(1, 1)

    def test_three_servers_one_trainer(self):
        self.check(3, 1)

    def test_one_server_two_trainers(self):
        self.check(1, 2)

    def test_three_servers_two_trainers(self):
        self.check(3, 2)

    def test_levers_keep_the_result(self):
        # Prefetching two units, keeping weights from forward to backward,
        # and two micro-batches per step change the traffic, not the result.
        self.check(3, 2, micro_batches=2, prefetch=2, reshard_after_forward=False)

    def test_stage_two_keeps_the_result(self):
        self.check(3, 2, micro_batches=2, stage=2)

    def test_a_fabric_group_keeps_the_result(self):
        # Two trainers in one fabric group: each fetches and pushes its
        # shards, the group gathers the weights and reduces the gradients.
        self.check(3, 2, micro_batches=2, fabric_group=2)

    def test_the_secondary_shard_keeps_the_result(self):
        self.check(3, 2, micro_batches=2, fabric_group=2, reshard_after_forward=2)


class BadUseTest(unittest.TestCase):
    def test_a_parameter_outside_every_unit(self):
        model = fresh_model()
        only_layers = lambda m: isinstance(m, Block)
        with self.assertRaisesRegex(ValueError, "parameter embed.weight is outside every unit"):
            pt.ShardedModule(model, ["127.0.0.1:1"], 0, only_layers)
        with self.assertRaisesRegex(ValueError, "outside every unit"):
            pt.write_job(model, tempfile.mkdtemp(), only_layers)

    def test_a_frozen_parameter(self):
        model = fresh_model()
        model.head.bias.requires_grad_(False)
        with self.assertRaisesRegex(ValueError, "head.bias does not require a gradient"):
            pt.write_job(model, tempfile.mkdtemp(), policy)

    def test_servers_of_another_job_and_a_changed_shape(self):
        directory = tempfile.mkdtemp(prefix="pshard-torch-")
        layout, init = pt.write_job(fresh_model(), directory, policy)
        with servers(1, 1, layout, init) as job:
            other = fresh_model()
            other.head = nn.Linear(WIDTH, VOCAB + 1)
            with self.assertRaisesRegex(ValueError, "the servers run another job: .*head.weight"):
                pt.ShardedModule(other, job.addresses, 0, policy)
            model = pt.ShardedModule(fresh_model(), job.addresses, 0, policy)
            model.module.head.weight.data = torch.zeros(VOCAB + 1, WIDTH)
            with self.assertRaisesRegex(RuntimeError, r"head.weight changed shape after wrapping \(\[64, 32\] -> "
                                                      r"\[65, 32\]\)"):
                model(batch(0, 0)[0])
            model.module.head.weight = nn.Parameter(torch.zeros(VOCAB, WIDTH))
            with self.assertRaisesRegex(RuntimeError, "head.weight was replaced after wrapping"):
                model(batch(0, 0)[0])

    def test_a_step_without_the_jobs_micro_batches(self):
        directory = tempfile.mkdtemp(prefix="pshard-torch-")
        layout, init = pt.write_job(fresh_model(), directory, policy)
        with servers(1, 1, layout, init, micro_batches=2) as job:
            model = pt.ShardedModule(fresh_model(), job.addresses, 0, policy)
            loss_of(model, *batch(0, 0)).backward()
            with self.assertRaisesRegex(RuntimeError, "ran 1 backward passes; the job reduces 2"):
                model.step()


    def test_a_server_list_given_as_one_string(self):
        model = fresh_model()
        with self.assertRaisesRegex(ValueError, r"servers='127.0.0.1:1,127.0.0.1:2' is a string: give a list .*"
                                                r"\['127.0.0.1:1', '127.0.0.1:2'\]"):
            pt.ShardedModule(model, "127.0.0.1:1,127.0.0.1:2", 0, policy)
        for bad in (["127.0.0.1"], ["127.0.0.1:99999"], [1234], []):
            with self.assertRaises(ValueError):
                pt.ShardedModule(model, bad, 0, policy)

    def test_a_missing_policy(self):
        for policy_given in (None, "Block"):
            with self.assertRaisesRegex(ValueError, "auto_wrap_policy=.*: give a callable module -> bool"):
                pt.ShardedModule(fresh_model(), ["127.0.0.1:1"], 0, policy_given)
            with self.assertRaisesRegex(ValueError, "give a callable"):
                pt.write_job(fresh_model(), tempfile.mkdtemp(), policy_given)

    def test_running_statistics_are_refused_and_constant_buffers_must_stay(self):
        with_norm = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
        with self.assertRaisesRegex(ValueError, "buffers 1.running_mean, 1.running_var, 1.num_batches_tracked "
                                                "change in training"):
            pt.ShardedModule(with_norm, ["127.0.0.1:1"], 0, lambda m: m is with_norm)
        # A constant buffer is kept as given; one changed in a step is named.
        model = fresh_model()
        model.register_buffer("scale", torch.ones(3))
        directory = tempfile.mkdtemp(prefix="pshard-torch-")
        layout, init = pt.write_job(model, directory, policy)
        with servers(1, 1, layout, init) as job:
            sharded = pt.ShardedModule(model, job.addresses, 0, policy)
            loss_of(sharded, *batch(0, 0)).backward()
            sharded.step()
            loss_of(sharded, *batch(1, 0)).backward()
            model.scale.add_(1.0)
            with self.assertRaisesRegex(RuntimeError, "buffer scale changed during step 1"):
                sharded.step()

    def test_a_torch_optimizer_over_sharded_parameters_is_refused(self):
        model = fresh_model()
        directory = tempfile.mkdtemp(prefix="pshard-torch-")
        layout, init = pt.write_job(model, directory, policy)
        untouched = nn.Linear(3, 3)
        with servers(1, 1, layout, init) as job:
            sharded = pt.ShardedModule(model, job.addresses, 0, policy)
            first = next(n for n, _ in sharded.module.named_parameters())
            for make in (lambda: torch.optim.SGD(sharded.parameters(), lr=0.1),
                         lambda: torch.optim.AdamW([{"params": list(model.parameters())}])):
                with self.assertRaisesRegex(ValueError, f"parameter {first} is sharded by a ShardedModule: its "
                                                        "optimizer is the shard servers' AdamW"):
                    make()
            # A group added later is checked too, and one of its own
            # parameters still trains as torch trains it.
            mixed = torch.optim.SGD(untouched.parameters(), lr=0.5)
            with self.assertRaisesRegex(ValueError, "is sharded by a ShardedModule"):
                mixed.add_param_group({"params": (p for p in model.parameters())})
            self.assertEqual(len(mixed.param_groups), 1)
            before = untouched.weight.detach().clone()
            untouched(torch.ones(2, 3)).sum().backward()
            mixed.step()
            torch.testing.assert_close(untouched.weight.detach(), before - 0.5 * untouched.weight.grad)
            # The job still steps.
            loss_of(sharded, *batch(0, 0)).backward()
            sharded.step()

    def test_local_servers_use_torch_adamw_betas_unless_told(self):
        directory = tempfile.mkdtemp(prefix="pshard-torch-")
        layout, init = pt.write_job(fresh_model(), directory, policy)
        with pt.LocalServers(1, 1, layout, init) as default, pt.LocalServers(1, 1, layout, init, beta2=0.95) as told:
            argv = lambda s: " ".join(s.processes[0].args)
            self.assertIn("--beta2=0.999", argv(default))
            self.assertIn("--beta1=0.9", argv(default))
            self.assertIn("--eps=1e-08", argv(default))
            self.assertIn("--beta2=0.95", argv(told))
            self.assertNotIn("--beta2=0.999", argv(told))

    def test_levers_that_do_not_fit_together(self):
        model = fresh_model()
        for levers, message in [({"fabric_group": 0}, "fabric_group=0"),
                                ({"fabric_group": 2, "reshard_after_forward": 4}, "the fabric group's size \\(2\\)"),
                                ({"reshard_after_forward": 2}, "the fabric group's size \\(1\\)"),
                                ({"fabric_group": 2, "reshard_after_forward": 2, "stage": 2}, "stage-3 lever")]:
            with self.assertRaisesRegex(ValueError, message):
                pt.ShardedModule(model, ["127.0.0.1:1"], 0, policy, **levers)
        directory = tempfile.mkdtemp(prefix="pshard-torch-")
        layout, init = pt.write_job(fresh_model(), directory, policy)
        with servers(2, 1, layout, init) as job:
            alone = pt.ShardedModule(fresh_model(), job.addresses, 0, policy, fabric_group=2)
            with self.assertRaisesRegex(ValueError, r"ranks \[0, 2\) does not align with the 1 trainers"):
                alone(batch(0, 0)[0])


class MetricsTest(unittest.TestCase):
    def test_steps_are_exported_on_metrics(self):
        directory = tempfile.mkdtemp(prefix="pshard-torch-")
        layout, init = pt.write_job(fresh_model(), directory, policy)
        with servers(2, 1, layout, init) as job:
            model = pt.ShardedModule(fresh_model(), job.addresses, 0, policy, metrics_address="127.0.0.1:0",
                                     weight_encoding="bf16")
            for step in range(2):
                loss = loss_of(model, *batch(step, 0))
                loss.backward()
                report = model.step(loss.item(), BATCH * SEQ)
            text = urllib.request.urlopen(f"http://127.0.0.1:{model.metrics_port()}/metrics", timeout=10).read()
        text = text.decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        self.assertEqual(values['pshard_trainer_step_seconds_count{rank="0"}'], 2)
        self.assertEqual(values['pshard_trainer_tokens_total{rank="0"}'], 2 * BATCH * SEQ)
        self.assertAlmostEqual(values['pshard_trainer_loss{rank="0"}'], loss.item(), places=5)
        fetched = [v for k, v in values.items() if k.startswith("pshard_trainer_transfer_bytes_total{")
                   and 'direction="fetch"' in k]
        self.assertEqual(len(fetched), 1)
        # bf16 weights, fetched twice a step (forward and backward): 2 bytes
        # a parameter each time, and the framing.
        parameters = sum(p.numel() for p in fresh_model().parameters())
        self.assertGreater(fetched[0], 2 * 2 * 2 * parameters)
        self.assertLess(fetched[0], 1.2 * 2 * 2 * 2 * parameters)
        self.assertGreater(report["bytes_pushed"], 0)
        phases = sum(v for k, v in values.items() if k.startswith("pshard_trainer_phase_seconds_total{"))
        self.assertAlmostEqual(phases, values['pshard_trainer_step_seconds_sum{rank="0"}'], places=6)
        if os.path.exists("/usr/bin/promtool"):
            lint = subprocess.run(["/usr/bin/promtool", "check", "metrics"], input=text.encode(),
                                  capture_output=True)
            self.assertEqual(lint.returncode, 0, lint.stdout + lint.stderr)

    def test_the_levers_fetch_what_they_say(self):
        """Bytes fetched in one step of two micro-batches: stage 3 fetches
        every unit in each forward and each backward (4 times), kept from
        forward in each forward (2), stage 2 once."""
        reports = one_step_each([{"prefetch": 2}, {"prefetch": 2, "reshard_after_forward": False},
                                 {"prefetch": 2, "stage": 2}])
        fetched = [r["bytes_fetched"] for r in reports]
        self.assertEqual(fetched[0], 2 * fetched[1])
        self.assertEqual(fetched[1], 2 * fetched[2])
        parameters = sum(p.numel() for p in fresh_model().parameters())
        self.assertGreater(fetched[2], 4 * parameters)  # fp32, framing on top
        self.assertLess(fetched[2], 1.1 * 4 * parameters)

    def test_a_fabric_group_fetches_its_share(self):
        """One step of two micro-batches by two fabric groups of two: each
        member fetches its half of every unit (shard 0 or 1 of 2) in each
        forward and backward, and the group gathers the other half; with
        the secondary shard, backward gathers the unit from the members'
        parts and fetches nothing."""
        secondary = {"fabric_group": 2, "reshard_after_forward": 2}
        reports = one_step_each([{"fabric_group": 2}, {"fabric_group": 2}, secondary, secondary])
        fetched = [r["bytes_fetched"] for r in reports]
        self.assertEqual(fetched[0], 2 * fetched[2])  # member 0 of each group: shard 0
        self.assertEqual(fetched[1], 2 * fetched[3])
        parameters = sum(p.numel() for p in fresh_model().parameters())
        halves = fetched[0] + fetched[1]  # the group's fetches: every unit, 4 times
        self.assertGreater(halves, 4 * 4 * parameters)
        self.assertLess(halves, 1.1 * 4 * 4 * parameters)
        for r in reports:
            self.assertGreater(r["fabric_gathered"], 0)
            self.assertGreater(r["fabric_reduced"], 0)
        # Gathered from the other member: its half (padding included), fp32,
        # in every pass.
        gathered = reports[0]["fabric_gathered"] + reports[1]["fabric_gathered"]
        self.assertGreaterEqual(gathered, 4 * 4 * parameters)
        self.assertLess(gathered, 1.1 * 4 * 4 * parameters)
        # With the secondary shard, backward gathers from parts as much as
        # forward gathers from fetches.
        self.assertEqual(reports[2]["fabric_gathered"], reports[0]["fabric_gathered"])


if __name__ == "__main__":
    unittest.main()
