"""In-model A/B: ListOps, 10 folded seeds, bf16, TF32, step-graph; FULL, TOPK:5 now, TOPK:5 with the
previous short selection kernel and masked evaluation. One process, one run."""
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".ab")
import torch, torch.nn.functional as F
import gpu_lab as g
from sparsefocus.train import batched
from sparsefocus.kernels import topk_select as tsel
import topk_select_old as old

def main():
    global res
    out = Path(os.environ.get("OUT", "/tmp/out")); work = Path("/tmp/lab_ab"); work.mkdir(exist_ok=True)
    g.DEVICE, g.TOPK_SELECT = "cuda", "triton"
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    def save(): json.dump(res, open(out / "lab_topk_ab.json", "w"), indent=1)
    # correctness of the new pieces on the GPU first
    q = torch.randn(250, 1, 600, 64, device="cuda", dtype=torch.bfloat16); k = torch.randn_like(q); v = torch.randn_like(q)
    res["short_same_as_old"] = bool(torch.equal(tsel._launch_short(q, k, 5, False, None), old._launch_short(q, k, 5, False, None)))
    from sparsefocus.kernels.indexed import indexed_attention
    from sparsefocus.attention.common import indexed_attention_ref
    idx = tsel.topk_select(q, k, 5)
    w = F.dropout(torch.ones(idx.shape, device="cuda"), 0.1)
    qq, kk_, vv = (x[:20].float().requires_grad_() for x in (q, k, v))
    go = torch.randn(20, 1, 600, 64, device="cuda")
    outs = []
    for fn in (indexed_attention, indexed_attention_ref):
        o = fn(qq, kk_, vv, idx[:20], slot_weight=w[:20]); outs.append([o, *torch.autograd.grad(o, (qq, kk_, vv), go)])
    res["slot_weight_rel_err"] = [float((a - b).norm() / b.norm()) for a, b in zip(*outs)]
    print(res, flush=True); save()
    for name in ["FULL", "TOPK:5", "TOPK:5 before"]:
        mech = name.split()[0]
        if name.endswith("before"):
            tsel._launch_short = old._launch_short
            plain = batched.gathered_attention
            def masked_eval(q, k, v, index, scale, dropout_p):
                keep = torch.zeros(*index.shape[:-1], k.shape[-2], dtype=torch.bool, device=q.device).scatter_(-1, index, True)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, scale=scale)
            batched.gathered_attention = masked_eval
        t0 = time.time()
        r = g.throughput(work, [("high", "bf16")], [], 20, "step-graph", (mech,))
        r = next(iter(r.values())); r["wall_s"] = round(time.time() - t0, 1)
        res[name] = r; save()
        print(name, {k2: r[k2] for k2 in ("step_ms", "eval_s", "epoch_s", "study_min_200_epochs", "compile_s")}, flush=True)

if __name__ == '__main__':
    main()
