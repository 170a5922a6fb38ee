"""What the profiler says about one bench step: CUDA kernel launches, attention's share, the
device's busy time and the heaviest kernels.

Kernels are the device activities the profiler ties to the CPU op that launched them
(``FunctionEvent.kernels``), less memory copies and fills. Attention's share of a model step is
the device time of attention's kernels over the device time of all kernels:

- eager: the ops inside the ``record_function(ATTENTION_RANGE)`` ranges the model bench puts
  around each ``sparse_attention`` call, plus their backward (the autograd engine runs a forward
  op's backward under ``autograd::engine::evaluate_function: ...`` with the op's sequence number);
- compiled: Dynamo drops ``record_function`` ranges, so attention is recognised by name: the
  SDPA ops, the ``sparsefocus::`` ops, and kernels named as SDPA's or the project's Triton
  kernels. Selection work that Inductor fuses into its own kernels is not counted.

The busy time is the sum of the step's kernel durations: a step whose wall-clock time is much
longer waits on the host (launch-bound Python, host syncs), not on the GPU. The heaviest kernels
are the step's kernels grouped by name, by total device time.

On CPU there are no kernels: launches and the busy time are None, the share is taken over self
CPU time, and the heaviest "kernels" are the CPU ops by self CPU time.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch.autograd.profiler_util import FunctionEvent

ATTENTION_RANGE = "sparsefocus.attention"
BACKWARD_PREFIX = "autograd::engine::evaluate_function:"
ATTENTION_OPS = re.compile(
    r"^(aten::_?scaled_dot_product|aten::_flash_attention|aten::_efficient_attention|aten::_cudnn_attention|sparsefocus::)"
)
SDPA_KERNELS = re.compile(r"flash|fmha|sdpa|cudnn.*attention|attention", re.IGNORECASE)
NOT_KERNELS = ("Memcpy", "Memset")


def profile_events(fn: Callable[[], None], device: torch.device) -> list[FunctionEvent]:
    """The profiler's events of one run of ``fn`` (CPU ops, with their kernels on CUDA)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    return list(prof.events())


def _kernels(event: FunctionEvent) -> list:
    return [kernel for kernel in event.kernels if not kernel.name.startswith(NOT_KERNELS)]


def count_kernels(events: list[FunctionEvent]) -> int:
    """Number of device kernels launched by the CPU ops in ``events``."""
    return sum(len(_kernels(event)) for event in events)


def kernel_launches(fn: Callable[[], None], device: torch.device) -> int | None:
    """CUDA kernels one run of ``fn`` launches; None on CPU (there is nothing to count)."""
    if device.type != "cuda":
        return None
    # Zero kernels means the profiler saw none (CUPTI unavailable), not a step that launched none.
    return count_kernels(profile_events(fn, device)) or None


def _subtree(roots: list[FunctionEvent]) -> list[FunctionEvent]:
    seen: dict[int, FunctionEvent] = {}
    stack = list(roots)
    while stack:
        event = stack.pop()
        if id(event) not in seen:
            seen[id(event)] = event
            stack.extend(event.cpu_children)
    return list(seen.values())


def attention_events(events: list[FunctionEvent]) -> list[FunctionEvent]:
    """The CPU ops of attention: inside ATTENTION_RANGE or named as attention, with their backward."""
    roots = [e for e in events if e.name == ATTENTION_RANGE or ATTENTION_OPS.match(e.name)]
    forward = _subtree(roots)
    sequence = {e.sequence_nr for e in forward if e.sequence_nr >= 0}
    backward = [e for e in events if e.name.startswith(BACKWARD_PREFIX) and e.sequence_nr in sequence]
    return _subtree(forward + backward)


def attention_share(events: list[FunctionEvent], device: torch.device) -> float | None:
    """Attention's share of the device time (CUDA) or self CPU time (CPU) of ``events``; None
    when nothing was timed."""
    marked = {id(e) for e in attention_events(events)}
    if device.type != "cuda":
        total = sum(e.self_cpu_time_total for e in events)
        part = sum(e.self_cpu_time_total for e in events if id(e) in marked)
        return part / total if total > 0 else None
    total = part = 0.0
    for event in events:
        for kernel in _kernels(event):
            total += kernel.duration
            if id(event) in marked or SDPA_KERNELS.search(kernel.name) or kernel.name in triton_kernel_names():
                part += kernel.duration
    return part / total if total > 0 else None


_TRITON_NAMES: set[str] = set()


def triton_kernel_names() -> set[str]:
    """Names of the ``@triton.jit`` kernels in ``sparsefocus.kernels`` (read once, when imported)."""
    if not _TRITON_NAMES:
        import importlib
        import pkgutil

        import sparsefocus.kernels as package

        for info in pkgutil.iter_modules(package.__path__):
            try:
                module = importlib.import_module(f"{package.__name__}.{info.name}")
            except ImportError:
                continue
            for value in vars(module).values():
                if type(value).__module__.startswith("triton."):  # JITFunction, Autotuner, interpreter twins
                    function = getattr(value, "fn", value)
                    _TRITON_NAMES.add(getattr(function, "__name__", ""))
        _TRITON_NAMES.discard("")
    return _TRITON_NAMES


def device_ms(events: list[FunctionEvent], device: torch.device) -> float | None:
    """Summed duration (ms) of the device kernels in ``events``; None on CPU or when the profiler
    saw no kernel."""
    if device.type != "cuda":
        return None
    total = sum(kernel.duration for event in events for kernel in _kernels(event))
    return total / 1e3 if total > 0 else None


def top_kernels(events: list[FunctionEvent], device: torch.device, count: int) -> list[dict]:
    """The ``count`` heaviest kernels (CUDA) or CPU ops by self time (CPU) of ``events``, grouped
    by name: [{"name", "ms", "calls"}] by total ms, largest first."""
    totals: dict[str, list[float]] = {}
    if device.type == "cuda":
        timed = [(kernel.name, kernel.duration) for event in events for kernel in _kernels(event)]
    else:
        timed = [(event.name, event.self_cpu_time_total) for event in events]
    for name, microseconds in timed:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += microseconds
        entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
    return [{"name": name, "ms": round(us / 1e3, 4), "calls": int(calls)} for name, (us, calls) in ranked]
