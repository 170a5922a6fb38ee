"""Helpers shared by the NSA and DSA tests: outputs and every gradient of one call, and the
no-leak check (perturbing tokens after a cut changes nothing before it). The Triton path runs on
CUDA where there is one (in the interpreter otherwise); results come back on the CPU."""

import torch

import sparsefocus as sf
from sparsefocus.attention.patterns import AUX_KEY, HIDDEN_KEY


def run_with_grads(spec, impl, x, q, k, v, weights, padding=None, causal=True, grad_rows=None, aux_key=None, device=None):
    """[out, aux loss or 0, dq, dk, dv, d weight...] of ``sparse_attention``; the loss weighs the
    output by a fixed cosine (rows >= grad_rows left out) plus the auxiliary loss ``aux_key``.
    ``device``: where the call runs (default: ``impl_device(impl)``)."""
    device = impl_device(impl) if device is None else device
    leaves = [t.detach().to(device).requires_grad_() for t in (q, k, v)]
    params = {name: w.detach().to(device).requires_grad_() for name, w in weights.items()}
    call = {**params, HIDDEN_KEY: x.to(device), AUX_KEY: {}}
    padding = None if padding is None else padding.to(device)
    out = sf.sparse_attention(*leaves, spec, causal=causal, key_padding_mask=padding, impl=impl, params=call)
    weight = torch.cos(torch.arange(out.numel(), dtype=torch.float32)).reshape(out.shape).to(device)
    if grad_rows is not None:
        weight[:, :, grad_rows:] = 0
    aux = call[AUX_KEY].get(aux_key, out.new_zeros(())) if aux_key else out.new_zeros(())
    grads = torch.autograd.grad((out.float() * weight).sum() + aux, leaves + list(params.values()), allow_unused=True)
    return [t.detach().cpu() for t in [out, aux] + [torch.zeros(()) if g is None else g for g in grads]]


def impl_device(impl):
    """Where ``impl`` runs in a test: Triton on CUDA when there is a GPU, everything else on the CPU."""
    return torch.device("cuda" if impl == "triton" and torch.cuda.is_available() else "cpu")


def perturbed_after(cut, *tensors, dim=2):
    """Copies of the tensors with every position >= cut along ``dim`` replaced by large noise."""
    copies = []
    for t in tensors:
        t = t.clone()
        tail = t.narrow(dim, cut, t.shape[dim] - cut)
        tail.copy_(torch.randn_like(tail) * 5)
        copies.append(t)
    return copies
