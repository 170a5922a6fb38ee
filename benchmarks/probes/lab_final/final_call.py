"""CUDA tests of the changed kernels, then ListOps throughput of the BAND/BLOC Figure-1a mechanisms."""
import json, os, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")

def main():
    out = Path(os.environ.get("OUT", "/tmp/out"))
    res = {}
    t0 = time.time()
    tests = ["tests/kernels/test_topk_select_short.py", "tests/kernels/test_indexed.py::test_slot_weights_match_reference_with_extra_slot_and_sink",
             "tests/kernels/test_indexed.py::test_slot_weights_fp16_within_twice_torch_error_lse_unchanged_and_checked",
             "tests/kernels/test_indexed.py::test_slot_weights_op_passes_opcheck", "tests/kernels/test_indexed.py::test_inverse_index_key_grads_match_reference"]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], capture_output=True, text=True, timeout=200)
    res["cuda_tests"] = {"rc": p.returncode, "tail": p.stdout[-1500:], "s": round(time.time() - t0, 1)}
    print(res["cuda_tests"]["tail"][-400:], flush=True)
    (out / "final_call.json").write_text(json.dumps(res, indent=1))
    import torch
    import torch.nn.functional as F
    from sparsefocus.kernels import indexed as ix
    from sparsefocus.kernels.topk_select import topk_select

    def timeit(fn, reps=30, warm=5):
        for _ in range(warm): fn()
        torch.cuda.synchronize(); ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
        ts.sort(); return round(ts[len(ts) // 2], 4)

    q, k, v = (torch.randn(250, 1, 600, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn(250, 1, 600, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        idx = topk_select(q, k, 5).long()
    sc = 64 ** -0.5

    def fb(f):
        def r():
            o = f(); o.backward(go); q.grad = k.grad = v.grad = None
        return r

    def masked():
        keep = torch.zeros(250, 1, 600, 600, dtype=torch.bool, device="cuda").scatter_(-1, idx, True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=0.01, scale=sc)

    def indexed_sw():
        w = F.dropout(torch.ones(idx.shape, device="cuda"), 0.01)
        return ix.indexed_attention(q, k, v, idx, scale=sc, slot_weight=w)

    probe = {"masked_sdpa_with_mask_build": timeit(fb(masked))}
    for mode in ("atomic", "inverse"):
        ix.KEY_GRADS = mode
        probe[f"indexed_slot_weights_{mode}"] = timeit(fb(indexed_sw))
    ix.KEY_GRADS = "atomic"
    res["listops_shape_fwd_bwd_ms"] = probe
    print(probe, flush=True)
    (out / "final_call.json").write_text(json.dumps(res, indent=1))
    import gpu_lab as g
    g.DEVICE, g.TOPK_SELECT = "cuda", "triton"
    res["device"], res["torch"] = torch.cuda.get_device_name(), torch.__version__
    work = Path("/tmp/lab_final"); work.mkdir(exist_ok=True)
    for mech in ["BAND:5", "BAND:5(1)", "BLOC:5", "BLOC:5(1)"]:
        t = time.time()
        r = next(iter(g.throughput(work, [("high", "bf16")], [], 20, "step-graph", (mech,)).values()))
        r["wall_s"] = round(time.time() - t, 1)
        res[mech] = r
        (out / "final_call.json").write_text(json.dumps(res, indent=1))
        print(mech, {k: r[k] for k in ("step_ms", "eval_s", "epoch_s", "study_min_200_epochs", "compile_s", "wall_s")}, flush=True)
    # two groups trained concurrently (train.concurrent_groups=2): seconds per epoch of the pair
    t = time.time()
    cmd = [sys.executable, "benchmarks/gpu_studies.py", "--study", "listops_fig1a", "--out", "/tmp/conc_out", "--work", "/tmp/conc",
           "--budget", "170", "--precision", "high", "--autocast", "bf16", "--mechanism", "FULL", "--mechanism", "BAND:5",
           "--concurrent", "2", "--no-compile-cache"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=260)
    seconds = {}
    for f in Path("/tmp/conc").rglob("metrics.jsonl"):
        lines = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        seconds[str(f.relative_to("/tmp/conc"))] = [l["seconds"] for l in lines]
    res["concurrent_FULL_BAND5"] = {"command": " ".join(cmd[1:]), "rc": p.returncode, "wall_s": round(time.time() - t, 1),
                                    "epoch_seconds_per_run": seconds, "tail": (p.stdout + p.stderr)[-800:]}
    (out / "final_call.json").write_text(json.dumps(res, indent=1))
    print("concurrent", {k: v[:8] for k, v in list(seconds.items())[:2]}, flush=True)

if __name__ == "__main__":
    main()
