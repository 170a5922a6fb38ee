"""sparsefocus.hf: patterns as transformers attention implementations, on a tiny random Llama
(no download). FULL equals transformers' sdpa; sparse models train; cached generation equals
recomputing the whole sequence; unsupported settings are refused by name."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

# Both follow importorskip: without transformers the module is skipped before they run.
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import sparsefocus.hf as sfhf  # noqa: E402

VOCAB = 61


def _config(**overrides):
    settings = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    settings.update(overrides)
    return LlamaConfig(**settings)


def _models(name, pattern, config=None, **options):
    """(sdpa model, our model with the same weights)."""
    sfhf.register(name, pattern, **options)
    config = config or _config()
    torch.manual_seed(0)
    # from_config writes the implementation into the config it is given: one copy each
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name)
    assert (ref.config._attn_implementation, ours.config._attn_implementation) == ("sdpa", name)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _batch(length=13, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, length), generator=gen)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :4] = 0  # left padding in the second row
    return ids, mask


def test_full_equals_sdpa_outputs_and_gradients():
    ref, ours = _models("sf-test-full", "FULL")
    ids, mask = _batch()
    real = mask.bool()
    outs = []
    for model in (ref, ours):
        logits = model(ids, attention_mask=mask).logits
        loss = (logits[real] * torch.cos(torch.arange(logits[real].numel()).reshape(logits[real].shape))).sum()
        loss.backward()
        outs.append((logits[real].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_sparse_pattern_differs_from_full_and_stays_causal():
    ref, ours = _models("sf-test-band", "BAND", k=3)
    ids, _ = _batch()
    logits = ours(ids).logits
    assert (logits - ref(ids).logits)[:, 3:].abs().max() > 1e-3  # BAND:3 is not FULL beyond 3 tokens
    torch.testing.assert_close(logits[:, :3], ref(ids).logits[:, :3], atol=1e-5, rtol=1e-5)
    changed = ids.clone()
    changed[:, 8] = (changed[:, 8] + 1) % VOCAB
    after = ours(changed).logits
    assert torch.equal(after[:, :8], logits[:, :8])
    assert not torch.equal(after[:, 8:], logits[:, 8:])


def test_padded_keys_are_never_read():
    _, ours = _models("sf-test-topk-pad", "TOPK:3")
    ids, mask = _batch()
    changed = ids.clone()
    changed[1, :4] = (changed[1, :4] + 7) % VOCAB  # only padded tokens change
    before, after = (ours(x, attention_mask=mask).logits[1, 4:] for x in (ids, changed))
    torch.testing.assert_close(after, before, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("pattern", ["TOPK:3", "BAND:4(1)"])
def test_sparse_models_train(pattern):
    _, model = _models(f"sf-test-train-{pattern}", pattern)
    ids, mask = _batch(length=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        optimizer.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("pattern", ["FULL", "BAND:3", "TOPK:3", "BLOC:4(1)"])
def test_cached_generation_equals_recomputing_the_whole_sequence(pattern):
    _, model = _models(f"sf-test-gen-{pattern}", pattern)
    model.eval()
    ids, mask = _batch(length=7)
    settings = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        cached = model.generate(ids, use_cache=True, **settings)
        recomputed = model.generate(ids, use_cache=False, **settings)
    assert cached.shape == (2, 15)
    assert torch.equal(cached, recomputed)


def test_generation_with_full_equals_sdpa_generation():
    ref, ours = _models("sf-test-gen-sdpa", "FULL")
    ids, mask = _batch(length=7)
    settings = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **settings), ref.generate(ids, **settings))


def test_register_builds_patterns_from_options():
    assert sfhf.register("sf-test-options", "BAND", k=5, g=1).label() == "BAND:5(1)"
    assert sfhf.build_pattern("TOPK:4", k=6).label() == "TOPK:6"
    with pytest.raises(ValueError, match="no parameter 'width'"):
        sfhf.build_pattern("TOPK:4", width=6)
    with pytest.raises(ValueError, match="one of transformers' own"):
        sfhf.register("sdpa", "FULL")


def test_zeta_is_refused_with_what_it_needs():
    with pytest.raises(ValueError, match="needs its own q/k projection"):
        sfhf.register("sf-test-zeta", "zeta:k=4")


def test_attention_dropout_draws_what_eager_attention_draws():
    """Training with attention_dropout: FULL through our function equals transformers' eager
    attention under the same generator state (the same dense weights dropped by the same draw),
    outputs and gradients; a sparse pattern's dropped weights stay inside its causal selection."""
    config = _config(attention_dropout=0.2)
    _, model = _models("sf-test-dropout", "FULL", config=config)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    eager.load_state_dict(model.state_dict())
    ids, mask = _batch()
    real = mask.bool()
    results = []
    for net in (eager, model):
        net.train()
        torch.manual_seed(5)
        logits = net(ids, attention_mask=mask).logits
        logits[real].float().square().mean().backward()  # padded rows differ (eager: uniform weights)
        results.append((logits.detach(), [p.grad.clone() for p in net.parameters()]))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)
    for a, b in zip(want_grads, got_grads):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)
    torch.manual_seed(5)
    assert not torch.allclose(model(ids, attention_mask=mask).logits, model.eval()(ids, attention_mask=mask).logits)

    _, band = _models("sf-test-dropout-band", "BAND:2", config=config)
    band.train()
    changed = ids.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % VOCAB
    torch.manual_seed(6)
    before = band(ids).logits
    torch.manual_seed(6)
    after = band(changed).logits
    torch.testing.assert_close(after[:, :9], before[:, :9])  # no position reads a later token


def test_attention_dropout_is_refused_where_weights_are_not_a_softmax():
    _, model = _models("sf-test-dropout-sparsemax", "sparsemax", config=_config(attention_dropout=0.1))
    ids, _ = _batch()
    model.train()
    with pytest.raises(ValueError, match="its weights are not a softmax"):
        model(ids)


def _documents_alone(model, ids, lengths):
    """Logits of each document run by itself, concatenated: [1, sum(lengths), V]."""
    parts, start = [], 0
    for n in lengths:
        parts.append(model(ids[:, start : start + n], use_cache=False).logits)
        start += n
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("pattern", ["FULL", "TOPK:3", "BAND:2"])
def test_packed_documents_through_position_ids_are_attended_alone(pattern):
    """Documents packed in one row (position_ids restart at each): every document's logits equal
    its logits alone, and FULL equals transformers' sdpa on the same packed row."""
    ref, model = _models(f"sf-test-packed-{pattern}", pattern)
    lengths = [6, 4, 7]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model(ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(packed, _documents_alone(model, ids, lengths), rtol=1e-4, atol=1e-5)
    if pattern == "FULL":
        torch.testing.assert_close(packed, ref(ids, position_ids=positions, use_cache=False).logits, rtol=1e-4, atol=1e-5)
    two_rows = model(ids.expand(2, -1), position_ids=positions.expand(2, -1), use_cache=False).logits
    torch.testing.assert_close(two_rows, packed.expand(2, -1, -1), rtol=1e-4, atol=1e-5)


def test_packed_documents_through_cu_seq_lens():
    """FlashAttention's packing kwargs give the documents-alone result too."""
    _, model = _models("sf-test-packed-cu", "TOPK:3")
    lengths = [5, 8]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(4))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cuts = torch.tensor([0, 5, 13], dtype=torch.int32)
    out = model(
        ids, position_ids=positions, cu_seq_lens_q=cuts, cu_seq_lens_k=cuts, max_length_q=8, max_length_k=8, use_cache=False
    )
    torch.testing.assert_close(out.logits, _documents_alone(model, ids, lengths), rtol=1e-4, atol=1e-5)
    attention = sfhf.make_attention_function(sfhf.build_pattern("FULL"))
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="cu_seq_lens_q == cu_seq_lens_k"):
        attention(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 2, 5]), cu_seq_lens_k=torch.tensor([0, 3, 5]))


def test_packing_with_padding_is_refused():
    from transformers import masking_utils

    mask_function = sfhf.make_mask_function("sf-test-packed-pad")
    documents = torch.tensor([[0, 0, 1, 1, 1]])
    packed = masking_utils.and_masks(masking_utils.causal_mask_function, masking_utils.packed_sequence_mask_function(documents))
    dense = mask_function(1, 5, 0, packed, None)
    assert dense.shape == (1, 1, 5, 5) and sfhf.document_ids(dense).tolist() == documents.tolist()
    with pytest.raises(ValueError, match="packing with padding"):
        mask_function(1, 5, 0, packed, torch.tensor([[1, 1, 1, 1, 0]]))


def test_document_ids_read_only_block_diagonal_masks():
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    packed = causal.clone()
    packed[2:, :2] = False  # documents [0, 2) and [2, 5)
    assert sfhf.document_ids(packed[None, None]).tolist() == [[0, 0, 1, 1, 1]]
    assert sfhf.document_ids(causal[None, None]).tolist() == [[0, 0, 0, 0, 0]]
    window = causal & torch.ones(5, 5, dtype=torch.bool).triu(-1)  # a sliding window of 2
    assert sfhf.document_ids(window[None, None]) is None


def test_static_cache_is_refused():
    _, model = _models("sf-test-static", "FULL")
    ids, mask = _batch(length=5)
    with pytest.raises(ValueError, match="StaticCache"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, cache_implementation="static", pad_token_id=0)


def test_sliding_window_models_are_refused():
    from transformers import MistralConfig

    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        sliding_window=4,
    )
    sfhf.register("sf-test-sliding", "FULL")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sf-test-sliding")
    with pytest.raises(ValueError, match="sliding"):
        model(_batch()[0])
