"""Triton kernels, each a ``torch.library`` op beside its launcher and PyTorch reference."""
