"""Many runs as one model: R models of one architecture folded into a module whose parameters
carry a leading run dimension and whose activations fold the runs into the batch.

``fold_models([m_0, ..., m_{R-1}])`` copies the structure of ``m_0`` and replaces every leaf that
holds parameters by its run-folded twin (``RunLinear``, ``RunTable``, ``RunLayerNorm``,
``RunAttention``, ``FoldedEmbedding``) and every dropout by ``RunDropout``. Parameter names stay
those of the single model, each tensor with a leading R: ``blocks.0.attn.q_proj.weight`` is
[R, out, in]. Inputs are [R*B, ...], run-major (rows r*B .. r*B+B-1 belong to run r), so the
model's own ``forward`` (embedding, blocks, pooling, classifier) runs unchanged, and attention
sees [R*B, H, N, D]: ``sparse_attention`` and SDPA take the folded batch directly, no vmap.

Two modes:

- exact: every parameterised op runs per run on that run's slice (the same op on the same shapes
  as the single model) and each run's dropout masks come from its own generator state, drawn in
  the single-run order; the attention is the model's own materialised computation. A folded
  exact model gives what the R models give.
- fast: one batched matmul per linear (``torch.bmm``; q, k and v in one), fused attention (SDPA for FULL and
  fixed patterns, gathered keys for TOPK/BOTK), dropout from the device's one generator
  (statistically the same masks, not the same draws).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sparsefocus.attention import selection_mask, sparse_attention
from sparsefocus.attention.common import expand_kv, masked_sdpa, run_bias_add_ref, run_layer_norm_ref
from sparsefocus.attention.full import Full
from sparsefocus.attention.patterns import AUX_KEY, RUNS_KEY, IndexedPattern, parse_pattern
from sparsefocus.attention.topk import BottomK, TopK
from sparsefocus.layers import SparseAttention
from sparsefocus.layers.attention import attention_params
from sparsefocus.models.blocks import (
    PAPER_FILL,
    Embedding,
    PaperAttention,
    sinusoidal_positions,
)
from sparsefocus.kernels._ops import kernel_chosen
from sparsefocus.train.config import FAST_ATTENTIONS

MODES = ("exact", "fast")
LAYER_NORM = "auto"
"""The fast mode's norms outside ``torch.compile``: "auto" (the Triton kernel ``kernels.run_norm``
on CUDA), "triton" (the kernel everywhere; the CPU through Triton's interpreter, for tests) or
"torch" (its twin ``run_layer_norm_ref``: ``F.layer_norm``, then each run's affine). Compiled
code always takes the twin, which Inductor fuses with the dropout and residual around it. On an
H100 the kernel took FULL's uncompiled ListOps step (10 folded seeds, bf16) from 29.0 to 19.8 ms
(``benchmarks/results/h100_lab_layernorm_d5e2ced.json``)."""
BIAS_ADD = "auto"
"""The fast mode's linear biases outside ``torch.compile``: "auto" (the Triton kernel
``kernels.run_bias`` on CUDA), "triton" (everywhere; the CPU through Triton's interpreter, for
tests) or "torch" (its twin ``run_bias_add_ref``, a broadcast add)."""


def default_generator(device: torch.device) -> torch.Generator:
    """The generator that ``F.dropout`` draws from on ``device``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


class RunRandomness:
    """Per-run states of the default generator of ``device``: ``call(r, fn, ...)`` runs ``fn`` as if
    run r were the only one in the process (its state in, its advanced state out).

    ``states``: one generator state per run (``torch.Generator.get_state()``).
    """

    def __init__(self, device: torch.device, states: list[Tensor]) -> None:
        self.device, self.states = device, list(states)

    def call(self, run: int, fn: Callable[..., Tensor], *args, **kwargs) -> Tensor:
        generator = default_generator(self.device)
        saved = generator.get_state()
        generator.set_state(self.states[run])
        try:
            return fn(*args, **kwargs)
        finally:
            self.states[run] = generator.get_state()
            generator.set_state(saved)


def _runs_of(x: Tensor, runs: int) -> tuple[Tensor, ...]:
    """The R run-major slices of a folded [R*B, ...] tensor."""
    if x.shape[0] % runs:
        raise ValueError(f"a folded batch of {x.shape[0]} rows is not a multiple of {runs} runs")
    return x.chunk(runs, dim=0)


def _stack(tensors: list[Tensor]) -> nn.Parameter:
    return nn.Parameter(torch.stack([t.detach() for t in tensors]))


class RunDropout(nn.Module):
    """Dropout of a folded batch: per-run masks from ``rng`` (exact) or one draw (``rng`` None).

    ``always``: stay active in eval mode (the Semantic Focus code's attention dropout).
    """

    def __init__(self, p: float, runs: int, rng: RunRandomness | None, *, always: bool = False) -> None:
        super().__init__()
        self.p, self.runs, self.rng, self.always = p, runs, rng, always

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0 or not (self.training or self.always):
            return x
        if self.rng is None:
            return F.dropout(x, self.p, training=True)
        parts = [self.rng.call(r, F.dropout, part, self.p, training=True) for r, part in enumerate(_runs_of(x, self.runs))]
        return torch.cat(parts)

    def extra_repr(self) -> str:
        return f"p={self.p}, runs={self.runs}, per_run_rng={self.rng is not None}, always={self.always}"


class RunLinear(nn.Module):
    """R linears: weight [R, out, in], bias [R, out]; x [R*B, ..., in] -> [R*B, ..., out]."""

    def __init__(self, linears: list[nn.Linear], exact: bool) -> None:
        super().__init__()
        self.exact = exact
        self.weight = _stack([m.weight for m in linears])
        if linears[0].bias is not None:
            self.bias = _stack([m.bias for m in linears])
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        runs = self.weight.shape[0]
        if self.exact:
            biases = self.bias if self.bias is not None else [None] * runs
            return torch.cat([F.linear(part, w, b) for part, w, b in zip(_runs_of(x, runs), self.weight, biases)])
        return run_matmul(x, self.weight, self.bias)


def run_matmul(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """R linears of a folded batch in one batched matmul: x [R*B, ..., in], weight [R, out, in],
    bias [R, out] or None -> [R*B, ..., out]. The bias is added after the matmul, not through
    ``baddbmm``, whose broadcast bias is first copied into the whole output; the separate add
    fuses into the next pointwise kernel under torch.compile."""
    runs = weight.shape[0]
    flat = x.reshape(runs, -1, x.shape[-1])  # [R, B*..., in]
    out = torch.bmm(flat, weight.transpose(1, 2))  # [R, B*..., out]
    if bias is not None:  # in autocast's dtype, as baddbmm under autocast
        out = _add_run_bias(out, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _add_run_bias(out: Tensor, bias: Tensor) -> Tensor:
    """out [R, M, O] + bias [R, O] per run: the Triton kernel where ``BIAS_ADD`` chooses it outside
    torch.compile (compiled code fuses the twin into the next pointwise kernel), else the twin."""
    if kernel_chosen(BIAS_ADD, out) and not torch.compiler.is_compiling():
        from sparsefocus.kernels import run_bias  # here: Triton is an optional dependency

        return run_bias.run_bias_add(out, bias)
    return run_bias_add_ref(out, bias)


class RunTable(nn.Module):
    """R embedding tables: weight [R, V, d]; ``lookup(idx [R*B, L])`` -> [R*B, L, d]."""

    def __init__(self, tables: list[nn.Embedding]) -> None:
        super().__init__()
        self.weight = _stack([t.weight for t in tables])

    def lookup(self, idx: Tensor) -> Tensor:
        runs, size, dim = self.weight.shape
        offset = torch.arange(runs, device=idx.device)[:, None] * size  # [R, 1]
        flat = idx.reshape(runs, -1) + offset  # [R, B*L]: row r reads table r
        return F.embedding(flat, self.weight.reshape(runs * size, dim)).reshape(*idx.shape, dim)

    def per_row(self, batch: int) -> Tensor:
        """Every table, repeated for the B rows of its run: [R*B, V, d] (prefix/suffix tokens)."""
        runs, size, dim = self.weight.shape
        return self.weight[:, None].expand(runs, batch, size, dim).reshape(runs * batch, size, dim)


class RunLayerNorm(nn.Module):
    """R affine LayerNorms: weight, bias [R, d] (a LayerNorm without affine needs no folding)."""

    def __init__(self, norms: list[nn.LayerNorm], exact: bool) -> None:
        super().__init__()
        self.exact, self.shape, self.eps = exact, norms[0].normalized_shape, norms[0].eps
        self.weight = _stack([n.weight for n in norms])
        self.bias = _stack([n.bias for n in norms])

    def forward(self, x: Tensor) -> Tensor:
        runs = self.weight.shape[0]
        if self.exact:
            parts = _runs_of(x, runs)
            return torch.cat([F.layer_norm(p, self.shape, w, b, self.eps) for p, w, b in zip(parts, self.weight, self.bias)])
        if kernel_chosen(LAYER_NORM, x) and not torch.compiler.is_compiling():  # compiled: Inductor fuses the twin
            from sparsefocus.kernels import run_norm  # here: Triton is an optional dependency

            if run_norm.fits(x.shape[-1]):
                return run_norm.run_layer_norm(_autocast_float(x), self.weight, self.bias, self.eps)
        return run_layer_norm_ref(x, self.weight, self.bias, self.eps)


def _autocast_float(x: Tensor) -> Tensor:
    """x in fp32 where autocast is on for its device (autocast runs LayerNorm in fp32; a custom op
    sees the tensor as it is), else unchanged."""
    return x.float() if torch.is_autocast_enabled(x.device.type) else x


class FoldedEmbedding(nn.Module):
    """``models.blocks.Embedding`` of R runs: idx [R*B, L] -> [R*B, P+L+S, dim], same steps
    (tokens, prefix tokens, suffix tokens, x sqrt(d) in paper_mode, positions, dropout)."""

    def __init__(self, embeddings: list[Embedding], exact: bool, rng: RunRandomness | None) -> None:
        super().__init__()
        first = embeddings[0]
        self.dim, self.num_prefix, self.kind, self.scale = first.dim, first.num_prefix, first.kind, first.scale
        self.tokens = RunTable([e.tokens for e in embeddings])
        # The runs share one config: each has a table wherever the first has one.
        self.prefix = RunTable([cast(nn.Embedding, e.prefix) for e in embeddings]) if first.prefix is not None else None
        suffix = getattr(first, "suffix", None)
        self.suffix = RunTable([cast(nn.Embedding, e.suffix) for e in embeddings]) if suffix is not None else None
        learned = first.learned_positions is not None
        self.learned_positions = RunTable([cast(nn.Embedding, e.learned_positions) for e in embeddings]) if learned else None
        self.dropout = RunDropout(first.dropout.p, len(embeddings), rng)

    def forward(self, idx: Tensor) -> Tensor:
        runs = self.tokens.weight.shape[0]
        x = self.tokens.lookup(idx)  # [R*B, L, dim]
        batch = idx.shape[0] // runs
        if self.prefix is not None:
            x = torch.cat([self.prefix.per_row(batch), x], dim=1)  # [R*B, P+L, dim]
        if self.suffix is not None:
            x = torch.cat([x, self.suffix.per_row(batch)], dim=1)  # [R*B, P+L+S, dim]
        x = x * self.scale
        length = x.shape[1]
        if self.learned_positions is not None:
            positions = self.learned_positions.weight[:, None, :length]  # [R, 1, P+L+S, dim]
            x = (x.view(runs, batch, length, self.dim) + positions).view(runs * batch, length, self.dim)
        else:
            x = x + sinusoidal_positions(length, self.dim, x.device)
        return self.dropout(x)


class RunAttention(nn.Module):
    """``SparseAttention`` / ``PaperAttention`` of R runs on a folded batch x [R*B, N, dim].

    The projections are ``RunLinear``s; q, k, v are [R*B, H, N, D]. ``PaperAttention``'s core
    (dense scores, -1e15 fill, softmax, dropout active in eval) runs per run in exact mode; fast
    mode uses ``fused_paper_attention``. ``SparseAttention`` calls ``sparse_attention`` on the
    folded batch in both modes.
    """

    q_proj: RunLinear
    k_proj: RunLinear
    v_proj: RunLinear
    out_proj: RunLinear

    def __init__(self, modules: list[SparseAttention], exact: bool, rng: RunRandomness | None, topk_select: str) -> None:
        super().__init__()
        first = modules[0]
        self.paper = isinstance(first, PaperAttention)
        if len(first.mechanism) and self.paper:
            raise ValueError(f"train.batched cannot fold {first.pattern.label()} in paper_mode: its trainable parameters")
        self.pattern, self.heads, self.kv_heads = first.pattern, first.heads, first.kv_heads
        self.causal, self.impl, self.head_dim, self.qk_dim = first.causal, first.impl, first.head_dim, first.qk_dim
        self.exact, self.runs, self.rng, self.topk_select = exact, len(modules), rng, topk_select
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self, name, RunLinear([getattr(m, name) for m in modules], exact))
        p = first.attention_dropout if isinstance(first, PaperAttention) else first.dropout.p
        self.dropout = RunDropout(p, self.runs, rng, always=self.paper)
        # the mechanism's own parameters (ZETA's widths, NSA's gates, DSA's indexer): [R, ...] each
        self.mechanism = nn.ParameterDict({name: _stack([m.mechanism[name] for m in modules]) for name in first.mechanism})
        self.aux_loss: Tensor = torch.zeros(())

    # Borrowed: they read only the pattern, mechanism and head sizes, which RunAttention has too.
    mechanism_params = SparseAttention.mechanism_params
    split_heads = SparseAttention.split_heads

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [R*B, N, dim] -> q [R*B, H, N, Dqk], k [R*B, Hk, N, Dqk], v [R*B, Hk, N, Dh]. Exact mode
        runs the three projections as the single model does; fast mode runs them as one batched
        matmul over the concatenated weights (the input is read once, one launch instead of three)."""
        if self.exact:
            return SparseAttention.project(self, x)  # type: ignore[arg-type]  # reads only the projections and sizes
        parts = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in parts], dim=1)  # [R, Hq*Dqk + Hk*Dqk + Hk*Dh, dim]
        biases = [p.bias for p in parts]
        bias = None if any(b is None for b in biases) else torch.cat(cast(list[Tensor], biases), dim=1)
        qkv = run_matmul(x, weight, bias)  # [R*B, N, Hq*Dqk + Hk*Dqk + Hk*Dh]
        q, k, v = qkv.split([p.weight.shape[1] for p in parts], dim=-1)
        return self.split_heads(q, k, v)  # type: ignore[misc]  # a borrowed method (see above)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        q, k, v = self.project(x)  # [R*B, H, N, D]
        if len(self.mechanism) and not self.exact and self.pattern.folds_params:
            out = self.folded_core(x, q, k, v, key_padding_mask)
        elif len(self.mechanism):
            out = self.per_run_core(x, q, k, v, key_padding_mask)
        elif not self.paper:
            out = sparse_attention(q, k, v, self.pattern, causal=self.causal, key_padding_mask=key_padding_mask, impl=self.impl)
        elif self.exact:
            masks = _runs_of(key_padding_mask, self.runs) if key_padding_mask is not None else [None] * self.runs
            parts = zip(_runs_of(q, self.runs), _runs_of(k, self.runs), _runs_of(v, self.runs), masks)
            out = torch.cat([self.paper_core(r, *part) for r, part in enumerate(parts)])
        else:
            out = self.fused_core(q, k, v, key_padding_mask)
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], self.heads * self.head_dim)  # [R*B, N, H*Dh]
        out = self.out_proj(out)
        return out if self.paper else self.dropout(out)

    def folded_core(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        """A mechanism with its own parameters that ``folds_params``: one ``sparse_attention`` call
        on the folded batch, each parameter [R, ...] as it is where the pattern takes ``run_params``
        (one product per run, not per row), else repeated to the rows of its run [R*B, ...],
        and each auxiliary loss the sum of the runs' (params[RUNS_KEY]). One call instead of R:
        R times fewer launches, and a graph that does not grow with the runs."""
        batch = x.shape[0] // self.runs
        values = {name: value if self.pattern.run_params else _per_row(value, batch) for name, value in self.mechanism.items()}
        params = self._params(values, x)
        params[RUNS_KEY] = self.runs
        out = sparse_attention(
            q, k, v, self.pattern, causal=self.causal, key_padding_mask=key_padding_mask, impl=self.impl, params=params
        )
        self.aux_loss = sum(params.get(AUX_KEY, {}).values(), x.new_zeros((), dtype=torch.float32))
        return out

    def _params(self, values: dict[str, Tensor], x: Tensor) -> dict:
        """``sparse_attention``'s params; in evaluation without the auxiliary losses' dict, so that
        the mechanism skips them (DSA's KL): the trainer reads them only to train."""
        params = attention_params(self.pattern, values, x) or {}
        if not self.training:
            params.pop(AUX_KEY, None)
        return params

    def per_run_core(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        """A mechanism with its own parameters in exact mode (or one that does not fold them): one
        ``sparse_attention`` call per run with that run's parameters (and hidden states, for
        mechanisms that read them), as each single model calls it; the runs' auxiliary losses are
        summed into ``aux_loss`` (the folded loss sums the runs' losses)."""
        masks = _runs_of(key_padding_mask, self.runs) if key_padding_mask is not None else [None] * self.runs
        parts = zip(_runs_of(x, self.runs), _runs_of(q, self.runs), _runs_of(k, self.runs), _runs_of(v, self.runs), masks)
        outs, aux = [], []
        for run, (x_r, q_r, k_r, v_r, mask_r) in enumerate(parts):
            values = {name: value[run] for name, value in self.mechanism.items()}
            params = self._params(values, x_r)
            out = sparse_attention(
                q_r, k_r, v_r, self.pattern, causal=self.causal, key_padding_mask=mask_r, impl=self.impl, params=params
            )
            outs.append(out)
            aux.extend(params.get(AUX_KEY, {}).values())
        self.aux_loss = sum(aux, x.new_zeros((), dtype=torch.float32))
        return torch.cat(outs)

    def paper_core(self, run: int, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        """``PaperAttention``'s computation for one run's slice, its dropout from that run's state."""
        keep = selection_mask(self.pattern, q, k, causal=self.causal, key_padding_mask=key_padding_mask)
        k, v = expand_kv(k, self.heads), expand_kv(v, self.heads)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.qk_dim)  # [B, H, N, N]
        weights = scores.masked_fill(~keep, PAPER_FILL).softmax(dim=-1)
        if self.dropout.p > 0:
            assert self.rng is not None, "exact mode with dropout has the runs' generator states (fold_models checks)"
            weights = self.rng.call(run, F.dropout, weights, self.dropout.p, training=True)
        return torch.matmul(weights, v)  # [B, H, N, Dh]

    def fused_core(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        """The paper's attention without the N x N weights where the pattern allows (see
        ``fused_paper_attention``); dropout stays active in eval, as in the paper's code."""
        k, v = expand_kv(k, self.heads), expand_kv(v, self.heads)
        plain = key_padding_mask is None and not self.causal  # the only case the key lists serve
        fixed, fixed_index = None, fixed_key_lists(self.pattern, q, k, self.causal) if plain else None
        if fixed_index is None and not self.pattern.input_dependent and not isinstance(self.pattern, Full):
            # [1, 1, N, M]: the same for every row; rebuilt per call (cheap, and no state under torch.compile)
            fixed = selection_mask(self.pattern, q[:1, :1], k[:1, :1], causal=self.causal)
        return fused_paper_attention(
            q,
            k,
            v,
            self.pattern,
            fixed_mask=fixed,
            key_padding_mask=key_padding_mask,
            causal=self.causal,
            dropout_p=self.dropout.p,
            topk_select=self.topk_select,
            fixed_index=fixed_index,
        )


def _per_row(value: Tensor, batch: int) -> Tensor:
    """A folded parameter [R, ...] as one copy per batch row [R*B, ...] (a view's gradient sums back)."""
    return value[:, None].expand(value.shape[0], batch, *value.shape[1:]).reshape(-1, *value.shape[1:])


FIXED_LIST_MAX_SLOTS = 0
"""Fast mode attends input-agnostic patterns (BAND:k(g), BLOC:k(g), ...) over their key lists
(``gathered_attention``; the g global query rows over every key, through SDPA) when a list has
at most this many slots; otherwise, and at the default 0, through SDPA with the pattern's
[N, M] mask. Not the default until measured."""


LIST_SLOTS = 64
"""``fast_attention("lists")``: the longest key lists of an input-agnostic pattern it attends over."""


@contextlib.contextmanager
def fast_attention(choice: str) -> Iterator[None]:
    """``train.fast_attention`` while training: "masks" leaves the settings as they are; "lists"
    sets ``MASKED_SELECTION_MAX_KEYS`` to 0 (TOPK trains over its chosen keys) and
    ``FIXED_LIST_MAX_SLOTS`` to ``LIST_SLOTS``; "fixed-lists" sets only the latter (BAND and BLOC
    over their key lists, TOPK through the mask of its chosen keys); both are restored afterwards.
    ValueError for another choice."""
    if choice not in FAST_ATTENTIONS:
        raise ValueError(f"train.fast_attention must be one of {', '.join(map(repr, FAST_ATTENTIONS))}, got {choice!r}")
    if choice == "masks":
        yield
        return
    global MASKED_SELECTION_MAX_KEYS, FIXED_LIST_MAX_SLOTS
    saved = MASKED_SELECTION_MAX_KEYS, FIXED_LIST_MAX_SLOTS
    if choice == "lists":
        MASKED_SELECTION_MAX_KEYS = 0
    FIXED_LIST_MAX_SLOTS = LIST_SLOTS
    try:
        yield
    finally:
        MASKED_SELECTION_MAX_KEYS, FIXED_LIST_MAX_SLOTS = saved


def fixed_key_lists(pattern, q: Tensor, k: Tensor, causal: bool) -> Tensor | None:
    """[1, 1, N, K] long key lists of an input-agnostic pattern, -1 for unused slots (the global
    query rows' lists are not used), if it has at most ``FIXED_LIST_MAX_SLOTS`` slots; else None."""
    if FIXED_LIST_MAX_SLOTS <= 0 or not isinstance(pattern, IndexedPattern) or pattern.input_dependent:
        return None
    index = pattern_key_lists(str(pattern), q.shape[-2], k.shape[-2], causal, q)  # [1, 1, N, K]
    return index if index.shape[-1] <= FIXED_LIST_MAX_SLOTS else None


def _key_lists(pattern, n_queries: int, n_keys: int, causal: bool, device: torch.device) -> Tensor:
    """[1, 1, N, K] long key lists of ``pattern`` for N queries and M keys on ``device``."""
    like = torch.empty(1, 1, n_queries, 1, device=device), torch.empty(1, 1, n_keys, 1, device=device)
    return pattern.indices(*like, causal, None, None).long().contiguous()  # [1, 1, N, K]


@torch.library.custom_op("sparsefocus::pattern_key_lists", mutates_args=())
def pattern_key_lists(spec: str, n_queries: int, n_keys: int, causal: bool, like: Tensor) -> Tensor:
    """[1, 1, N, K] long key lists of the input-agnostic pattern ``spec`` on ``like``'s device.

    An op, so that torch.compile takes the lists as one opaque call. Built in the graph, the lists
    of BAND:5(1) with its global token last made torch 2.11's Inductor fail on CUDA while merging
    loops ("argument '-2 + ((0))' is not comparable", most likely on BAND's clamped window starts);
    with this op the same ListOps training step compiles and trains there. A few small kernels and
    no host sync, so it stays inside a captured step."""
    return _key_lists(parse_pattern(spec), n_queries, n_keys, causal, like.device)


@pattern_key_lists.register_fake
def _pattern_key_lists_fake(spec: str, n_queries: int, n_keys: int, causal: bool, like: Tensor) -> Tensor:
    slots = _key_lists(parse_pattern(spec), n_queries, n_keys, causal, torch.device("meta")).shape[-1]
    return like.new_empty((1, 1, n_queries, slots), dtype=torch.long)


def global_rows(pattern, n_queries: int) -> slice:
    """The query rows of ``pattern``'s global tokens, which attend to every key: the first g, or
    the last g when the pattern puts them at the end (the Semantic Focus layout)."""
    count = min(pattern.num_global_tokens, n_queries)
    return slice(n_queries - count, n_queries) if getattr(pattern, "globals_last", False) else slice(0, count)


def listed_attention(q: Tensor, k: Tensor, v: Tensor, pattern, index: Tensor, scale: float, dropout_p: float) -> Tensor:
    """An input-agnostic pattern's attention, non-causal: each query over its ``index`` [1, 1, N, K]
    key list, the global rows over every key (SDPA, their dropout drawn there)."""
    out = gathered_attention(q, k, v, index.expand(*q.shape[:2], *index.shape[2:]), scale, dropout_p)
    rows = global_rows(pattern, q.shape[2])
    if rows.start == rows.stop:
        return out
    head = F.scaled_dot_product_attention(q[:, :, rows], k, v, dropout_p=dropout_p, scale=scale)
    pieces = [out[:, :, : rows.start], head.to(out.dtype), out[:, :, rows.stop :]]
    return torch.cat([piece for piece in pieces if piece.shape[2]], dim=2)  # no empty pieces: static shapes


MASKED_SELECTION_MAX_KEYS = 4096
"""Longest key rows for which fast-mode TOPK attends through a boolean [B, H, N, M] mask."""


def _select(q: Tensor, k: Tensor, pattern: TopK | BottomK, topk_select: str) -> Tensor:
    """[B, H, N, K] long key positions of each query's k largest (smallest) scores, no gradient;
    scores in fp32 (outside autocast) so that the choice does not follow bf16 rounding."""
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        if topk_select == "triton" and q.is_cuda and isinstance(pattern, TopK):
            from sparsefocus.kernels.topk_select import topk_select as kernel

            # bf16/fp16 q and k go in as they are: their products are exact in fp32 and the kernel
            # sums them in fp32, so the scores are those of the fp32 copies up to summation order,
            # on tensor cores.
            return kernel(q, k, pattern.k).long()
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2))  # [B, H, N, M]
        return scores.topk(pattern.k, dim=-1, largest=isinstance(pattern, TopK)).indices


GATHER_IMPL = "auto"
"""How ``gathered_attention`` computes: "triton" (the indexed kernel, ``indexed_attention``),
"torch" (gathered [B, H, N, K, D] keys and values), or "auto" (the kernel on CUDA, else torch)."""


def gathered_attention(q: Tensor, k: Tensor, v: Tensor, index: Tensor, scale: float, dropout_p: float) -> Tensor:
    """Softmax attention over the listed keys only: q [B, H, N, D], k, v [B, H, M, D], index
    [B, H, N, K] long (-1: an unused slot; a row without keys gives 0) -> [B, H, N, D]. Dropout
    on the K weights: one ``F.dropout`` of ones [B, H, N, K] multiplies the normalised weights
    (what ``F.dropout`` of the weights draws, and the same draw for both implementations)."""
    keep = F.dropout(q.new_ones(index.shape, dtype=torch.float32), dropout_p, training=True) if dropout_p > 0 else None
    if GATHER_IMPL == "triton" or (GATHER_IMPL == "auto" and q.is_cuda):
        from sparsefocus.kernels.indexed import indexed_attention

        return cast(Tensor, indexed_attention(q, k, v, index, scale=scale, slot_weight=keep))
    batch, heads, n_queries, dim = q.shape
    rows = torch.arange(batch * heads, device=q.device)[:, None, None]  # [B*H, 1, 1]
    flat_index = index.reshape(batch * heads, n_queries, index.shape[-1])  # [B*H, N, K]
    listed = flat_index >= 0
    flat_index = flat_index.clamp_min(0)
    keys = k.reshape(batch * heads, k.shape[2], dim)[rows, flat_index]  # [B*H, N, K, D]
    values = v.reshape(batch * heads, v.shape[2], v.shape[-1])[rows, flat_index]  # [B*H, N, K, Dv]
    scores = torch.einsum("rnd,rnkd->rnk", q.reshape(batch * heads, n_queries, dim), keys) * scale
    # the lowest finite value and a product, not -inf: a row without keys gets weights 0 and
    # finite gradients
    weights = scores.masked_fill(~listed, torch.finfo(scores.dtype).min).softmax(dim=-1) * listed  # [B*H, N, K]
    if keep is not None:
        weights = (weights.float() * keep.reshape(weights.shape)).to(weights.dtype)
    out = torch.einsum("rnk,rnkd->rnd", weights, values)  # [B*H, N, Dv]
    return out.reshape(batch, heads, n_queries, v.shape[-1])


def fused_paper_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern,
    *,
    fixed_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    causal: bool,
    dropout_p: float,
    topk_select: str = "torch",
    fixed_index: Tensor | None = None,
) -> Tensor:
    """The Semantic Focus attention (softmax over the kept keys, dropout on the weights) computed
    without materialising N x N weights where possible.

    q, k, v: [B, H, N, D] (k, v already expanded to H heads). FULL -> SDPA; an input-agnostic
    pattern -> attention over its ``fixed_index`` [1, 1, N, K] key lists if given
    (``listed_attention``), else SDPA with its ``fixed_mask`` [1, 1, N, M]; TOPK/BOTK without padding mask or
    causality -> while gradients are recorded, SDPA with the chosen keys as a boolean mask (rows
    of at most ``MASKED_SELECTION_MAX_KEYS`` keys: fused kernels, and no atomic scatter of the keys'
    gradients, which serialises on keys that many queries choose), otherwise (evaluation, longer
    rows) the scores of the k chosen keys only (``gathered_attention``, O(N k) memory); anything
    else -> the dense masked softmax. Returns [B, H, N, D]. The dropout masks are drawn from the
    default generator (not the single model's draws).
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    plain = key_padding_mask is None and not causal
    if plain and isinstance(pattern, Full):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
    if plain and fixed_index is not None:
        return listed_attention(q, k, v, pattern, fixed_index, scale, dropout_p)
    if plain and fixed_mask is not None:
        return masked_sdpa(q, k, v, fixed_mask, dropout_p=dropout_p, scale=scale)
    if plain and isinstance(pattern, (TopK, BottomK)):
        index = _select(q, k, pattern, topk_select)  # [B, H, N, K]
        if k.shape[-2] > MASKED_SELECTION_MAX_KEYS or not torch.is_grad_enabled():
            return gathered_attention(q, k, v, index, scale, dropout_p)
        keep = torch.zeros(*index.shape[:-1], k.shape[-2], dtype=torch.bool, device=q.device).scatter_(-1, index, True)
        return masked_sdpa(q, k, v, keep, dropout_p=dropout_p, scale=scale)
    keep = selection_mask(pattern, q, k, causal=causal, key_padding_mask=key_padding_mask)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, N, M]
    weights = F.dropout(scores.masked_fill(~keep, PAPER_FILL).softmax(dim=-1), dropout_p, training=True)
    return torch.matmul(weights, v)


def _fold_leaf(module: nn.Module, parts: list[nn.Module], exact: bool, rng: RunRandomness | None, topk_select: str):
    """The run-folded twin of one module, or None when its children are folded instead."""
    # parts are the runs' copies of module (one config), so they have its type.
    if isinstance(module, SparseAttention):
        return RunAttention(cast(list[SparseAttention], parts), exact, rng, topk_select)
    if isinstance(module, Embedding):
        return FoldedEmbedding(cast(list[Embedding], parts), exact, rng)
    if isinstance(module, nn.Linear):
        return RunLinear(cast(list[nn.Linear], parts), exact)
    if isinstance(module, nn.LayerNorm) and module.elementwise_affine:
        return RunLayerNorm(cast(list[nn.LayerNorm], parts), exact)
    if isinstance(module, nn.Dropout):
        return RunDropout(module.p, len(parts), rng)
    return None


def _fold_children(target: nn.Module, sources: list[nn.Module], exact: bool, rng, topk_select: str) -> None:
    for name, child in list(target.named_children()):
        parts = [getattr(source, name) for source in sources]
        folded = _fold_leaf(child, parts, exact, rng, topk_select)
        if folded is not None:
            setattr(target, name, folded)  # same slot: parameter order and names stay the model's
        else:
            _fold_children(child, parts, exact, rng, topk_select)
    own = [name for name, _ in target.named_parameters(recurse=False)] + [name for name, _ in target.named_buffers(recurse=False)]
    if own and not isinstance(target, (RunLinear, RunTable, RunLayerNorm)):
        raise ValueError(f"train.batched cannot fold {type(target).__name__} (it holds {', '.join(own)})")


def fold_models(
    models: list[nn.Module], *, mode: str = "exact", rng: RunRandomness | None = None, topk_select: str = "torch"
) -> nn.Module:
    """One module computing R models of one architecture on a folded batch [R*B, ...].

    Args:
        models: R >= 1 models built from the same config (only their parameter values differ).
        mode: "exact" or "fast" (see the module docstring). Default: "exact".
        rng: per-run dropout states (exact mode); None draws from the default generator.
        topk_select: "torch" or "triton" (fast mode's TOPK selection). Default: "torch".
    Returns:
        The folded module; ``state_dict()`` has the single model's keys, each tensor [R, ...].
    Raises:
        ValueError: a module the folding does not know holds parameters, or the models differ.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "exact" and rng is None and any(isinstance(m, nn.Dropout) and m.p > 0 for m in models[0].modules()):
        raise ValueError("exact mode needs the runs' generator states (rng) when the model has dropout")
    shapes = [[(n, tuple(p.shape)) for n, p in m.named_parameters()] for m in models]
    if any(s != shapes[0] for s in shapes):
        raise ValueError("fold_models: the models differ in their parameters (names or shapes)")
    folded = copy.deepcopy(models[0])
    _fold_children(folded, models, mode == "exact", rng, topk_select)
    names = [n for n, _ in folded.named_parameters()]
    if names != [n for n, _ in shapes[0]]:
        raise ValueError("fold_models: folding changed the parameter order; a module is not folded in place")
    return folded


def run_state(folded: nn.Module, run: int) -> dict[str, Tensor]:
    """Run ``run``'s ``state_dict``, as its single model would have it."""
    return {name: value[run].detach().clone() for name, value in folded.state_dict().items()}


def load_run_states(folded: nn.Module, states: list[dict[str, Tensor]]) -> None:
    """Copy R single-model state dicts into the folded parameters."""
    for name, tensor in folded.state_dict().items():
        tensor.copy_(torch.stack([state[name] for state in states]))


def run_optimizer_state(state: dict, run: int) -> dict:
    """Run ``run``'s optimiser state dict from the folded one (per-parameter tensors with a run
    dimension are sliced; scalars such as Adam's step are shared)."""
    per_param = {
        index: {key: value[run].clone() if torch.is_tensor(value) and value.dim() > 0 else value for key, value in entry.items()}
        for index, entry in state["state"].items()
    }
    return {"state": per_param, "param_groups": copy.deepcopy(state["param_groups"])}


def fold_optimizer_states(states: list[dict]) -> dict:
    """The folded optimiser state dict from R single ones (inverse of ``run_optimizer_state``)."""
    first = states[0]
    per_param = {
        index: {
            key: torch.stack([s["state"][index][key] for s in states]) if torch.is_tensor(value) and value.dim() > 0 else value
            for key, value in entry.items()
        }
        for index, entry in first["state"].items()
    }
    return {"state": per_param, "param_groups": copy.deepcopy(first["param_groups"])}


def clip_per_run_(parameters: list[nn.Parameter], max_norm: float, *, exact: bool) -> Tensor:
    """``clip_grad_norm_`` of every run separately: run r's gradients (the slices [r] of every
    parameter) scaled by min(1, max_norm / (||g_r|| + 1e-6)). Exact mode computes each run's norm
    with ``torch.nn.utils.get_total_norm`` on its slices, as the single loop does. Fast mode takes
    one norm over every gradient laid side by side ([R, total], one copy) and scales them with
    one multi-tensor product: a few kernels instead of two per parameter (123 + 123 of them in
    the paper's ListOps model, 5% of its step on the H200). Returns the per-run norms [R]; no
    host sync."""
    grads = [p.grad for p in parameters if p.grad is not None]
    runs = grads[0].shape[0]
    if exact:
        norms = torch.stack([torch.nn.utils.get_total_norm([g[r] for g in grads]) for r in range(runs)])
    else:
        side_by_side = torch.cat([g.reshape(runs, -1).float() for g in grads], dim=1)  # [R, total]
        norms = torch.linalg.vector_norm(side_by_side, dim=1)  # [R]
    coef = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    torch._foreach_mul_(grads, [coef.view(runs, *([1] * (g.dim() - 1))).to(g.dtype) for g in grads])
    return norms
