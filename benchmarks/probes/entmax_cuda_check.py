"""CUDA check of the entmax row kernel against the sorted torch forms, and of the mechanisms through it."""
import torch
import sparsefocus as sf
from sparsefocus.attention import adaptive
from sparsefocus.attention.adaptive import _entmax15_forward, _sparsemax_forward
from sparsefocus.kernels.entmax_rows import entmax_rows

dev = "cuda"
torch.manual_seed(0)
worst = {}
for n in (7, 129, 600, 1000, 4096):
    for dt in (torch.float32, torch.bfloat16):
        x = (torch.randn(333, n, device=dev) * 3)
        x[::7, n // 2:] = float("-inf")
        x = x.to(dt)
        for alpha, twin in ((1.5, _entmax15_forward), (2.0, _sparsemax_forward)):
            got = entmax_rows(x, alpha).float()
            want = twin(x.float())
            err = (got - want).abs().max().item()
            worst[(n, str(dt), alpha)] = err
            assert torch.isfinite(got).all(), (n, dt, alpha)
print("entmax_rows max abs err vs sorted fp32:", max(worst.values()))
for k, v in worst.items():
    print(" ", k, f"{v:.2e}")
q, k, v = (torch.randn(3, 2, 601, 16, device=dev) * 2 for _ in range(3))
pad = torch.rand(3, 601, device=dev) > 0.2
pad[:, 0] = True
for spec in ("entmax", "sparsemax"):
    res = {}
    for choice in ("auto", "torch"):
        adaptive.ROW_KERNEL = choice
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = sf.sparse_attention(*leaves, spec, causal=True, key_padding_mask=pad, impl="lean")
        res[choice] = [out, *torch.autograd.grad((out * torch.cos(out)).sum(), leaves)]
    for name, a, b in zip(["out", "dq", "dk", "dv"], res["auto"], res["torch"]):
        rel = ((a - b).norm() / b.norm()).item()
        print(f"{spec} {name} rel err kernel vs torch: {rel:.2e}")
        assert rel < 1e-4, (spec, name, rel)
print("ENTMAX CUDA CHECK PASSED")
