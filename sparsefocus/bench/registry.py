"""Benchmark cases: what ``sparsefocus bench`` can time.

A case is a factory ``(argument: str, shape: BenchShape) -> Workload``. The command line names
cases as ``NAME`` or ``NAME:ARGUMENT``; a name that is not a registered case is read as a
pattern string and run through ``sparse_attention(..., impl="auto")``.

Built-in cases:
    sdpa:BACKEND    dense F.scaled_dot_product_attention under one backend: cudnn, flash,
                    efficient or math (``sdpa`` alone on the command line means all four)
    flex[:W]        FlexAttention (compiled on CUDA): the causal (or full) block mask, or with W
                    a sliding window of W keys per query
    naive:PATTERN   the pattern's dense PyTorch reference (impl="reference"), N x N memory
    lean:PATTERN    the pattern's memory-lean PyTorch path (impl="lean")
    indexed[:K]     the indexed-attention kernel on K random keys per query (default 32)
    zeta[:PARAMS]   ZETA on the first d_K channels of q, k, with a ``recall`` column (zeta_cases.py)
    PATTERN         any pattern string, e.g. TOPK:32, "BAND:256"

Adding a case (e.g. from another module, before calling ``sparsefocus.bench.run.main``)::

    from sparsefocus.bench.registry import Workload, register_case, attention_flops

    def my_case(argument: str, shape: BenchShape) -> Workload:
        keys = int(argument or 32)
        return Workload(
            forward=lambda q, k, v: my_attention(q, k, v, keys),
            flops=attention_flops(shape, keys),
            extra=lambda q, k, v: {"recall": my_recall(q, k, keys)},  # extra JSON columns
        )

    register_case("mine", my_case)   # then: sparsefocus bench mine:64 --n 4096

``extra`` is called once per (case, N) outside the timed region; its dict is stored in the
result row. Register at import time of a module that ``sparsefocus.bench.run`` imports
(as ``sparsefocus/bench/zeta_cases.py`` is).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor

from sparsefocus.attention import parse_pattern, sparse_attention

Forward = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class BenchShape:
    """Sizes of one measurement: q [batch, heads, n, head_dim], k/v [batch, kv_heads, n, head_dim]."""

    batch: int
    heads: int
    kv_heads: int
    n: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    device: torch.device

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Workload:
    """One timed computation: ``forward(q, k, v) -> out`` and its dense-equivalent useful work.

    flops: forward FLOPs; backward_flops defaults to 2.5 x forward (FlashAttention's convention).
    bytes: fewest bytes the forward must move (inputs read once, output written once);
    backward_bytes defaults to the forward's times 2.5 (q, k, v, out, dout read; dq, dk, dv written).
    extra: optional ``(q, k, v) -> dict`` of additional columns (e.g. recall), computed untimed.
    unavailable_on_error: an error other than out-of-memory means "this implementation does not
    run this shape here" (an SDPA backend refusing it), recorded as status "unavailable".
    """

    forward: Forward
    flops: float
    bytes: float = 0.0
    backward_flops: float | None = None
    backward_bytes: float | None = None
    extra: Callable[[Tensor, Tensor, Tensor], dict] | None = None
    notes: dict = field(default_factory=dict)
    unavailable_on_error: bool = False

    def total(self, mode: str) -> tuple[float, float]:
        """(FLOPs, bytes) of "fwd" or "fwd+bwd"."""
        if mode == "fwd":
            return self.flops, self.bytes
        back_flops = 2.5 * self.flops if self.backward_flops is None else self.backward_flops
        back_bytes = 2.5 * self.bytes if self.backward_bytes is None else self.backward_bytes
        return self.flops + back_flops, self.bytes + back_bytes


CaseFactory = Callable[[str, BenchShape], Workload]
CASES: dict[str, CaseFactory] = {}


def register_case(name: str, factory: CaseFactory) -> None:
    """Make ``factory`` available as bench case ``name`` (``name`` or ``name:argument`` on the CLI)."""
    key = name.lower()
    if key in CASES:
        raise ValueError(f"bench case {name!r} is registered twice")
    CASES[key] = factory


def mean_keys(shape: BenchShape, keys: float) -> float:
    """Average keys per query when each query may see ``keys`` keys (causal: capped by its position)."""
    keys = min(keys, shape.n)
    if not shape.causal:
        return keys
    full_rows = max(0, shape.n - keys)  # rows at positions >= keys see all `keys`
    head = min(keys, shape.n)
    return (full_rows * keys + head * (head + 1) / 2) / shape.n


def attention_flops(shape: BenchShape, keys_per_query: float) -> float:
    """Forward FLOPs of softmax attention over ``keys_per_query`` keys: 2 matmuls of 2 N K D."""
    return 4.0 * shape.batch * shape.heads * shape.n * mean_keys(shape, keys_per_query) * shape.head_dim


def io_bytes(shape: BenchShape, index_slots: int = 0) -> float:
    """Forward bytes: read q, k, v (and an int32 index of ``index_slots`` per query), write out."""
    q_or_out = shape.batch * shape.heads * shape.n * shape.head_dim * shape.element_size
    k_or_v = shape.batch * shape.kv_heads * shape.n * shape.head_dim * shape.element_size
    return 2 * q_or_out + 2 * k_or_v + 4.0 * shape.batch * shape.heads * shape.n * index_slots


def parse_case(spec: str, shape: BenchShape) -> Workload:
    """Build the workload of a CLI case string (a registered case or a pattern string)."""
    name, _, argument = spec.partition(":")
    factory = CASES.get(name.strip().lower())
    if factory is not None:
        return factory(argument.strip(), shape)
    return pattern_case(spec, shape)


def pattern_case(spec: str, shape: BenchShape, impl: str = "auto") -> Workload:
    """Any pattern through ``sparse_attention``; FLOPs from its keys per query (k + g) when it has k."""
    pattern = parse_pattern(spec)
    keys = getattr(pattern, "k", None)
    keys = shape.n if keys is None or impl == "reference" else keys + pattern.num_global_tokens
    flops = attention_flops(shape, keys)
    if pattern.input_dependent and impl != "reference":
        flops += 0.5 * attention_flops(shape, shape.n)  # the selection's q.k over every allowed key
    causal = shape.causal

    def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sparse_attention(q, k, v, pattern, causal=causal, impl=impl)

    return Workload(forward=forward, flops=flops, bytes=io_bytes(shape), notes={"impl": impl})


SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")


def sdpa_backend(name: str):
    """The ``SDPBackend`` of a bench backend name (cudnn, flash, efficient, math)."""
    from torch.nn.attention import SDPBackend

    members = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    if name not in members:
        raise ValueError(f"unknown SDPA backend {name!r}; valid: {', '.join(SDPA_BACKENDS)}")
    return members[name]


def _sdpa_case(argument: str, shape: BenchShape) -> Workload:
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    if not argument:
        raise ValueError(f"bench case 'sdpa' needs a backend, e.g. sdpa:cudnn ({', '.join(SDPA_BACKENDS)})")
    backend = sdpa_backend(argument.lower())
    gqa = shape.kv_heads != shape.heads

    def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa)

    return Workload(
        forward=forward,
        flops=attention_flops(shape, shape.n),
        bytes=io_bytes(shape),
        notes={"dense_backend": argument.lower()},
        unavailable_on_error=True,
    )


def _flex_case(argument: str, shape: BenchShape) -> Workload:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    window = int(argument) if argument else None
    causal = shape.causal

    def dense_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx if causal else kv_idx >= 0

    def sliding_window(b, h, q_idx, kv_idx):
        if causal:
            return (kv_idx <= q_idx) & (q_idx - kv_idx < window)
        return (kv_idx - q_idx <= window // 2) & (q_idx - kv_idx < window - window // 2)

    mask_mod = dense_mask if window is None else sliding_window
    device = str(shape.device)
    block_mask = create_block_mask(mask_mod, None, None, shape.n, shape.n, device=device)
    # Compiled on CUDA, as FlexAttention is meant to run; on CPU Inductor's C++ build would take minutes.
    # A fresh compile cache per case: a sweep over N and masks would otherwise reach Dynamo's
    # recompile limit, after which flex_attention silently runs unfused.
    if shape.device.type == "cuda":
        torch._dynamo.reset()
        attend = torch.compile(flex_attention, dynamic=False)
    else:
        attend = flex_attention
    gqa = shape.kv_heads != shape.heads

    def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attend(q, k, v, block_mask=block_mask, enable_gqa=gqa)

    keys = shape.n if window is None else window
    notes = {"mask": "causal" if causal else "full"} if window is None else {"window": window}
    # FlexAttention has no backward on CPU: there its fwd+bwd is "unavailable", not an error.
    unavailable = shape.device.type != "cuda"
    return Workload(
        forward=forward, flops=attention_flops(shape, keys), bytes=io_bytes(shape), notes=notes, unavailable_on_error=unavailable
    )


def _naive_case(argument: str, shape: BenchShape) -> Workload:
    if not argument:
        raise ValueError("bench case 'naive' needs a pattern, e.g. naive:TOPK:32")
    return pattern_case(argument, shape, impl="reference")


def _lean_case(argument: str, shape: BenchShape) -> Workload:
    if not argument:
        raise ValueError("bench case 'lean' needs a pattern, e.g. lean:TOPK:32")
    return pattern_case(argument, shape, impl="lean")


def random_indices(shape: BenchShape, keys: int, seed: int = 0) -> Tensor:
    """[B, H, N, keys] int32 random key positions (causal: uniform in 0..i), no -1 slots."""
    generator = torch.Generator(device=shape.device).manual_seed(seed)
    size = (shape.batch, shape.heads, shape.n, keys)
    uniform = torch.rand(size, generator=generator, device=shape.device)
    limit = torch.arange(1, shape.n + 1, device=shape.device)[:, None] if shape.causal else shape.n
    return (uniform * limit).long().clamp_max(shape.n - 1).to(torch.int32)


def _indexed_case(argument: str, shape: BenchShape) -> Workload:
    from sparsefocus.attention.common import indexed_attention_ref

    keys = int(argument or 32)
    index = random_indices(shape, keys)
    attend: Callable[..., Tensor] = indexed_attention_ref
    if shape.device.type == "cuda":
        from sparsefocus.kernels.indexed import indexed_attention

        attend = cast(Callable[..., Tensor], indexed_attention)  # without return_lse: out alone

    def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attend(q, k, v, index)

    flops = 4.0 * shape.batch * shape.heads * shape.n * keys * shape.head_dim
    return Workload(forward=forward, flops=flops, bytes=io_bytes(shape, keys), notes={"keys": keys})


register_case("sdpa", _sdpa_case)
register_case("flex", _flex_case)
register_case("naive", _naive_case)
register_case("lean", _lean_case)
register_case("indexed", _indexed_case)
