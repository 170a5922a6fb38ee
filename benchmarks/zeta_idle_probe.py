"""Where the GPU waits inside one ZETA forward+backward: the profiler's kernel intervals of one
call (B=4, H=16, Dv=64, bf16, causal, the bench's pattern and protocol), the busy time (union of
kernel intervals), and the largest gaps with the kernels on either side. The window starts at the
call (a CUDA event recorded just before it, as the bench's timer does), so the time the GPU
waits for the first kernel counts as a gap. Each N is probed twice. The profiler itself adds
launch overhead, so the gaps are upper bounds of those of an unprofiled call.

Usage on a CUDA machine:  PYTHONPATH=. python benchmarks/zeta_idle_probe.py OUT_DIR [N ...]
Writes OUT_DIR/zeta_idle_probe.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.zeta_bench import zeta_inputs, zeta_step


def kernel_intervals(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel and memory op, sorted by start."""
    rows = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.time_range.elapsed_us() > 0:
            rows.append((event.time_range.start, event.time_range.end, event.name))
    return sorted(rows)


def probe(n: int) -> dict:
    q, k, v, gamma = zeta_inputs(4, 16, n)
    step = zeta_step(q, k, v, gamma)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    marker = torch.empty(1, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # no CPU op tracing: its overhead would widen the gaps
        marker.fill_(0.0)  # a tiny kernel just before the call: the window's start
        step()
        torch.cuda.synchronize()
    spans = kernel_intervals(prof)
    start, spans = spans[0][1], spans[1:]  # the marker's end
    end = max(e for _, e, _ in spans)
    busy, cursor, gaps = 0.0, start, []
    previous = "(call start)"
    for s, e, name in spans:
        if s > cursor:
            gaps.append({"us": s - cursor, "after": previous[:80], "before": name[:80], "at_us": cursor - start})
        busy += max(0.0, e - max(s, cursor))
        if e > cursor:
            cursor, previous = e, name
    gaps.sort(key=lambda g: -g["us"])
    return {
        "N": n, "window_ms": (end - start) / 1e3, "busy_ms": busy / 1e3, "idle_ms": (end - start - busy) / 1e3,
        "kernels": len(spans), "largest_gaps": gaps[:15],
        "timeline": [{"at_us": round(s - start, 1), "us": round(e - s, 1), "name": name[:70]} for s, e, name in spans],
    }


def main() -> None:
    out_dir = sys.argv[1]
    lengths = [int(x) for x in sys.argv[2:]] or [65536]
    rows = []
    for n in lengths:
        for _ in range(2):
            rows.append(probe(n))
            print(json.dumps({key: rows[-1][key] for key in ("N", "window_ms", "busy_ms", "idle_ms", "kernels")}), flush=True)
    payload = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("SPARSEFOCUS_COMMIT", "unknown"),
               "command": "PYTHONPATH=. python benchmarks/zeta_idle_probe.py " + " ".join(sys.argv[1:]), "rows": rows}
    path = os.path.join(out_dir, "zeta_idle_probe.json")
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
