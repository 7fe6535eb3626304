"""Measuring workload profiles: a network, a dataset shape and a batch size on the local device.

A profile (:class:`~ddlscope.modeling.profile.WorkloadProfile`) is measured once per workload,
device and optimizer and cached as JSON (:func:`load_or_profile`); every prediction reads it.
torch and the workload modules are imported inside the functions, so that importing this module
stays cheap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

from ddlscope.modeling.profile import (DataLoadProfile, DeviceProfile, LayerProfile, OptimizerSetting, StepProfile,
                                       WorkloadProfile, gib_text, step_peak_bytes)

STEP_REPEATS = 5
"""Measured training steps per batch size (at least; after the warm-up); their median is kept."""


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """How many training steps a profile warms up with and times, per batch size.

    At least ``warmup_steps`` steps and ``warmup_s`` seconds of them are run untimed, then at least
    ``timed_steps`` steps and ``window_s`` seconds of them are timed (at most ``max_timed_steps``);
    the median of the timed steps is kept. A CPU step takes 0.05-5 s and is steady after one step:
    1 warm-up and 5 timed steps. A GPU step takes milliseconds and settles over more: cuDNN's
    algorithm search, the caching allocator's growth and the clocks' ramp come in the first steps,
    and 1 warm-up + 5 timed steps of ResNet-18/CIFAR-10 b64 gave 15.7, 12.2 and 7.9 ms in three
    profiles on one H100, against 11.1-11.5 ms in runs (docs/validation.md, GPU section).
    """

    warmup_steps: int = 1
    warmup_s: float = 0.0
    timed_steps: int = STEP_REPEATS
    window_s: float = 0.0
    max_timed_steps: int = STEP_REPEATS


STEP_TIMING = {"cpu": StepTiming(),
               "cuda": StepTiming(warmup_steps=3, warmup_s=0.5, timed_steps=STEP_REPEATS, window_s=1.0,
                                  max_timed_steps=200)}
"""The :class:`StepTiming` of each device type (another type: the CPU's)."""
LAYER_REPEATS = 3
"""Timed runs of every layer per batch size (after one warm-up run); the minimum is kept."""
SYNTHETIC_TRAIN_SIZE = 512
"""Images in the synthetic copy written when no local copy of the dataset exists."""
MMAP_THRESHOLD_BYTES = 65536
"""glibc ``M_MMAP_THRESHOLD`` of the memory-probe process once it measures live memory: allocations
from 64 KiB up are mmap'd and unmapped on free, so the process's resident memory follows its live
tensors."""
RETAINED_STEPS = 3
"""Training steps each of the memory probe's growth processes runs with glibc's default allocator
settings, as a worker does, to measure how far the resident set grows beyond the live tensors
(:func:`_probe_resident_growth`)."""


def profile_batch_sizes(batch_size: int) -> list[int]:
    """The batch sizes a profile measures: ``batch_size`` and its halvings down to ``batch_size // 8``.

    At least 1, deduplicated, ascending; e.g. 32 -> [4, 8, 16, 32], 3 -> [1, 3].
    """
    return sorted({max(1, batch_size // 2**k) for k in range(4)})


def optimizer_setting(optimizer: OptimizerSetting | str = "sgd") -> OptimizerSetting:
    """The optimizer a profile trains with: ``optimizer`` itself, or the optimizer of that name with
    the run config's default hyperparameters (``learning_rate``, ``momentum``, ``weight_decay`` of
    :class:`ddlscope.config.RunConfigBase`; SGD: lr 0.01, momentum 0.9, no weight decay).

    Raises:
        UserError: an optimizer that ``ddlscope.workloads.step.OPTIMIZERS`` does not name.
    """
    from ddlscope.config import RunConfigBase
    from ddlscope.errors import UserError
    from ddlscope.workloads.step import OPTIMIZERS

    name = optimizer.name if isinstance(optimizer, OptimizerSetting) else optimizer
    if name not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {name!r}; allowed: {', '.join(OPTIMIZERS)}")
    if isinstance(optimizer, OptimizerSetting):
        return optimizer
    defaults = {k: RunConfigBase.model_fields[k].default for k in ("learning_rate", "momentum", "weight_decay")}
    return OptimizerSetting(name=name, **defaults)


def _build_optimizer(setting: OptimizerSetting, params):
    """:func:`ddlscope.workloads.step.build_optimizer` with ``setting``'s optimizer and hyperparameters."""
    from ddlscope.workloads.step import build_optimizer

    return build_optimizer(params, **setting.model_dump())


def _check_workload(network: str, dataset: str, batch_size: int, device: str, threads: int,
                    loader_workers: tuple[int, ...], memory_limit_bytes: int | None = None) -> None:
    """Raise :class:`UserError` for anything :func:`profile_workload` cannot measure."""
    from ddlscope.errors import UserError
    from ddlscope.workloads.datasets import DATASETS
    from ddlscope.workloads.models import NETWORKS

    if network not in NETWORKS:
        raise UserError(f"unknown network {network!r}; allowed: {', '.join(NETWORKS)}")
    if dataset not in DATASETS:
        raise UserError(f"unknown dataset {dataset!r}; allowed: {', '.join(DATASETS)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch size {batch_size!r}; allowed: an integer >= 1")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise UserError(f"threads {threads!r}; allowed: an integer >= 1")
    if device not in ("cpu", "cuda"):
        raise UserError(f"unknown device {device!r}; allowed: cpu, cuda")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("device 'cuda' asked for, but torch sees no CUDA device here; allowed: cpu")
    if any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in loader_workers):
        raise UserError(f"loader workers {list(loader_workers)}; allowed: integers >= 0")
    if memory_limit_bytes is not None and (isinstance(memory_limit_bytes, bool)
                                           or not isinstance(memory_limit_bytes, int) or memory_limit_bytes < 1):
        raise UserError(f"memory limit {memory_limit_bytes!r} bytes; allowed: None or an integer >= 1")


def device_name(device: str) -> str:
    """The CPU model (``/proc/cpuinfo`` "model name", else :func:`platform.processor`) or the GPU name."""
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


# ---------------------------------------------------------------- fake tensors: bytes and FLOPs


def _fake_analysis(network: str, family: str, batch_sizes: list[int], optimizer: OptimizerSetting) -> dict:
    """Bytes and FLOPs of the zoo model on fake tensors (nothing of the model's size is allocated).

    Returns a dict with ``layers`` (per top-level child: name, param_bytes, buffer_bytes,
    output_bytes_per_sample, saved_bytes_per_sample, input_saved_bytes_per_sample,
    forward_flops_per_sample at the largest batch size), the model's
    ``param_count``, ``param_bytes``, ``buffer_bytes``, ``optimizer_state_bytes``, and
    ``activation_peak_bytes`` per batch size.

    * saved bytes: storages autograd saves for backward (``saved_tensors_hooks``), parameters
      and buffers excluded, each storage counted once, charged to the first layer that saves it
      (so the bytes of a contiguous run of layers add up; a pipeline stage additionally holds
      the input it received);
    * FLOPs: :class:`torch.utils.flop_counter.FlopCounterMode` (2 per multiply-add);
    * activation peak: :class:`torch.distributed._tools.mem_tracker.MemTracker` over a whole
      training step (:func:`ddlscope.workloads.step.train_step` with ``optimizer``, its state
      created by one earlier step): its peak minus parameters, buffers, all gradients and
      optimizer state;
    * optimizer state: the bytes of every tensor in ``optimizer``'s state after those steps
      (momentum buffers; Adam's two moments and step counts).
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.flop_counter import FlopCounterMode

    from ddlscope.workloads.models import build_model, input_spec
    from ddlscope.workloads.step import train_step

    spec = input_spec(family)
    ref = max(batch_sizes)
    out: dict = {}
    with FakeTensorMode():
        model = build_model(network, family)
        children = list(model.named_children())
        state_keys = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        params = list(model.parameters())
        out["param_count"] = sum(p.numel() for p in params)
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
        out["buffer_bytes"] = sum(b.numel() * b.element_size() for b in model.buffers())

        # per layer: output bytes, saved bytes, FLOPs (one forward at the reference batch)
        x = torch.randn(ref, spec.channels, spec.height, spec.width)
        current = [""]
        saved: dict[int, tuple[str, int]] = {}
        outputs: dict[str, int] = {}
        input_keys: dict[str, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            key = st._cdata
            if key not in state_keys and key not in saved:
                saved[key] = (current[0], st.nbytes())
            return t

        handles = []
        for name, child in children:
            def enter(m, args, name=name):
                current[0] = name
                input_keys[name] = args[0].untyped_storage()._cdata

            handles.append(child.register_forward_pre_hook(enter))
            handles.append(child.register_forward_hook(
                lambda m, a, o, name=name: outputs.__setitem__(name, o.numel() * o.element_size())))
        with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x)
        for h in handles:
            h.remove()
        flops = counter.get_flop_counts()
        root = type(model).__name__
        saved_by_layer: dict[str, int] = {}
        input_saved: dict[str, int] = {}
        for key, (name, nbytes) in saved.items():
            saved_by_layer[name] = saved_by_layer.get(name, 0) + nbytes
            if input_keys.get(name) == key:
                input_saved[name] = nbytes
        out["layers"] = [
            dict(name=name,
                 param_bytes=sum(p.numel() * p.element_size() for p in child.parameters()),
                 output_bytes_per_sample=round(outputs[name] / ref),
                 saved_bytes_per_sample=round(saved_by_layer.get(name, 0) / ref),
                 forward_flops_per_sample=float(sum(flops.get(f"{root}.{name}", {}).values())) / ref,
                 buffer_bytes=sum(b.numel() * b.element_size() for b in child.buffers()),
                 input_saved_bytes_per_sample=round(input_saved.get(name, 0) / ref))
            for name, child in children
        ]

        # whole training steps: peak memory per batch size
        opt = _build_optimizer(optimizer, model.parameters())
        peaks: dict[int, int] = {}
        for i, b in enumerate(batch_sizes):
            xb = torch.randn(b, spec.channels, spec.height, spec.width)
            yb = torch.randint(0, spec.num_classes, (b,))
            if i == 0:  # the optimizer's state exists in every step but the first
                train_step(model, opt, xb, yb)
            tracker = MemTracker()
            tracker.track_external(model, opt, xb, yb)
            with tracker:
                train_step(model, opt, xb, yb)
            peak = sum(v for k, v in next(iter(tracker.get_tracker_snapshot("peak").values())).items() if k != "Total")
            peaks[b] = peak
        out["optimizer_state_bytes"] = sum(t.numel() * t.element_size() for s in opt.state.values()
                                           for t in s.values() if isinstance(t, torch.Tensor))
        state = out["param_bytes"] * 2 + out["buffer_bytes"] + out["optimizer_state_bytes"]  # params, grads, buffers, opt
        out["activation_peak_bytes"] = {b: max(0, p - state) for b, p in peaks.items()}
    return out


# ---------------------------------------------------------------- timing on the real device


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_layers(model, x, repeats: int = LAYER_REPEATS) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of each top-level child of ``model`` on batch ``x`` ([b, C, H, W]).

    Each child runs on the activation the children before it produce, its input requiring a
    gradient except for the first (the data needs none in training); the backward pass gets a
    random output gradient. Minimum of ``repeats`` runs after one warm-up run; BatchNorm
    running statistics are restored afterwards and the gradients dropped.
    """
    import time

    import torch

    fwd_s, bwd_s = [], []
    for i, layer in enumerate(model.children()):
        saved = [b.detach().clone() for b in layer.buffers()]
        f_times, b_times = [], []
        for r in range(repeats + 1):
            inp = x.detach().requires_grad_(i > 0 and x.is_floating_point())
            _sync(x.device)
            t0 = time.perf_counter()
            out = layer(inp)
            _sync(x.device)
            t1 = time.perf_counter()
            grad = torch.randn_like(out)
            _sync(x.device)
            t2 = time.perf_counter()
            out.backward(grad)
            _sync(x.device)
            t3 = time.perf_counter()
            if r:
                f_times.append(t1 - t0)
                b_times.append(t3 - t2)
        layer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, s in zip(layer.buffers(), saved):
                b.copy_(s)
        fwd_s.append(min(f_times))
        bwd_s.append(min(b_times))
        x = out.detach()
    return fwd_s, bwd_s


def _time_steps(model, optimizer, x, y, timing: StepTiming | None = None,
                watch=None) -> tuple[float, float, float, int]:
    """Median (forward + loss, backward, optimizer step + zero_grad) seconds of training steps,
    and how many steps were timed.

    The step is :func:`ddlscope.workloads.step.train_step` (the training loop's: its loss,
    backward, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``), written out here
    to time its three parts. ``timing`` (default: :data:`STEP_TIMING` of ``x``'s device type) says
    how many steps warm up and how many are timed; the seconds are the device's
    (:class:`ddlscope.measure.timeline.Stopwatch`, or ``watch``: tests pass one with a fake clock).
    """
    import statistics

    from ddlscope.measure.timeline import Stopwatch
    from ddlscope.workloads.step import loss_function

    timing = timing or STEP_TIMING.get(x.device.type, STEP_TIMING["cpu"])
    loss_fn = loss_function()
    watch = watch or Stopwatch(x.device)

    def step() -> tuple[float, float, float]:
        watch.start()
        loss = loss_fn(model(x), y)
        loss.item()
        f = watch.lap()
        loss.backward()
        b = watch.lap()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return f, b, watch.lap()

    warm, warm_s = 0, 0.0
    while warm < timing.warmup_steps or warm_s < timing.warmup_s:
        warm_s += sum(step())
        warm += 1
    laps: list[tuple[float, float, float]] = []
    while len(laps) < timing.max_timed_steps and (len(laps) < timing.timed_steps
                                                    or sum(map(sum, laps)) < timing.window_s):
        laps.append(step())
    f, b, o = (statistics.median(lap[i] for lap in laps) for i in range(3))
    return f, b, o, len(laps)


# ---------------------------------------------------------------- device microbenchmarks


def _peak_tflops(device) -> float:
    """Float32 matmul throughput (1e12 FLOP/s): best of 5 square matmuls after a warm-up.

    n = 1024 on CPU, 8192 on CUDA; 2 n^3 FLOP per matmul.
    """
    import torch

    from ddlscope.measure.stats import time_repeats

    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    best = min(time_repeats(lambda: torch.mm(a, b), 5, warmup=1, sync=lambda: _sync(device)))
    return 2 * n**3 / best / 1e12


def _bandwidth_gb_per_s(device) -> float:
    """Copy bandwidth (1e9 bytes/s) of a large tensor: read + write bytes per copy, as STREAM's
    "Copy" counts them (McCalpin 1995); best of 5 after a warm-up. 64 MiB on CPU, 1 GiB on CUDA."""
    import torch

    from ddlscope.measure.stats import time_repeats

    nbytes = 2**30 if device.type == "cuda" else 2**26
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    best = min(time_repeats(lambda: dst.copy_(src), 5, warmup=1, sync=lambda: _sync(device)))
    return 2 * nbytes / best / 1e9


def _memory_capacity_bytes(device, threads: int) -> int:
    """CPU: host memory x threads / logical cores (psutil); CUDA: the device's total memory."""
    import os

    if device.type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    cores = os.cpu_count() or 1
    return max(1, int(psutil.virtual_memory().total * min(threads, cores) / cores))


# ---------------------------------------------------------------- real memory: the probe process


_SCRIPT_HEAD = """
import gc, json, os, signal, sys
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None
import torch, torch.distributed, ddlscope.train.loop
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
from ddlscope.modeling.profile import OptimizerSetting
optimizer = OptimizerSetting(**args["optimizer"])
"""
"""What the memory probe and its growth processes start with: what a worker imports, one torch
thread per core, ``status(key)`` (a ``/proc/self/status`` field in bytes), ``args`` and ``optimizer``."""

_PROBE_SCRIPT = _SCRIPT_HEAD + """
from ddlscope.profiling.profile import _probe_steps, _fix_mmap_threshold, _GrowthProcesses, _import_as_a_worker
_import_as_a_worker(args["family"], optimizer)
gc.collect()
runtime = status("VmRSS")
try:  # what a hivemind peer or a dmoe trainer imports on top
    import hivemind
    gc.collect()
    hivemind_bytes = max(0, status("VmRSS") - runtime)
except ImportError:
    hivemind_bytes = None
batch_sizes = json.loads(sys.stdin.readline())  # sent once the profile knows which batch sizes fit
growth = _GrowthProcesses(args["network"], args["family"], sorted({min(batch_sizes), max(batch_sizes)}), optimizer,
                          args["threads"], args["retained_steps"], args["growth_cores"])
if not _fix_mmap_threshold(args["mmap_threshold"]):  # not glibc: the live steps are not live memory only
    growth.cancel()
peaks = _probe_steps(args["network"], args["family"], batch_sizes, optimizer, status)
print(json.dumps({"runtime_bytes": runtime, "hivemind_bytes": hivemind_bytes, "peaks": peaks,
                  "growth": growth.result()}))
"""

_GROWTH_SCRIPT = _SCRIPT_HEAD + """
from ddlscope.launch.processes import die_with_parent
die_with_parent(signal.SIGKILL)  # no orphan when the probe is ended
if os.getppid() != args["parent_pid"]:
    sys.exit(1)
from ddlscope.profiling.profile import _probe_resident_growth
gc.collect()
print(json.dumps(_probe_resident_growth(args["network"], args["family"], args["batch_size"], optimizer, status,
                                        args["steps"])))
"""

_TIMING_SCRIPT = _SCRIPT_HEAD + """
from ddlscope.launch.processes import die_with_parent
die_with_parent(signal.SIGKILL)  # no orphan when the profile is ended
if os.getppid() != args["parent_pid"]:
    sys.exit(1)
from ddlscope.profiling.profile import _fresh_step_times
for line in sys.stdin:  # a batch size per line; each timed in a child forked from this clean process
    batch_size, me = int(line), os.getpid()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        die_with_parent(signal.SIGKILL)
        code = 1
        try:
            if os.getppid() == me:
                times = _fresh_step_times(args["network"], args["family"], batch_size, optimizer)
                os.write(write_end, json.dumps([*times, os.getpid()]).encode())
                code = 0
        except BaseException as exc:  # said here: os._exit below prints no traceback
            sys.stderr.write(f"batch {batch_size}: {type(exc).__name__}: {exc}\\n")
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        found = reader.read()
    os.waitpid(pid, 0)
    print(found or "null", flush=True)
"""


def _fresh_step_times(network: str, family: str, batch_size: int, optimizer: OptimizerSetting) -> list[float]:
    """In a fresh process: :func:`_time_steps` of a freshly built model (seeded as the profile's)
    training on CPU at ``batch_size``; ``[forward_s, backward_s, optimizer_s, timed steps]``."""
    import torch

    torch.manual_seed(0)
    return list(_time_steps(*_fresh_training(network, family, optimizer, torch.device("cpu"), batch_size)))


def _worker_env(threads: int) -> dict[str, str]:
    """The environment of a process started to measure as a worker runs: ``threads`` OpenMP
    threads, glibc's default allocator settings (no ``MALLOC_MMAP_THRESHOLD_``) and this copy of
    ddlscope importable."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class FreshStepTimer:
    """CPU: :func:`_time_steps` at each batch size in a fresh process that trains at that batch size
    only, as a run's worker does: a clean process started at once (it imports what a worker imports,
    ``threads`` torch threads, glibc's default allocator settings; pinned to ``cores`` meanwhile, so
    that its start-up overlaps the profile's other work) forks a child per batch size, one after the
    other, when :meth:`result` asks.

    Why not in the profile's own process: how fast a CPU step runs depends on what the process's
    heap has held before. After the layer timings at every batch size, a MobileNetV2/MNIST step at
    batch 16 took no page fault; in a fresh process it took 15,000-18,000 per step, as a worker's
    do. Three profiles timed in one process read batch 16's step per sample at 0.75 of batch 32's,
    single-size processes 1.04-1.09, and the runs' pipeline stages (micro-batch 16) computed per
    sample what ddp's workers (batch 32) did, so the pipelines' stage compute was 22-27 %
    under-predicted (docs/validation.md, stop 64).
    """

    def __init__(self, network: str, family: str, threads: int, optimizer: OptimizerSetting,
                 cores: list[int] | None = None) -> None:
        import json
        import subprocess
        import sys

        env = _worker_env(threads)
        args = json.dumps(dict(network=network, family=family, threads=threads, optimizer=optimizer.model_dump(),
                               parent_pid=os.getpid()))
        try:
            self._process = subprocess.Popen([sys.executable, "-c", _TIMING_SCRIPT, args], env=env,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             text=True)
        except OSError as exc:
            raise RuntimeError(f"the step-timing process failed to start: {exc}") from exc
        with contextlib.suppress(OSError):  # it already ended (its result says why), or the cores are not ours
            os.sched_setaffinity(self._process.pid, cores or spare_cores(os.sched_getaffinity(0), threads))
        self.child_pids: list[int] = []
        """The processes that timed the batch sizes, after :meth:`result` (one per batch size)."""

    def result(self, batch_sizes: list[int], cores: list[int], timeout_s: float = 600.0) \
            -> dict[int, tuple[float, float, float, int]]:
        """Time the steps at ``batch_sizes``, the children pinned to ``cores`` (the profile's, which
        waits meanwhile): ``{batch_size: (forward_s, backward_s, optimizer_s, timed steps)}``.

        Raises:
            RuntimeError: the process failed, printed no time for a batch size, or ran longer than
                ``timeout_s`` (it is ended; the message has the last lines of its error output).
        """
        import json
        import subprocess

        with contextlib.suppress(OSError):
            os.sched_setaffinity(self._process.pid, cores)  # the children inherit it
        try:
            out, err = self._process.communicate("".join(f"{b}\n" for b in batch_sizes), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.cancel()
            raise RuntimeError(f"timing the training steps in fresh processes took longer than {timeout_s:g} s") \
                from None
        lines = out.strip().splitlines()
        try:
            found = [json.loads(line) for line in lines]
            times = {b: (float(t[0]), float(t[1]), float(t[2]), int(t[3])) for b, t in zip(batch_sizes, found)}
            self.child_pids = [int(t[4]) for t in found]
        except (ValueError, TypeError, IndexError):
            times = {}
        if self._process.returncode != 0 or len(times) != len(batch_sizes):
            missing = [b for b in batch_sizes if b not in times]
            tail = " | ".join(err.strip().splitlines()[-3:])
            raise RuntimeError(f"timing the training steps in fresh processes failed at batch "
                               f"{missing[0] if missing else '?'} (exit {self._process.returncode}): {tail}")
        return times

    def cancel(self) -> None:
        """End the process now (nothing when it has ended)."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.communicate()


def _import_as_a_worker(family: str, optimizer: OptimizerSetting) -> None:
    """What a worker has imported when its training starts: ``tiny_cnn`` and its optimizer are
    built and dropped, nothing is trained. Building an optimizer imports ``torch._dynamo`` and
    friends (69 MiB of resident memory, 2026-12-04); a worker builds its own before training, so
    the resident set at its start includes them. What the first training steps add (kernels' code,
    JIT-compiled kernels, caches: 18 MiB for tiny_cnn) is left to the growth that
    :func:`_probe_resident_growth` measures, as a run counts it in the training's growth.
    """
    from ddlscope.workloads.models import build_model

    model = build_model("tiny_cnn", family)
    _build_optimizer(optimizer, model.parameters())


def _step_bytes(network: str, family: str, batch_sizes: list[int], optimizer: OptimizerSetting, device,
                begin, peak) -> dict[int, int] | None:
    """Memory one training step adds, per batch size, as the caller's counters see it.

    For each batch size: one step (:func:`ddlscope.workloads.step.train_step`; it creates the
    optimizer's state the first time), then ``begin(owned)`` resets the peak counter and returns
    the bytes the step's measure starts from (None: the counter cannot be reset, the result is
    None), one more step, and ``peak()`` minus those bytes is the memory the step needed beyond
    parameters, buffers, optimizer state and the input batch. ``owned`` is what those tensors
    hold (:func:`_tensor_bytes`): a counter of bytes in use returns it, so that memory the
    libraries keep after their first call (cuBLAS's workspaces, which torch takes from its
    caching allocator and keeps) counts as the step's, as ``max_memory_allocated`` over a run
    sees it.
    """
    import torch

    from ddlscope.workloads.models import build_model, input_spec
    from ddlscope.workloads.step import train_step

    spec = input_spec(family)
    torch.manual_seed(0)
    model = build_model(network, family).to(device)
    opt = _build_optimizer(optimizer, model.parameters())
    out: dict[int, int] = {}
    for b in batch_sizes:
        x = torch.randn(b, spec.channels, spec.height, spec.width, device=device)
        y = torch.randint(0, spec.num_classes, (b,), device=device)
        train_step(model, opt, x, y)
        before = begin(_tensor_bytes(model, opt, x, y))
        if before is None:
            return None
        train_step(model, opt, x, y)
        out[b] = max(0, peak() - before)
    return out


def _tensor_bytes(model, optimizer, *tensors) -> int:
    """Bytes of the distinct storages of ``model``'s parameters, buffers and gradients,
    ``optimizer``'s state and ``tensors``."""
    import torch

    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    for state in optimizer.state.values():
        for v in state.values():
            add(v)
    for t in tensors:
        add(t)
    return sum(seen.values())


def _probe_resident_growth(network: str, family: str, batch_size: int, optimizer: OptimizerSetting, status,
                           steps: int) -> dict | None:
    """How far this process's resident set grows over its first ``steps`` training steps at
    ``batch_size`` (:func:`_train_steps`), measured as a run measures a worker
    (:func:`ddlscope.train.loop.run_worker`: from the resident set once the model, the optimizer and
    the batch exist, before the first step, to the high-water mark after the last).

    Run in a fresh process (:class:`_GrowthProcesses`) with glibc's default allocator settings, as a
    worker has them, the growth holds the step's live memory, the optimizer's state (which the first
    step creates), the freed heap glibc keeps, and what a process's first training step adds
    whatever the batch: kernels' code pages, JIT-compiled kernels, the libraries' caches.

    Returns ``{"batch_size", "growth_bytes"}``, or None when the high-water mark cannot be reset.
    MobileNetV2/MNIST on one thread, in fresh processes: 69 and 646 MiB at batch 2 and 32; moe_cnn:
    28 and 46 MiB at batch 2 and 64 (2026-12-04, this project's 2-core machine).
    """
    import torch

    start: list[int | None] = []
    _train_steps(network, family, optimizer, torch.device("cpu"), batch_size, steps=steps,
                 before=lambda: start.append(_reset_resident_peak(status)))
    if start[0] is None:
        return None
    return {"batch_size": batch_size, "growth_bytes": max(0, status("VmHWM") - start[0])}


class _GrowthProcesses:
    """:func:`_probe_resident_growth` at each of ``batch_sizes``, each in a fresh Python process of
    its own that imports what a worker imports (run one after the other, in the background, pinned
    to ``cores``). A fresh process, not a child forked from the probe: a forked child maps the
    libraries' code anew and faults in every page it runs (moe_cnn grew by 35 and 61 MiB at batch 2
    and 64 in a forked child, 28 and 46 MiB in fresh processes; 2026-12-04).

    :meth:`result` waits and returns ``[{"batch_size", "growth_bytes"}, ...]`` for the batch sizes
    that were measured (a failed process leaves its batch out), None when none was. :meth:`cancel`
    ends them (nothing is measured then).
    """

    def __init__(self, network: str, family: str, batch_sizes: list[int], optimizer: OptimizerSetting,
                 threads: int, steps: int, cores: list[int] | None) -> None:
        import threading

        self._lock = threading.Lock()
        self._cancelled = False
        self._current = None
        self._results: list[dict] = []
        self._thread = threading.Thread(target=self._run_all, name="ddlscope-growth-probes", daemon=True,
                                        args=(network, family, batch_sizes, optimizer, threads, steps, cores))
        self._thread.start()

    def _run_all(self, network, family, batch_sizes, optimizer, threads, steps, cores) -> None:
        import json
        import subprocess
        import sys

        env = _worker_env(threads)
        for b in batch_sizes:
            args = json.dumps(dict(network=network, family=family, batch_size=b, threads=threads, steps=steps,
                                   optimizer=optimizer.model_dump(), parent_pid=os.getpid()))
            with self._lock:
                if self._cancelled:
                    return
                try:
                    self._current = proc = subprocess.Popen([sys.executable, "-c", _GROWTH_SCRIPT, args], env=env,
                                                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                                            text=True)
                except OSError:
                    return
            if cores:
                with contextlib.suppress(OSError):  # it ended already, or the cores are not ours
                    os.sched_setaffinity(proc.pid, cores)
            out, _ = proc.communicate()
            with contextlib.suppress(ValueError, IndexError, TypeError, KeyError):
                found = json.loads(out.strip().splitlines()[-1])
                if proc.returncode == 0 and found is not None:
                    self._results.append({"batch_size": int(found["batch_size"]),
                                          "growth_bytes": int(found["growth_bytes"])})

    def result(self) -> list[dict] | None:
        self._thread.join()
        return None if self._cancelled or not self._results else list(self._results)

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._current is not None and self._current.poll() is None:
                self._current.kill()
        self._thread.join()


def _fix_mmap_threshold(threshold_bytes: int) -> bool:
    """Fix glibc's mmap threshold at ``threshold_bytes`` in this process (``mallopt(M_MMAP_THRESHOLD)``,
    which also ends glibc's dynamic threshold, as ``MALLOC_MMAP_THRESHOLD_`` does at start-up) and hand
    freed heap memory back to the kernel (``malloc_trim(0)``), so that from now on the resident set
    follows the live allocations. False where the C library is not glibc (nothing is changed)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3  # glibc's <malloc.h>
    if mallopt(m_mmap_threshold, int(threshold_bytes)) != 1:
        return False
    malloc_trim(0)
    return True


def _probe_steps(network: str, family: str, batch_sizes: list[int], optimizer: OptimizerSetting,
                 status) -> dict[int, int] | None:
    """In the probe process: resident bytes added by one training step, per batch size (:func:`_step_bytes`).

    The counter is the kernel's: before the measured step the garbage is collected, VmRSS read and
    the resident high-water mark reset (``echo 5 > /proc/self/clear_refs``); after it VmHWM is read.
    ``status(key)``: the bytes of a ``/proc/self/status`` field. None when the high-water mark
    cannot be reset.
    """
    import torch

    def begin(owned: int) -> int | None:  # the resident set counts every byte; ``owned`` is not needed
        return _reset_resident_peak(status)

    return _step_bytes(network, family, batch_sizes, optimizer, torch.device("cpu"), begin, lambda: status("VmHWM"))


def _reset_resident_peak(status) -> int | None:
    """Collect the garbage, read the resident set (VmRSS, bytes) and reset the kernel's resident
    high-water mark to it (``echo 5 > /proc/self/clear_refs``); None where it cannot be reset."""
    import gc

    gc.collect()
    before = status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return before


def _measure_cuda_memory(network: str, family: str, batch_sizes: list[int], device,
                         optimizer: OptimizerSetting) -> tuple[int, dict[int, int] | None]:
    """``(runtime_bytes, step bytes per batch size)`` measured with real tensors on a CUDA device,
    training with ``optimizer`` (on CPU: :class:`CpuMemoryProbe`).

    ``runtime_bytes`` is the memory in use on the device beyond what torch's allocator reserved
    (the CUDA context and libraries, as ``torch.cuda.mem_get_info`` sees it); step bytes come from
    ``torch.cuda.max_memory_allocated`` in this process less the bytes of the training tensors
    (:func:`_step_bytes`), so they include the workspaces cuBLAS keeps in torch's allocator (66-69
    MiB on an H100 with torch 2.11, whatever the model: without them the predicted allocator peak
    was 14 % low for ResNet-18/CIFAR-10 b64, 25 % for VGG-11).
    """
    import torch

    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(device)
    runtime = max(0, total - free - torch.cuda.memory_reserved(device))

    def begin(owned: int) -> int:
        # from the training tensors' bytes, not memory_allocated: the rest of what is allocated
        # (library workspaces, measured at 66-69 MiB on an H100) is held through every step
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return owned

    def peak() -> int:
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)

    peaks = _step_bytes(network, family, batch_sizes, optimizer, device, begin, peak)
    torch.cuda.empty_cache()
    return runtime, peaks


def spare_cores(cores: set[int] | list[int], used: int) -> list[int]:
    """The cores of ``cores`` beyond the first ``used`` (sorted), where a measurement that times
    nothing can run beside one pinned to those first ones; the first ``used`` when none is left
    (the two then share them)."""
    ordered = sorted(cores)
    return ordered[used:] or ordered[:used]


class CpuMemoryProbe:
    """The CPU memory probe: a fresh Python process that imports what a worker has imported when its
    training starts (torch, ddlscope's training loop, what building an optimizer imports:
    :func:`_import_as_a_worker`); its resident set (VmRSS) then is ``runtime_bytes`` (interpreter,
    libraries; no model, nothing trained: what a run's worker holds when its training starts, less
    its model), and what importing hivemind adds to it (a hivemind peer's or a dmoe trainer's). Once it knows the batch sizes that fit, it starts :class:`_GrowthProcesses` at the
    smallest and the largest: fresh processes with glibc's default allocator settings, as a worker
    has them, that measure how far a worker's resident set grows over its first
    :data:`RETAINED_STEPS` steps (:func:`_probe_resident_growth`). glibc keeps freed heap memory and a
    process's first steps add memory whatever the batch, so a run's resident set grows beyond its
    live tensors; two batch sizes tell the two apart (:meth:`WorkloadProfile.retained_fit`).
    Meanwhile it fixes its own glibc mmap threshold at 64 KiB (:func:`_fix_mmap_threshold`) and runs
    :func:`_probe_steps`: freed tensors now leave the resident set at once and the high-water mark
    counts live memory only, including the kernels' internal work buffers that fake tensors do not
    see (e.g. convolution workspaces).

    It starts at construction and runs in the background, with ``threads`` torch threads, pinned
    to ``cores`` (default: this process's cores beyond its first ``threads``, :func:`spare_cores`);
    the growth processes run on ``growth_cores`` (default: this process's first ``threads`` cores,
    idle while the profile waits for :meth:`result`). It times nothing and its counters are its own,
    so the profile starts it before its fake-tensor analysis: the imports run beside the analysis,
    and the steps wait for :meth:`result`, which sends the batch sizes that fit (a step at one that
    does not could take more memory than the host has) and waits for it, before anything is timed.
    ResNet-18/CIFAR-10 at batch 64 took 14.8 s in the probe and 7.4 s in the analysis on this
    2-core machine (2026-11-29), one after the other before. :meth:`cancel` ends it (also on a
    failed profile).
    """

    def __init__(self, network: str, family: str, threads: int, optimizer: OptimizerSetting,
                 cores: list[int] | None = None, growth_cores: list[int] | None = None) -> None:
        import json
        import subprocess
        import sys

        env = _worker_env(threads)  # its growth processes measure at glibc's defaults, as a worker runs
        args = json.dumps(dict(network=network, family=family, threads=threads, optimizer=optimizer.model_dump(),
                               retained_steps=RETAINED_STEPS, mmap_threshold=MMAP_THRESHOLD_BYTES,
                               growth_cores=growth_cores or sorted(os.sched_getaffinity(0))[:threads]))
        try:
            self._process = subprocess.Popen([sys.executable, "-c", _PROBE_SCRIPT, args], env=env, stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as exc:
            raise RuntimeError(f"the memory probe process failed to start: {exc}") from exc
        try:  # before torch starts its threads (they inherit it)
            os.sched_setaffinity(self._process.pid, cores or spare_cores(os.sched_getaffinity(0), threads))
        except OSError:  # it already ended (its result says why) or the cores are not ours: it runs where it is
            pass

    def result(self, batch_sizes: list[int], timeout_s: float = 600.0) \
            -> tuple[int, dict[int, int] | None, dict[int, int] | None, int | None]:
        """Let the probe train at ``batch_sizes`` and wait for it: ``(runtime_bytes, step bytes per
        batch size, growth, hivemind bytes)``; step bytes None where /proc cannot reset the
        high-water mark; hivemind bytes: what importing hivemind added to the runtime, None where
        hivemind is not installed.

        ``growth`` maps the smallest and the largest batch size to how far a fresh worker's resident
        set grew with glibc's defaults over :data:`RETAINED_STEPS` steps there, bytes
        (:func:`_probe_resident_growth`); a batch size whose process failed is missing; None where
        nothing was measured or the C library is not glibc.

        Raises:
            RuntimeError: the probe failed or ran longer than ``timeout_s`` (then it is ended).
        """
        import json
        import subprocess

        try:
            out, err = self._process.communicate(json.dumps(list(batch_sizes)) + "\n", timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.cancel()
            raise RuntimeError(f"the memory probe process ran longer than {timeout_s:g} s") from None
        if self._process.returncode != 0:
            tail = " | ".join(err.strip().splitlines()[-3:])
            raise RuntimeError(f"the memory probe process failed (exit {self._process.returncode}): {tail}")
        try:
            result = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise RuntimeError(f"the memory probe process printed no result: {exc}") from exc
        peaks = None if result["peaks"] is None else {int(k): int(v) for k, v in result["peaks"].items()}
        growth = {int(g["batch_size"]): int(g["growth_bytes"]) for g in result.get("growth") or []}
        hivemind = result.get("hivemind_bytes")
        return int(result["runtime_bytes"] or 0), peaks, growth or None, None if hivemind is None else int(hivemind)

    def cancel(self) -> None:
        """End the probe now (nothing when it has ended)."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.communicate()  # reaps it and closes its pipes (again: a no-op)


# ---------------------------------------------------------------- data loading


def _open_training_data(dataset: str, data_root, cache_root, min_samples: int):
    """The dataset's training split with the training transforms, as a run opens it.

    Uses ``data_root/<dataset>`` (default: :func:`default_data_root`) when it exists (digits is
    materialised there, it is bundled real data), else a synthetic copy with
    :data:`SYNTHETIC_TRAIN_SIZE` images (or ``min_samples`` if more) written under ``cache_root``.
    """
    from pathlib import Path

    from ddlscope.train.loop import Transformed
    from ddlscope.workloads.datasets import default_data_root, open_dataset, write_synthetic
    from ddlscope.workloads.preprocessing import train_transform

    root = Path(data_root) if data_root is not None else default_data_root()
    if dataset != "digits" and not (root / dataset).is_dir():
        root = Path(cache_root)
        write_synthetic(dataset, root, max(SYNTHETIC_TRAIN_SIZE, min_samples), 16, seed=0)
    train_set, spec = open_dataset(dataset, root, "train")
    return Transformed(train_set, train_transform(spec, augment=True)), root / dataset


def _measure_data_loading(dataset: str, batch_size: int, loader_workers: tuple[int, ...], data_root,
                          cache_root) -> list[DataLoadProfile]:
    """Samples/s of the training input pipeline (decode + augmentation + batching) per worker count.

    Times :func:`ddlscope.datapipe.measure.loader_samples_per_s` (shuffled, drop_last, persistent
    workers, as the training loop builds its loader) over ``max(4 batches, 256 samples)`` after a
    warm-up batch.
    """
    from ddlscope.datapipe.measure import loader_samples_per_s
    from ddlscope.errors import UserError

    train_set, folder = _open_training_data(dataset, data_root, cache_root, batch_size)
    if len(train_set) < batch_size:
        raise UserError(f"batch size {batch_size} is larger than the training split of {folder} "
                        f"({len(train_set)} samples); allowed: <= {len(train_set)}")
    samples = max(4 * batch_size, 256)
    return [DataLoadProfile(loader_workers=w,
                            samples_per_s=loader_samples_per_s(train_set, batch_size, w, samples).samples_per_s)
            for w in sorted(set(loader_workers))]


# ---------------------------------------------------------------- batch sizes that fit the device


def out_of_memory_message(exc: BaseException, device) -> str:
    """One line on a ``torch.OutOfMemoryError`` on ``device`` (a :class:`torch.device`).

    On CUDA, when the allocator's message says how much it tried to allocate (``Tried to allocate
    2.00 GiB``): that, the device's free and total memory (``torch.cuda.mem_get_info``) and what
    torch's allocator held (``torch.cuda.memory_reserved``); otherwise the first line of the
    allocator's message. Call it while the tensors of the failed step are still alive (in the
    ``except`` block), so that the free memory is the one the allocation saw.
    """
    import re

    import torch

    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    asked = re.search(r"Tried to allocate ([0-9.]+ ?[KMGT]?i?B)", text)
    if device.type == "cuda" and asked is not None:
        try:
            free, total = torch.cuda.mem_get_info(device)
            held = torch.cuda.memory_reserved(device)
        except RuntimeError:
            pass
        else:
            return (f"out of memory on {device}: needed {asked.group(1)} more with {free / 2**30:.2f} GiB free of "
                    f"{total / 2**30:.1f} GiB (torch's allocator held {held / 2**30:.2f} GiB)")
    return f"out of memory on {device}: {first}"


def _halvings(batch_size: int) -> list[int]:
    """``batch_size``, ``batch_size // 2``, ... down to 1, ascending (e.g. 12 -> [1, 3, 6, 12])."""
    return sorted({batch_size // 2**k for k in range(batch_size.bit_length())})


def _fake_step_bytes(fake: dict, batch_size: int) -> int:
    """A training step's peak bytes at ``batch_size`` from a :func:`_fake_analysis` result
    (:func:`~ddlscope.modeling.profile.step_peak_bytes`: parameters, buffers, gradients, optimizer state and
    the activation peak; the runtime not included)."""
    return step_peak_bytes(fake["param_bytes"], fake["buffer_bytes"], fake["optimizer_state_bytes"],
                           fake["activation_peak_bytes"][batch_size])


def _add_activation_peaks(fake: dict, batch_sizes, network: str, family: str, optimizer: OptimizerSetting) -> None:
    """Add to ``fake["activation_peak_bytes"]`` the batch sizes it lacks (:func:`_fake_analysis` over them)."""
    missing = sorted(set(batch_sizes) - set(fake["activation_peak_bytes"]))
    if missing:
        more = _fake_analysis(network, family, missing, optimizer)
        fake["activation_peak_bytes"].update(more["activation_peak_bytes"])


def _fresh_training(network: str, family: str, optimizer: OptimizerSetting, device, batch_size: int) -> tuple:
    """A freshly built model on ``device``, its optimizer and a random batch ``(x [b, C, H, W], y [b])``."""
    import torch

    from ddlscope.workloads.models import build_model, input_spec

    spec = input_spec(family)
    model = build_model(network, family).to(device)
    opt = _build_optimizer(optimizer, model.parameters())
    x = torch.randn(batch_size, spec.channels, spec.height, spec.width, device=device)
    y = torch.randint(0, spec.num_classes, (batch_size,), device=device)
    return model, opt, x, y


def _train_steps(network: str, family: str, optimizer: OptimizerSetting, device, batch_size: int,
                 steps: int = 2, before=None) -> None:
    """``steps`` training steps of a fresh model at ``batch_size`` on ``device`` (by default two: the
    second with the optimizer's state, as the profile's steps run); ``before()``, when given, is
    called once the model, the optimizer and the batch exist, before the first step. Everything is
    dropped on return."""
    from ddlscope.workloads.step import train_step

    model, opt, x, y = _fresh_training(network, family, optimizer, device, batch_size)
    if before is not None:
        before()
    for _ in range(steps):
        train_step(model, opt, x, y)


def _runs_at(network: str, family: str, optimizer: OptimizerSetting, device, batch_size: int) -> bool:
    """Whether :func:`_train_steps` at ``batch_size`` runs without ``torch.OutOfMemoryError``
    (``torch.cuda.OutOfMemoryError``); after one, the garbage is collected and the CUDA cache emptied."""
    import gc

    import torch

    try:
        _train_steps(network, family, optimizer, device, batch_size)
        return True
    except torch.OutOfMemoryError:
        pass  # the failed step's tensors are freed once the exception is gone, i.e. after this block
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return False


def largest_running_batch(network: str, family: str, optimizer: OptimizerSetting, device, start: int,
                          say=lambda msg: None) -> int | None:
    """The largest of ``start``, ``start // 2``, ... 1 at which two training steps run on ``device``
    without running out of memory (:func:`_runs_at`); None when not even batch 1 does."""
    b = start
    while b >= 1:
        if _runs_at(network, family, optimizer, device, b):
            return b
        say(f"batch {b} ran out of memory on {device}; trying {b // 2}")
        b //= 2
    return None


def _available_bytes(device, memory_limit_bytes: int | None) -> tuple[int, str]:
    """The memory a training step may use and what sets it: the smallest of ``memory_limit_bytes``
    and the device's memory (CUDA: the device's total; CPU: the host's total, psutil)."""
    if device.type == "cuda":
        import torch

        capacity, what = int(torch.cuda.get_device_properties(device).total_memory), f"{device} has"
    else:
        import psutil

        capacity, what = int(psutil.virtual_memory().total), "the host has"
    if memory_limit_bytes is not None and memory_limit_bytes <= capacity:
        return memory_limit_bytes, "the memory limit is"
    return capacity, what


def largest_fitting_batch(network: str, family: str, batch_size: int, optimizer: OptimizerSetting, fake: dict,
                          device, memory_limit_bytes: int | None = None, say=lambda msg: None) -> tuple[int, int]:
    """``(largest batch that fits, memory available bytes)``: the largest of ``batch_size``,
    ``batch_size // 2``, ... 1 whose training step fits the device.

    "Fits": the fake-tensor estimate of the step's peak (:func:`_fake_step_bytes`; peaks of the
    halvings ``fake`` lacks are added to it) is at most the memory available
    (:func:`_available_bytes`: ``memory_limit_bytes`` or the device's memory); on CUDA, two real
    steps at that batch then must run without ``torch.OutOfMemoryError`` (the real allocator is
    the final judge: it also needs the kernels' work buffers and the CUDA context), else the
    halvings below are tried (:func:`largest_running_batch`).

    Raises:
        UserError: not even batch 1 fits, in one line: what it needs and what the device has.
    """
    from ddlscope.errors import UserError

    available, what = _available_bytes(device, memory_limit_bytes)
    sizes = _halvings(batch_size)
    largest = lambda: max((b for b in sizes if b in fake["activation_peak_bytes"]  # noqa: E731
                           and _fake_step_bytes(fake, b) <= available), default=None)
    fits = largest()  # among the halvings ``fake`` has (the profile's batch sizes: the largest ones)
    if fits is None:  # the smaller ones, in one fake-tensor analysis (seconds per batch size for large models)
        _add_activation_peaks(fake, sizes, network, family, optimizer)
        fits = largest()
    advice = ("try a smaller network or input size, a device with more memory"
              + (", or a higher --memory-limit-gib" if what == "the memory limit is" else ""))
    if fits is None:
        raise UserError(f"{network}: not even batch 1 fits: a training step needs "
                        f"{gib_text(_fake_step_bytes(fake, 1))} (parameters, gradients, optimizer state and "
                        "activations; fake-tensor estimate), "
                        f"{what} {gib_text(available)}; {advice}")
    if device.type == "cuda":
        say(f"a real training step at batch {fits} on {device}")
        ran = largest_running_batch(network, family, optimizer, device, fits, say)
        if ran is None:
            raise UserError(f"{network}: not even batch 1 fits: a training step ran out of memory on {device} "
                            f"({gib_text(available)}; fake tensors estimate {gib_text(_fake_step_bytes(fake, 1))} "
                            f"without the CUDA context); {advice}")
        fits = ran
    return fits, available


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(a, b)`` of the least-squares line ``y = a + b x`` through the points ``(xs[i], ys[i])``.

    Used to extrapolate step and layer times to batch sizes that do not fit the device. A line,
    because once a batch keeps the device busy, every further sample adds the same work (the
    slope) to a step whose fixed costs (kernel launches, the optimizer's step over the
    parameters, the intercept) do not grow with the batch; least squares over all measured
    batch sizes rather than the last two, so that the timing noise of one size does not set the
    slope. It is an assumption beyond the measured range: where the smallest measured batches
    leave the device partly idle (times nearly flat), the fitted slope is below the full-load
    one and the extrapolated times err short; where larger batches use the device better, they
    err long. One point (or equal xs): the line through the origin and that point (time
    proportional to the batch).
    """
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        return 0.0, my / mx
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def _extrapolate(xs: list[float], ys: list[float], at: list[float]) -> list[float]:
    """Values of :func:`fit_line` through ``(xs, ys)`` at ``at`` (beyond ``max(xs)``), kept between
    the time at the largest measured batch (a larger batch does no less work) and that time scaled
    in proportion to the batch (no fixed cost at all).

    The lower bound matters on GPUs, where the smallest batches are launch-bound: ResNet-18 on
    CIFAR-10 took 12 ms per step at every batch from 8 to 64 on an H100, and the line through
    those times fell with the batch.
    """
    a, b = fit_line(xs, ys)
    x_top, y_top = max(zip(xs, ys))
    return [min(max(a + b * x, y_top), y_top * x / x_top) for x in at]


# ---------------------------------------------------------------- the profile


def profile_workload(network: str, dataset: str, batch_size: int, device: str = "cpu", threads: int = 1,
                     loader_workers: tuple[int, ...] = (0, 1), data_root=None, progress: bool = False,
                     cache_root=None, optimizer: OptimizerSetting | str = "sgd",
                     memory_limit_bytes: int | None = None) -> WorkloadProfile:
    """Measure ``network`` on ``dataset``'s input shape at ``batch_size`` on the local device.

    Measured (each part is documented at its helper):

    * batch sizes :func:`profile_batch_sizes` (``batch_size`` and halvings to ``batch_size // 8``)
      that fit the device. When ``batch_size`` does not fit (:func:`largest_fitting_batch`: the
      fake-tensor estimate against ``memory_limit_bytes`` or the device's memory; on CUDA also a
      real step without ``torch.OutOfMemoryError``), the largest halving ``L`` that does and its
      halvings (``profile_batch_sizes(L)``) are measured, and the larger batch sizes are not run:
      their step and layer times are extrapolated along least-squares lines through the measured
      ones (:func:`fit_line`; the steps are flagged ``extrapolated``, ``largest_fitting_batch_size``
      is ``L``), their activation peaks come from fake tensors as at every batch size;
    * per top-level layer and batch size: forward and backward seconds, timed separately on
      the activation the previous layers produce (minimum of :data:`LAYER_REPEATS` runs after a
      warm-up); parameter bytes; output, saved-for-backward bytes and forward FLOPs per sample
      from fake tensors (:func:`_fake_analysis`);
    * per batch size a whole training step as the training loop runs it
      (:func:`ddlscope.workloads.step.train_step`: cross-entropy, ``optimizer``,
      ``zero_grad(set_to_none=True)``): the median of the timed steps after a warm-up, as many
      as the device's :data:`STEP_TIMING` says (CPU: 5 after 1, each batch size in a fresh process
      of its own, as a worker trains: :class:`FreshStepTimer`; CUDA: at least 1 s of
      steps after 0.5 s, in this process);
      activation peak from fake tensors, and the same quantity measured with real tensors
      (``measured_activation_peak_bytes``, :class:`CpuMemoryProbe`, :func:`_measure_cuda_memory`);
    * the optimizer's state bytes after a step (:func:`_fake_analysis`);
    * data loading: samples/s with each number of ``loader_workers`` (:func:`_measure_data_loading`);
    * the device: float32 matmul TFLOP/s, copy bandwidth, capacity, runtime bytes, name.

    ``torch.set_num_threads(threads)`` holds during the measurement, and on CPU the process is
    pinned to its first ``threads`` cores as a worker is; both are restored afterwards.

    Args:
        network: a zoo network (``ddlscope.workloads.models.NETWORKS``).
        dataset: a dataset name (``ddlscope.workloads.datasets.DATASETS``); its family sets the
            input geometry (``input_spec``).
        batch_size: samples per step (>= 1). device: ``"cpu"`` or ``"cuda"``. threads: >= 1.
        loader_workers: DataLoader worker counts to time (empty: no data-loading measurement).
        data_root: where a local copy of the dataset is looked for (default: ``default_data_root()``).
        progress: print what is being measured to stderr.
        cache_root: where a synthetic dataset copy is written when there is no local copy
            (default: ``<results>/profiles/data``).
        optimizer: the optimizer the steps train with (a name: with the run config's default
            hyperparameters, :func:`optimizer_setting`); recorded in the profile.
        memory_limit_bytes: at most this many bytes for a training step's parameters, buffers,
            gradients, optimizer state and activations (None: the device's memory); recorded.

    Returns:
        the :class:`WorkloadProfile`.

    Raises:
        UserError: unknown network, dataset or optimizer, batch size or threads < 1, negative
            loader workers, a memory limit < 1 byte, CUDA asked for but absent, batch size larger
            than the local dataset copy; not even batch 1 fits the device, or it runs out of
            memory during the measurement (one line: needed and available memory).
    """
    import sys
    import time
    from pathlib import Path

    import torch

    from ddlscope.store.db import default_db_path
    from ddlscope.workloads.datasets import DATASETS
    from ddlscope.workloads.models import build_model, input_spec

    from ddlscope.errors import UserError

    loader_workers = tuple(loader_workers)
    _check_workload(network, dataset, batch_size, device, threads, loader_workers, memory_limit_bytes)
    optimizer = optimizer_setting(optimizer)
    start, created = time.perf_counter(), time.time()
    say = (lambda msg: print(f"profile: {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    family = DATASETS[dataset].family
    spec = input_spec(family)
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    cache_root = Path(cache_root) if cache_root is not None else default_db_path().parent / "profiles" / "data"
    old_threads, old_cores = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(threads)
    if dev.type == "cpu":  # like a worker: pinned to its cores, so the scheduler cannot move it mid-measurement
        os.sched_setaffinity(0, sorted(old_cores)[:threads])
    fitting = batch_size
    # on CPU the memory probe (a process of its own, timing nothing) starts up beside the fake-tensor analysis;
    # its steps wait for the batch sizes that fit
    probe = CpuMemoryProbe(network, family, threads, optimizer, spare_cores(old_cores, threads)) \
        if dev.type == "cpu" else None
    # so does the clean process the steps are timed in (each batch size in a child of its own)
    timer = FreshStepTimer(network, family, threads, optimizer, spare_cores(old_cores, threads)) \
        if dev.type == "cpu" else None
    try:
        say("fake-tensor analysis (bytes, FLOPs)" + (", memory probe beside it" if probe else ""))
        fake = _fake_analysis(network, family, profile_batch_sizes(batch_size), optimizer)
        fitting, available = largest_fitting_batch(network, family, batch_size, optimizer, fake, dev,
                                                   memory_limit_bytes, say)
        sizes = profile_batch_sizes(fitting)  # measured
        beyond = [b for b in profile_batch_sizes(batch_size) if b > fitting]  # extrapolated
        _add_activation_peaks(fake, sizes, network, family, optimizer)
        if beyond:
            say(f"batch {batch_size} does not fit; measuring batches {sizes[0]}..{fitting}, extrapolating "
                f"{', '.join(map(str, beyond))}")
        say("memory of a worker process and of real training steps")
        runtime_bytes, real_steps, growth, hivemind_bytes = probe.result(sizes) if probe else \
            (*_measure_cuda_memory(network, family, sizes, dev, optimizer), None, None)
        torch.manual_seed(0)
        model = build_model(network, family).to(dev)
        model.train()
        fwd: list[list[float]] = [[] for _ in fake["layers"]]
        bwd: list[list[float]] = [[] for _ in fake["layers"]]
        for b in sizes:
            say(f"layer times at batch {b}")
            x = torch.randn(b, spec.channels, spec.height, spec.width, device=dev)
            f_s, b_s = _time_layers(model, x)
            for i, (f, bk) in enumerate(zip(f_s, b_s)):
                fwd[i].append(f)
                bwd[i].append(bk)
        say(f"training steps at batches {', '.join(map(str, sizes))}"
            + (", each in a fresh process" if timer else ""))
        if timer:  # a CPU step's time depends on the heap the process had: each batch size as a worker runs it
            timed = timer.result(sizes, sorted(os.sched_getaffinity(0)))
        else:
            opt = _build_optimizer(optimizer, model.parameters())
            timed = {b: _time_steps(model, opt, torch.randn(b, spec.channels, spec.height, spec.width, device=dev),
                                    torch.randint(0, spec.num_classes, (b,), device=dev)) for b in sizes}
            del opt
        del model
        steps = []
        input_bytes = spec.channels * spec.height * spec.width * 4
        for b in sizes:
            f, bk, o, _ = timed[b]
            measured = retained = None
            if real_steps is not None and b in real_steps:
                # the probe's step bytes exclude the input batch (resident before) and include the gradients
                measured = max(0, real_steps[b] + b * (input_bytes + 8) - fake["param_bytes"])
                if growth is not None and b in growth:  # the growth less the optimizer's state and the live step
                    retained = max(0, growth[b] - fake["optimizer_state_bytes"] - real_steps[b])
            steps.append(StepProfile(batch_size=b, forward_s=f, backward_s=bk, optimizer_s=o, step_s=f + bk + o,
                                     activation_peak_bytes=fake["activation_peak_bytes"][b],
                                     measured_activation_peak_bytes=measured,
                                     retained_bytes=retained))
        loading = []
        if loader_workers:
            say(f"data loading with {', '.join(map(str, sorted(set(loader_workers))))} loader workers")
            loading = _measure_data_loading(dataset, batch_size, loader_workers, data_root, cache_root)
        say("device microbenchmarks")
        dev_profile = DeviceProfile(type=dev.type, name=device_name(device), threads=threads,
                                    peak_tflops=_peak_tflops(dev), memory_bandwidth_gb_per_s=_bandwidth_gb_per_s(dev),
                                    memory_bytes=_memory_capacity_bytes(dev, threads), runtime_bytes=runtime_bytes,
                                    hivemind_runtime_bytes=hivemind_bytes)
    except torch.OutOfMemoryError as exc:  # the search found the batch fitting, a later measurement did not
        raise UserError(f"{out_of_memory_message(exc, dev)} while profiling {network} at batches up to {fitting}; "
                        "try --memory-limit-gib below the device's memory, or a smaller --batch-size") from None
    finally:
        if probe is not None:
            probe.cancel()  # ended already, unless the profile failed before it was read
        if timer is not None:
            timer.cancel()
        torch.set_num_threads(old_threads)
        os.sched_setaffinity(0, old_cores)
    if beyond:
        xs = [float(b) for b in sizes]
        fwd = [f + _extrapolate(xs, f, beyond) for f in fwd]
        bwd = [bk + _extrapolate(xs, bk, beyond) for bk in bwd]
        parts = {k: _extrapolate(xs, [getattr(st, k) for st in steps], beyond)
                 for k in ("forward_s", "backward_s", "optimizer_s")}
        steps += [StepProfile(batch_size=b, forward_s=parts["forward_s"][i], backward_s=parts["backward_s"][i],
                              optimizer_s=parts["optimizer_s"][i],
                              step_s=parts["forward_s"][i] + parts["backward_s"][i] + parts["optimizer_s"][i],
                              activation_peak_bytes=fake["activation_peak_bytes"][b], extrapolated=True)
                  for i, b in enumerate(beyond)]
    layers = [LayerProfile(forward_s=fwd[i], backward_s=bwd[i], **info) for i, info in enumerate(fake["layers"])]
    return WorkloadProfile(
        network=network, dataset=dataset, input_shape=(spec.channels, spec.height, spec.width),
        num_classes=spec.num_classes, optimizer=optimizer.name, optimizer_setting=optimizer, device=dev_profile, torch_version=torch.__version__,
        batch_sizes=sizes + beyond, layers=layers, steps=steps, data_loading=loading, param_count=fake["param_count"],
        param_bytes=fake["param_bytes"], buffer_bytes=fake["buffer_bytes"],
        optimizer_state_bytes=fake["optimizer_state_bytes"], sample_bytes=input_bytes,
        profile_s=time.perf_counter() - start, created_at=created, memory_limit_bytes=memory_limit_bytes,
        memory_available_bytes=available if beyond else None, largest_fitting_batch_size=fitting if beyond else None,
    )


# =============================================================================================
# The profile cache
# =============================================================================================


def default_profile_dir():
    """``<results folder>/profiles``: next to the results database (``./ddlscope-results/profiles``)."""
    from ddlscope.store.db import default_db_path

    return default_db_path().parent / "profiles"


def profile_cache_key(network: str, dataset: str, batch_size: int, device: str = "cpu", threads: int = 1,
                      loader_workers: tuple[int, ...] = (0, 1), optimizer: OptimizerSetting | str = "sgd",
                      memory_limit_bytes: int | None = None) -> str:
    """File name stem of a cached profile: readable parts plus a hash of everything that matters.

    The hash covers network, dataset, batch size, device type and name (CPU model / GPU name),
    threads, the torch version, the loader worker counts, the optimizer with its
    hyperparameters (:func:`optimizer_setting`) and a memory limit (when one is given; the key of
    a profile without one is unchanged, ``_cap<bytes>`` is added to the readable part with one);
    so a profile measured on another machine type, torch version, optimizer or limit is never
    read back for this one.

    Raises:
        UserError: an unknown optimizer.
    """
    import hashlib
    import re

    import torch

    optimizer = optimizer_setting(optimizer)
    ident = [network, dataset, batch_size, device, device_name(device), threads, torch.__version__,
             sorted(set(loader_workers)), sorted(optimizer.model_dump().items())]
    cap = ""
    if memory_limit_bytes is not None:
        ident.append(("memory_limit_bytes", memory_limit_bytes))
        cap = f"_cap{memory_limit_bytes}"
    digest = hashlib.sha1(repr(ident).encode()).hexdigest()[:12]
    safe = lambda s: re.sub(r"[^A-Za-z0-9_.-]+", "_", str(s))  # noqa: E731
    return f"{safe(network)}_{safe(dataset)}_bs{batch_size}_{device}_t{threads}_{optimizer.name}{cap}_{digest}"


def load_or_profile(network: str, dataset: str, batch_size: int, device: str = "cpu", threads: int = 1,
                    loader_workers: tuple[int, ...] = (0, 1), data_root=None, cache_dir=None, refresh: bool = False,
                    progress: bool = False, optimizer: OptimizerSetting | str = "sgd",
                    memory_limit_bytes: int | None = None) -> WorkloadProfile:
    """The cached profile of this workload and device, measured (:func:`profile_workload`) if absent.

    The profile is JSON at ``<cache_dir>/<profile_cache_key(...)>.json`` (``cache_dir`` default:
    :func:`default_profile_dir`), written atomically (temporary file in the same folder, then
    rename), so a crash never leaves half a file. ``refresh`` measures again and replaces it; a
    file that cannot be read or validated is measured again too (and replaced). Synthetic dataset
    copies are written under ``<cache_dir>/data``. The path of the file is :func:`profile_path`.
    ``memory_limit_bytes`` is :func:`profile_workload`'s (part of the cache key).

    Raises:
        UserError: as :func:`profile_workload`.
    """
    import os
    import sys
    import tempfile
    from pathlib import Path

    from pydantic import ValidationError

    loader_workers = tuple(loader_workers)
    _check_workload(network, dataset, batch_size, device, threads, loader_workers, memory_limit_bytes)
    optimizer = optimizer_setting(optimizer)
    path = profile_path(network, dataset, batch_size, device, threads, loader_workers, cache_dir, optimizer,
                        memory_limit_bytes)
    if path.exists() and not refresh:
        try:
            return WorkloadProfile.model_validate_json(path.read_bytes())
        except (OSError, ValueError, ValidationError) as exc:
            if progress:
                print(f"profile: cached {path} unreadable ({type(exc).__name__}); measuring again", file=sys.stderr)
    cache = Path(path.parent)
    profile = profile_workload(network, dataset, batch_size, device, threads, loader_workers, data_root,
                               progress=progress, cache_root=cache / "data", optimizer=optimizer,
                               memory_limit_bytes=memory_limit_bytes)
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=cache)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(profile.model_dump_json(indent=1))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return profile


def profile_path(network: str, dataset: str, batch_size: int, device: str = "cpu", threads: int = 1,
                 loader_workers: tuple[int, ...] = (0, 1), cache_dir=None, optimizer: OptimizerSetting | str = "sgd",
                 memory_limit_bytes: int | None = None):
    """Where :func:`load_or_profile` keeps this workload's profile (a :class:`pathlib.Path`)."""
    from pathlib import Path

    folder = Path(cache_dir) if cache_dir is not None else default_profile_dir()
    key = profile_cache_key(network, dataset, batch_size, device, threads, loader_workers, optimizer,
                            memory_limit_bytes)
    return folder / f"{key}.json"
