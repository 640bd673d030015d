"""A PyTorch model whose parameters live on pshard's shard servers.

``ShardedModule`` wraps a ``torch.nn.Module``. A policy (like FSDP's
``auto_wrap_policy``) chooses submodules; each is a *unit* whose parameters
are one unit of the job's layout, sharded over the servers with their AdamW
state. The trainer holds no weights between uses:

* a unit's forward pre-hook fetches its weights (version = the step) and
  points the parameters at the client's buffer (no copy for fp32); the next
  ``prefetch`` units are fetched meanwhile; after the forward the
  parameters are emptied;
* tensors that autograd saves from a unit's weights are saved as tokens, and
  backward fetches the unit again when it needs them (or keeps it from
  forward with ``reshard_after_forward=False``);
* when every parameter of a unit has its gradient, the unit's gradient is
  pushed to its owners at once, while backward goes on;
* ``step()`` waits for the pushes: the servers reduce the trainers'
  gradients, clip, and apply AdamW; the next forward fetches the next
  version.

The job is made from the module with ``write_job`` (its layout, and its
initial weights as the job's initial-weights file) and served by
``pshard-server --layout=... --init_from=...`` (``LocalServers`` starts
them on this machine).
"""

import contextlib
import json
import os
import signal
import struct
import subprocess
import tempfile
import threading
import time

import numpy as np
import torch
from torch import nn

from . import _pshard
from ._paths import BIN_DIR

__all__ = ["ShardedModule", "LocalServers", "layout_of", "write_job", "write_safetensors", "default_weight_decay",
           "run_trainers"]


def default_weight_decay(name, param):
    """AdamW's decay applies to matrices (2 or more dimensions), not to
    biases, norms' scales or other vectors."""
    return param.dim() >= 2


class _Param:
    def __init__(self, name, param, offset, owner, attr):
        self.name = name
        self.param = param
        self.offset = offset
        self.numel = param.numel()
        self.shape = tuple(param.shape)
        self.owner = owner  # the module that holds it, and its attribute name
        self.attr = attr


class _Unit:
    def __init__(self, index, name, module):
        self.index = index
        self.name = name
        self.module = module
        self.params = []
        self.numel = 0
        self.dtype = None


def _units_of(module, auto_wrap_policy):
    """The units the policy chooses: one per selected submodule (in the
    order of ``named_modules``), each holding the parameters of the
    innermost selected module that contains them."""
    if not callable(auto_wrap_policy):
        raise ValueError(f"auto_wrap_policy={auto_wrap_policy!r}: give a callable module -> bool that chooses the "
                         "units, e.g. lambda m: isinstance(m, Block) (the root module too, if it holds parameters)")
    selected = [(name, m) for name, m in module.named_modules() if auto_wrap_policy(m)]
    if not selected:
        raise ValueError("the auto_wrap_policy selects no module: every parameter would be outside every unit")
    # Innermost first: a module appears after its ancestors in named_modules.
    homes = {}
    for name, m in selected:
        for pname, p in m.named_parameters(prefix=name, recurse=True):
            homes.setdefault(id(p), []).append(name)
    units = []
    by_name = {}
    for name, m in selected:
        unit = _Unit(len(units), name or "root", m)
        units.append(unit)
        by_name[name] = unit
    holders = {}
    for mname, m in module.named_modules():
        for attr, p in m.named_parameters(recurse=False):
            holders.setdefault(id(p), (m, attr))
    for pname, p in module.named_parameters():
        owners = homes.get(id(p))
        if not owners:
            raise ValueError(
                f"parameter {pname} is outside every unit: the auto_wrap_policy selects no module that holds it "
                "(select its module, or the root module)")
        inner = max(owners, key=len)
        for other in owners:
            if other != inner and not (other == "" or inner.startswith(other + ".")):
                raise ValueError(
                    f"parameter {pname} is shared by units {other or 'root'} and {inner or 'root'}: tied "
                    "parameters must belong to one unit (select a module that holds both)")
        if not p.requires_grad:
            raise ValueError(f"parameter {pname} does not require a gradient: every parameter of a pshard job "
                             "is trained (the servers would still decay it)")
        if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"parameter {pname} is {p.dtype}: units hold floating-point parameters")
        unit = by_name[inner]
        if unit.dtype is not None and unit.dtype != p.dtype:
            raise ValueError(f"unit {unit.name} mixes {unit.dtype} and {p.dtype} parameters ({pname})")
        unit.dtype = p.dtype
        owner, attr = holders[id(p)]
        unit.params.append(_Param(pname, p, unit.numel, owner, attr))
        unit.numel += p.numel()
    return [u for u in units if u.params]


def _layout_document(module, units, weight_decay):
    return {
        "format": "pshard-layout/1",
        "model": f"torch {type(module).__name__}",
        "units": [{
            "name": u.name,
            "tensors": [{"name": p.name, "shape": list(p.shape), "init": "given",
                         "weight_decay": bool(weight_decay(p.name, p.param))} for p in u.params],
        } for u in units],
    }


def layout_of(module, auto_wrap_policy, weight_decay=default_weight_decay):
    """The job's layout for ``module`` as a JSON document (str): a unit per
    selected submodule, its parameters' names and shapes, their initial
    values given (the initial-weights file), decay as ``weight_decay``
    says."""
    return json.dumps(_layout_document(module, _units_of(module, auto_wrap_policy), weight_decay), indent=1)


def write_safetensors(path, tensors, metadata=None):
    """Writes ``tensors`` (name -> tensor, in order) as one .safetensors file
    (F32, BF16 or F16), whole or not at all."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.int16).numpy().tobytes() if t.dtype != torch.float32 else t.numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def write_job(module, directory, auto_wrap_policy, weight_decay=default_weight_decay):
    """Writes the job ``module`` makes into ``directory``: ``layout.json``
    (pshard-server --layout) and ``init.safetensors``, the module's current
    weights (pshard-server --init_from). Returns both paths."""
    units = _units_of(module, auto_wrap_policy)
    os.makedirs(directory, exist_ok=True)
    layout = os.path.join(directory, "layout.json")
    with open(layout, "w") as f:
        json.dump(_layout_document(module, units, weight_decay), f, indent=1)
    init = os.path.join(directory, "init.safetensors")
    write_safetensors(init, {p.name: p.param for u in units for p in u.params})
    return layout, init


class LocalServers:
    """``num_shards`` pshard-server processes on this machine serving the job
    of ``layout`` and ``init_from`` to ``num_trainers`` trainers; a context
    manager (they stop at its end). ``optimizer`` holds pshard-server flags
    (lr, min_lr, warmup_steps, total_steps, weight_decay, grad_clip, beta1,
    beta2, eps, micro_batches, accumulate_on_trainer, ...). AdamW's betas and
    eps default to torch.optim.AdamW's, (0.9, 0.999) and 1e-8, where
    pshard-server's own default beta2 is 0.95 (GPT training's)."""

    torch_adamw_defaults = {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8}

    def __init__(self, num_shards, num_trainers, layout, init_from=None, run_dir=None, start_timeout=60.0,
                 **flags):
        flags = {**LocalServers.torch_adamw_defaults, **flags}
        self.num_shards = num_shards
        self.run_dir = run_dir or tempfile.mkdtemp(prefix="pshard-servers-")
        self.processes = []
        self.addresses = []
        binary = os.path.join(BIN_DIR, "pshard-server")
        try:
            for s in range(num_shards):
                port_file = os.path.join(self.run_dir, f"server{s}.port")
                argv = [binary, f"--shard_index={s}", f"--num_shards={num_shards}", f"--num_trainers={num_trainers}",
                        f"--layout={layout}", "--address=127.0.0.1:0", f"--port_file={port_file}",
                        "--metrics_address="]
                if init_from:
                    argv.append(f"--init_from={init_from}")
                if s > 0:
                    argv.append(f"--coordinator={self.addresses[0]}")
                argv += [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in flags.items()]
                log = open(os.path.join(self.run_dir, f"server{s}.log"), "w")
                self.processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
                self.addresses.append(f"127.0.0.1:{self._port(s, port_file, start_timeout)}")
        except BaseException:
            self.stop()
            raise

    def _port(self, s, port_file, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.processes[s].poll() is not None:
                raise RuntimeError(f"pshard-server {s} exited with {self.processes[s].returncode}: {self.log(s)}")
            if os.path.exists(port_file):
                with open(port_file) as f:
                    return int(f.readline())
            time.sleep(0.05)
        raise TimeoutError(f"pshard-server {s} did not serve within {timeout} s: {self.log(s)}")

    def log(self, s):
        with open(os.path.join(self.run_dir, f"server{s}.log")) as f:
            return f.read()[-2000:]

    def stop(self):
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.processes:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def run_trainers(count, train):
    """Runs ``train(rank)`` for ranks 0..count-1, each in its own thread (M
    trainers of one process: each with its own ShardedModule), and raises
    the first error any of them raised once all have ended."""
    errors = []

    def run(rank):
        try:
            train(rank)
        except BaseException as e:  # re-raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(rank,), name=f"pshard-trainer-{rank}") for rank in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


class _Saved:
    """A tensor autograd saved from a unit's weights: where it lies in them."""
    __slots__ = ("unit", "offset", "size", "stride")

    def __init__(self, unit, offset, size, stride):
        self.unit, self.offset, self.size, self.stride = unit, offset, size, stride


def _server_list(servers):
    """``servers`` as a list of "host:port" strings: a bare string is refused
    (iterated, it would be one address per character)."""
    if isinstance(servers, (str, bytes)):
        raise ValueError(f"servers={servers!r} is a string: give a list of every server's host:port, e.g. "
                         f"{str(servers).split(',')!r}")
    servers = list(servers)
    for s in servers:
        host, colon, port = s.rpartition(":") if isinstance(s, str) else ("", "", "")
        if not host or not colon or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"servers: {s!r} is not host:port (a port in 1..65535)")
    if not servers:
        raise ValueError("servers is empty: give every server's host:port")
    return servers


def _stateful_buffers(module):
    """The buffers training would change: normalisation layers' running
    statistics (BatchNorm, InstanceNorm with track_running_stats)."""
    found = []
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            found += [f"{name}.{b}" if name else b for b, t in m.named_buffers(recurse=False) if t is not None]
    return found


def _storage(t):
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


def _storage_ptr(t):
    return _storage(t).data_ptr()


def _placeholder(shape, dtype):
    """A tensor of the parameter's shape with no memory behind it: what the
    parameter holds while its unit is not in use (autograd reads its shape
    and strides, never its values)."""
    t = torch.empty(shape, dtype=dtype)
    _storage(t).resize_(0)
    return t


# The name a ShardedModule gave each parameter it shards: a torch optimizer
# over one is refused where it is made (below).
_SHARDED_NAME = "_pshard_sharded_as"


def _refuse_sharded_parameters(add_param_group):
    """Wraps ``Optimizer.add_param_group`` (through which every torch
    optimizer takes its parameters, at construction and later) so that a
    parameter a ShardedModule shards is refused with the reason. Parameters
    pshard does not shard pass through unchanged."""
    def checked(self, param_group):
        if isinstance(param_group, dict) and not isinstance(param_group.get("params"), (torch.Tensor, set)):
            param_group["params"] = list(param_group.get("params", []))
            params = param_group["params"]
        else:
            params = [param_group.get("params")] if isinstance(param_group, dict) else []
        for param in params:
            name = getattr(param, _SHARDED_NAME, None)
            if name is not None:
                raise ValueError(f"parameter {name} is sharded by a ShardedModule: its optimizer is the shard "
                                 "servers' AdamW (pshard-server --lr, --weight_decay, --beta1, --beta2), applied at "
                                 "ShardedModule.step(); a torch optimizer over it would see no gradient and change "
                                 "nothing")
        return add_param_group(self, param_group)
    checked.__wrapped__ = add_param_group
    return checked


if not hasattr(torch.optim.Optimizer.add_param_group, "__wrapped__"):
    torch.optim.Optimizer.add_param_group = _refuse_sharded_parameters(torch.optim.Optimizer.add_param_group)


class ShardedModule(nn.Module):
    """``module`` with its parameters on the shard servers at ``servers``
    (every server of the job), as trainer ``rank``.

    ``auto_wrap_policy(m) -> bool`` selects the unit modules (the root
    too, if it holds parameters of its own); every parameter must belong to
    one. ``weight_decay(name, param) -> bool`` says where AdamW decays (the
    servers' --weight_decay is the rate). ``prefetch``, ``weight_encoding``,
    ``grad_encoding``, ``quant_block``, ``error_feedback``,
    ``reshard_after_forward`` and ``stage`` (3, or 2: every unit fetched once
    a step and kept for all its micro-batches) are the C++ trainer's levers.

    ``fabric_group=G`` puts this trainer in the fabric group of G
    consecutive ranks (aligned, a power of two): each member fetches and
    pushes only its shards of every unit, and the group all-gathers the
    weights and reduces the gradients over TCP on ``group_host`` (they meet
    at shard 0 at the first forward). Every member must run the same
    passes. ``reshard_after_forward=G`` (the group's size) is the secondary
    shard: each member keeps its 1/G of every unit from forward, and
    backward all-gathers the unit in the group instead of fetching it.
    Raises ValueError when the servers run another job or the levers do not
    fit together.

    Buffers: pshard shards parameters only. Buffers that training changes
    (the running statistics of BatchNorm, or of InstanceNorm with
    ``track_running_stats``) are refused: they would stay on each trainer,
    never averaged, checkpointed or exported. Use ``track_running_stats=False``,
    GroupNorm or LayerNorm. Other buffers are constants (masks, position
    tables): each trainer keeps its own copy, and ``step()`` raises if one
    changed.

    The optimizer is the servers' AdamW: a torch optimizer over this
    module's parameters would see no gradients and change nothing, so one is
    refused (ValueError, naming the parameter) when it is made. The
    encodings default to fp32 both ways (exact, as FSDP without mixed
    precision); ``pshard local`` and ``pshard-trainer`` default to bf16
    weights.

    A training step: forward, ``loss.backward()`` (once per micro-batch the
    job reduces), then ``step()``.
    """

    def __init__(self, module, servers, rank, auto_wrap_policy, weight_decay=default_weight_decay, prefetch=1,
                 reshard_after_forward=True, stage=3, weight_encoding="fp32", grad_encoding="fp32", quant_block=64,
                 error_feedback=True, transport="auto", metrics_address="", join_timeout=30.0, rpc_timeout=120.0,
                 fabric_group=1, group_host="127.0.0.1"):
        super().__init__()
        servers = _server_list(servers)
        stateful = _stateful_buffers(module)
        if stateful:
            raise ValueError(f"buffers {', '.join(stateful)} change in training (running statistics): pshard shards "
                             "parameters only, so each trainer's would drift apart and none would be checkpointed "
                             "or exported; use track_running_stats=False, GroupNorm or LayerNorm")
        if prefetch < 0:
            raise ValueError(f"prefetch depth {prefetch} must be >= 0")
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage {stage}: 3 fetches the weights pass by pass, 2 (or 1) once per step")
        if not isinstance(fabric_group, int) or isinstance(fabric_group, bool) or fabric_group < 1:
            raise ValueError(f"fabric_group={fabric_group!r}: the size of this trainer's fabric group (1: none)")
        secondary = 0
        if not isinstance(reshard_after_forward, bool):
            secondary = reshard_after_forward
            if not isinstance(secondary, int) or secondary < 2 or secondary != fabric_group:
                raise ValueError(f"reshard_after_forward={reshard_after_forward!r}: True, False, or the fabric "
                                 f"group's size ({fabric_group}) for a secondary shard within it")
            if stage < 3:
                raise ValueError("a secondary shard is a stage-3 lever: at stage 2 every unit stays for the step")
        self.module = module
        # Constant buffers, as given: step() checks that none changed.
        self._buffers_at_start = {name: b.detach().clone() for name, b in module.named_buffers()}
        self._units = _units_of(module, auto_wrap_policy)
        ours = _pshard.canonical_layout(json.dumps(_layout_document(module, self._units, weight_decay)))
        theirs = _pshard.server_layout(servers, join_timeout)
        if ours != theirs:
            raise ValueError("the servers run another job: " + _difference(json.loads(ours), json.loads(theirs)))
        self._session = _pshard.Session(servers, rank, weight_encoding, grad_encoding, quant_block,
                                        error_feedback, transport, metrics_address, join_timeout, rpc_timeout)
        if self._session.layout_json() != ours:
            raise ValueError("the servers' job changed while this trainer joined")
        self.job = self._session.job()
        self.version = self.job["joined_step"]
        self.rank = rank
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward is not False
        self.secondary_shard = secondary
        self.stage = stage
        self.fabric_group = fabric_group
        self._group_host = group_host
        self._parts = {}         # unit -> this member's part, kept from forward (secondary shard)
        self._accumulators = []
        for unit in self._units:
            unit.padded = self._session.padded_numel(unit.index)
            for i, p in enumerate(unit.params):
                # The node that accumulates the parameter's gradient: made
                # while it has its shape, kept alive, hooked.
                acc = p.param.expand_as(p.param).grad_fn.next_functions[0][0]
                acc.register_hook(self._grad_hook(unit, i))
                self._accumulators.append(acc)
                setattr(p.param, _SHARDED_NAME, p.name)
                p.placeholder = _placeholder(p.shape, unit.dtype)
                p.param.data = p.placeholder
            unit.module.register_forward_pre_hook(self._pre_forward_hook(unit))
            unit.module.register_forward_hook(self._post_forward_hook(unit))
        self._fetches = {}       # (unit, version, pass) -> Transfer
        self._forward_ptrs = {}  # storage address of a unit's forward weights -> unit
        self._kept = {}          # unit -> weights kept from forward for backward
        self._resident = {}      # unit -> weights kept for the whole step (stage 2)
        self._backward_weights = {}
        self._pushes = []
        self._backwards = 0      # backward passes since the last step()
        self._in_backward = False
        self._backward_started = 0.0
        self._done = set()       # units whose gradient this backward finished
        self._grads = {}         # unit -> (numpy gradient, parameters seen) in this backward
        self._accumulated = {}   # unit -> numpy sum over micro-batches (accumulate_on_trainer)

    # ---- fetching ----

    def _start_fetch(self, index, purpose):
        key = (index, self.version, purpose)
        if key not in self._fetches:
            self._fetches[key] = self._session.fetch(index, self.version)
        return self._fetches[key]

    def _weights(self, unit, purpose, following):
        """The unit's weights at this version as a flat tensor of its dtype,
        over the client's buffer (fp32) or converted; starts fetching the
        ``prefetch`` units in ``following``. At stage 2 a unit is fetched
        once a step and kept for all of the step's passes."""
        if self.stage < 3:
            if unit.index in self._resident:
                return self._resident[unit.index]
            purpose = "resident"
            following = [u for u in following if u.index not in self._resident]
        transfer = self._start_fetch(unit.index, purpose)
        for other in following[:self.prefetch]:
            self._start_fetch(other.index, purpose)
        fetched = transfer.values()
        del self._fetches[(unit.index, self.version, purpose)]
        if self.secondary_shard and purpose == "forward" and torch.is_grad_enabled():
            self._parts[unit.index] = self._session.own_part(unit.index, fetched)
        values = torch.from_numpy(fetched)
        weights = values if unit.dtype == torch.float32 else values.to(unit.dtype)
        if self.stage < 3:
            self._resident[unit.index] = weights
        return weights

    def _check_params(self, unit):
        for p in unit.params:
            if getattr(p.owner, p.attr, None) is not p.param:
                raise RuntimeError(f"parameter {p.name} was replaced after wrapping: a ShardedModule's parameters "
                                   "are the job's layout, fixed when it was wrapped")
            if tuple(p.param.shape) != p.shape:
                raise RuntimeError(f"parameter {p.name} changed shape after wrapping ({list(p.shape)} -> "
                                   f"{list(p.param.shape)}): a ShardedModule's layout is fixed when it is wrapped")

    def _pre_forward_hook(self, unit):
        def hook(module, inputs):
            self._check_params(unit)
            weights = self._weights(unit, "forward", self._units[unit.index + 1:])
            for p in unit.params:
                p.param.data = weights[p.offset:p.offset + p.numel].view(p.shape)
            if torch.is_grad_enabled():
                self._forward_ptrs[_storage_ptr(weights)] = unit
                if not self.reshard_after_forward:
                    self._kept[unit.index] = weights
        return hook

    def _post_forward_hook(self, unit):
        def hook(module, inputs, output):
            for p in unit.params:
                p.param.data = p.placeholder
            self._forward_ptrs = {k: u for k, u in self._forward_ptrs.items() if u is not unit}
        return hook

    def _pack(self, t):
        if not self._forward_ptrs:
            return t
        try:
            unit = self._forward_ptrs.get(_storage_ptr(t))
        except (RuntimeError, NotImplementedError):
            return t
        if unit is None:
            return t
        return _Saved(unit, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        self._begin_backward()
        unit = saved.unit
        weights = self._kept.get(unit.index)
        if weights is None:
            weights = self._backward_weights.get(unit.index)
        if weights is None and unit.index in self._parts:
            # The secondary shard: the unit again from the group's parts.
            values = torch.from_numpy(self._session.regather(unit.index, self._parts.pop(unit.index)))
            weights = values if unit.dtype == torch.float32 else values.to(unit.dtype)
            self._backward_weights[unit.index] = weights
        if weights is None:
            # The units backward reaches next that it will fetch: not those
            # kept from forward, fetched already, or done.
            pending = [u for u in reversed(self._units[:unit.index])
                       if u.index not in self._backward_weights and u.index not in self._kept
                       and u.index not in self._done and u.index not in self._parts]
            weights = self._weights(unit, "backward", pending)
            self._backward_weights[unit.index] = weights
        return weights.as_strided(saved.size, saved.stride, saved.offset)

    # ---- gradients ----

    def _begin_backward(self):
        if not self._in_backward:
            self._in_backward = True
            self._backward_started = time.time()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _grad_hook(self, unit, i):
        def hook(*unused):
            p = unit.params[i]
            grad = p.param.grad
            if grad is None:
                return
            self._begin_backward()
            buffer, seen = self._grads.get(unit.index) or (np.zeros(unit.padded, dtype=np.float32), set())
            buffer[p.offset:p.offset + p.numel] = grad.detach().reshape(-1).to(torch.float32).numpy()
            seen.add(i)
            self._grads[unit.index] = (buffer, seen)
            p.param.grad = None
            if len(seen) == len(unit.params):
                self._finish_unit(unit)
        return hook

    def _finish_unit(self, unit):
        """The unit's gradient of this backward is complete: push it (or add
        it to the step's sum when the job accumulates on the trainer)."""
        buffer, _ = self._grads.pop(unit.index, (np.zeros(unit.padded, dtype=np.float32), None))
        self._backward_weights.pop(unit.index, None)
        self._kept.pop(unit.index, None)
        self._done.add(unit.index)
        if self.job["accumulate_on_trainer"]:
            total = self._accumulated.get(unit.index)
            self._accumulated[unit.index] = buffer if total is None else total + buffer
        else:
            self._pushes.append(self._session.push(unit.index, self.version, buffer, self._backwards))

    def _end_backward(self):
        # The servers reduce every unit of every micro-batch: a unit whose
        # parameters got no gradient (or only some) in this backward pushes
        # what it has, zeros for the rest.
        for unit in self._units:
            if unit.index not in self._done:
                self._finish_unit(unit)
        self._session.add_model_time(self._backward_started, time.time())
        self._in_backward = False
        self._done.clear()
        self._backward_weights.clear()
        self._backwards += 1

    # ---- the step ----

    def forward(self, *args, **kwargs):
        if self.fabric_group > 1 and self._session.group_size() == 1:
            # Here, not when wrapped: the members meet, and one process may
            # wrap all of its trainers before any of them runs.
            self._session.join_group(self.fabric_group, self._group_host)
        started = time.time()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = self.module(*args, **kwargs)
        self._session.add_model_time(started, time.time())
        return out

    def step(self, loss=float("nan"), tokens=0):
        """Ends the step: pushes what the trainer accumulated (if the job
        accumulates on the trainer), waits until every push of the step is
        acknowledged, and moves to the next version. Returns the step's
        times and bytes (also exported on /metrics)."""
        expected = self.job["micro_batches"]
        if self._backwards != expected:
            raise RuntimeError(f"step {self.version} ran {self._backwards} backward passes; the job reduces "
                               f"{expected} micro-batch(es) per trainer per step")
        if self.job["accumulate_on_trainer"]:
            for unit in self._units:
                total = self._accumulated.pop(unit.index, np.zeros(unit.padded, dtype=np.float32))
                self._pushes.append(self._session.push(unit.index, self.version, total, 0))
        pushes, self._pushes = self._pushes, []
        for push in pushes:
            push.wait()
        for name, b in self.module.named_buffers():
            start = self._buffers_at_start.get(name)
            if start is None or start.shape != b.shape or not torch.equal(start, b.detach()):
                raise RuntimeError(f"buffer {name} changed during step {self.version}: pshard keeps buffers as "
                                   "the constants they were when wrapped (each trainer its own copy, not "
                                   "synchronised, checkpointed or exported)")
        report = self._session.record_step(self.version, float(loss), int(tokens))
        self.version += 1
        self._backwards = 0
        self._fetches.clear()
        self._kept.clear()
        self._resident.clear()
        self._parts.clear()
        return report

    def gather_weights(self):
        """Every parameter's values at the current version, by name (copies),
        fetched from every shard by this trainer alone."""
        out = {}
        for unit in self._units:
            weights = torch.from_numpy(self._session.fetch(unit.index, self.version, alone=True).values())
            for p in unit.params:
                out[p.name] = weights[p.offset:p.offset + p.numel].view(p.shape).to(unit.dtype).clone()
        return out

    def metrics_port(self):
        return self._session.metrics_port()


def _difference(ours, theirs):
    """The first way two layout documents differ, in words."""
    if ours["model"] != theirs["model"]:
        return f"they train \"{theirs['model']}\", this module is \"{ours['model']}\""
    a = [(u["name"], t["name"], t["shape"]) for u in ours["units"] for t in u["tensors"]]
    b = [(u["name"], t["name"], t["shape"]) for u in theirs["units"] for t in u["tensors"]]
    for x, y in zip(a, b):
        if x != y:
            return f"their unit {y[0]} has {y[1]} {y[2]} where this module's {x[0]} has {x[1]} {x[2]}"
    if len(a) != len(b):
        return f"they hold {len(b)} tensors, this module {len(a)}"
    return "their layout differs in initialisation or decay"
