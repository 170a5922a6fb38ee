"""Tokenizers: word normalisation and vocabulary, SentencePiece training, the cache (no retraining), errors."""

import random

import numpy as np
import pytest

from sparsefocus.tasks import tokenize
from sparsefocus.tasks.text_loaders import TextSplits
from sparsefocus.tasks.tokenize import (
    EOS_ID,
    UNK_ID,
    Encoded,
    build_tokenizer,
    encode_split,
    normalize_word,
    word_vocabulary,
)


def synthetic_splits(num_lines: int = 600, seed: int = 0) -> TextSplits:
    """Lines of made-up words with a Zipf-like frequency, so SentencePiece has something to learn."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 7))) for _ in range(120)]
    weights = [1 / (rank + 1) for rank in range(len(words))]

    def lines(count):
        return [" ".join(rng.choices(words, weights, k=rng.randint(3, 12))) for _ in range(count)]

    return TextSplits("synthetic", lines(num_lines), lines(60), lines(60))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFOCUS_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    "word, expected",
    [("The", "the"), ("1,200", "N"), ("3.5", "N"), ("1-1/2", "N"), ("-7", "N"), ("1960's", "1960's"), ("A4", "a4")],
)
def test_normalize_word_lowercases_and_maps_numbers_to_n(word, expected):
    assert normalize_word(word) == expected


def test_word_vocabulary_is_specials_then_most_frequent_with_ties_by_spelling():
    vocabulary = word_vocabulary(["b a a", "c b a 12", "<unk> d"], vocab_size=5)
    assert vocabulary == ["<unk>", "<eos>", "a", "b", "N"]


def test_word_vocabulary_larger_than_the_corpus_is_a_value_error():
    with pytest.raises(ValueError, match="vocab_size 10 is larger than the corpus allows.*<= 5"):
        word_vocabulary(["x y z"], vocab_size=10)


def test_word_tokenizer_maps_unknown_and_literal_unk_to_unk(cache):
    splits = TextSplits("tiny", ["the cat sat", "the dog sat"], ["the bird sat <unk>"], ["The 42"])
    tokenizer = build_tokenizer(splits, "word", 6)
    assert tokenizer.encode(["the bird sat <unk>"])[0][1] == UNK_ID
    assert tokenizer.encode(["the bird sat <unk>"])[0][3] == UNK_ID
    assert tokenizer.decode(tokenizer.encode(["The cat"])[0]) == "the cat"


@pytest.mark.parametrize("kind", ["unigram", "bpe"])
def test_sentencepiece_trains_once_and_is_loaded_from_the_cache(cache, monkeypatch, kind):
    splits = synthetic_splits()
    tokenizer = build_tokenizer(splits, kind, 100)
    assert tokenizer.vocab_size == 100 and tokenizer.unk_id == UNK_ID and tokenizer.eos_id == EOS_ID
    (model_file,) = (cache / "tokenizers").glob(f"synthetic-{kind}-100-*.model")
    mtime = model_file.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer was retrained although it is cached")

    monkeypatch.setattr(tokenize, "train_sentencepiece", no_training)
    again = build_tokenizer(splits, kind, 100)
    assert model_file.stat().st_mtime_ns == mtime
    line = splits.valid[0]
    assert again.encode([line]) == tokenizer.encode([line]) and again.decode(again.encode([line])[0]) == line


def test_changed_text_or_settings_get_their_own_cache_entry(cache):
    splits = synthetic_splits()
    build_tokenizer(splits, "unigram", 100)
    build_tokenizer(splits, "unigram", 80)
    build_tokenizer(synthetic_splits(seed=1), "unigram", 100)
    assert len(list((cache / "tokenizers").glob("*.model"))) == 3


def test_sentencepiece_vocab_too_large_is_a_value_error_and_caches_nothing(cache):
    splits = TextSplits("small", ["the cat sat on the mat"] * 20, ["the cat"], ["the mat"])
    with pytest.raises(ValueError, match=r"vocab_size 5000 is larger than the corpus allows.*at most \d+"):
        build_tokenizer(splits, "unigram", 5000)
    assert not (cache / "tokenizers").exists() or list((cache / "tokenizers").iterdir()) == []


def test_unknown_tokenizer_and_tiny_vocab_are_rejected(cache):
    with pytest.raises(ValueError, match="unknown tokenizer 'char'"):
        build_tokenizer(synthetic_splits(), "char", 100)
    with pytest.raises(ValueError, match="at least 3"):
        build_tokenizer(synthetic_splits(), "word", 2)


def test_encode_split_offsets_stream_and_cache(cache, monkeypatch):
    splits = TextSplits("tiny", ["a b c", "b c", "a"], ["a b", "c"], ["c"])
    tokenizer = build_tokenizer(splits, "word", 5)
    encoded = encode_split(tokenizer, splits, "valid")
    a, b, c = (tokenizer.encode([w])[0][0] for w in "abc")
    assert encoded.ids.tolist() == [a, b, c] and encoded.offsets.tolist() == [0, 2, 3]
    assert encoded.stream(EOS_ID).tolist() == [a, b, EOS_ID, c, EOS_ID]
    monkeypatch.setattr(tokenize, "_encode_lines", lambda *a: (_ for _ in ()).throw(AssertionError("re-encoded")))
    cached = encode_split(tokenizer, splits, "valid")
    assert np.array_equal(cached.ids, encoded.ids) and np.array_equal(cached.offsets, encoded.offsets)
    assert not list(cache.rglob("*.tmp"))


def test_encoded_line_lengths():
    encoded = Encoded(np.arange(6, dtype=np.int32), np.array([0, 4, 4, 6]))
    assert encoded.line_lengths.tolist() == [4, 0, 2]
