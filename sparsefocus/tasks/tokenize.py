"""Tokenizers trained on a corpus's training split, cached by corpus and settings, and cached encodings.

Three kinds, all with ``<unk>`` = 0 and ``<eos>`` = 1 and ``vocab_size`` counting every id:

| kind | what | default |
|---|---|---|
| ``unigram`` | SentencePiece unigram LM (the Semantic Focus PTB recipe) | 4096 |
| ``bpe`` | SentencePiece BPE | 10000 in the paper's BPE runs |
| ``word`` | Mikolov-style words: lowercase, numbers -> ``N``, the ``vocab_size - 2`` most frequent words | 10000 |

Files go to ``<cache>/tokenizers/`` and ``<cache>/encoded/`` under a key hashed from the training text and
the settings, written to a temporary name and renamed, so a second call loads instead of retraining and a
crash never leaves a half-written file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import sentencepiece

from sparsefocus.tasks.corpus import cache_dir
from sparsefocus.tasks.text_loaders import TextSplits

TOKENIZERS = ("unigram", "bpe", "word")
UNK_ID, EOS_ID = 0, 1
_FORMAT_VERSION = 1  # bump when the training recipe changes, so old cache entries are not reused
_NUMBER = re.compile(r"[-+]?\d[\d,.:/-]*")
_ENCODE_CHUNK = 20_000


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    eos_id: int
    unk_id: int

    def encode(self, lines: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Encoded:
    """One split as token ids: line ``i`` is ``ids[offsets[i]:offsets[i + 1]]`` (no ``<eos>`` inside)."""

    ids: np.ndarray  # [T] int32
    offsets: np.ndarray  # [num_lines + 1] int64

    @property
    def line_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def stream(self, eos_id: int) -> np.ndarray:
        """The split as one sequence with ``eos_id`` after every line: [T + num_lines] int64."""
        return np.insert(self.ids, self.offsets[1:], eos_id).astype(np.int64)


class SentencePieceTokenizer:
    """A trained SentencePiece model (``unigram`` or ``bpe``)."""

    def __init__(self, model_file: Path, kind: str) -> None:
        self.kind, self.path = kind, Path(model_file)
        self.processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
        self.vocab_size = int(self.processor.vocab_size())
        self.eos_id, self.unk_id = int(self.processor.eos_id()), int(self.processor.unk_id())

    def encode(self, lines: list[str]) -> list[list[int]]:
        return self.processor.encode(lines, out_type=int)

    def decode(self, ids: list[int]) -> str:
        return self.processor.decode([int(i) for i in ids])


class WordTokenizer:
    """Whitespace words after ``normalize_word``; unknown words (and a literal ``<unk>``) map to ``<unk>``."""

    def __init__(self, words: list[str], path: Path | None = None) -> None:
        self.kind, self.path, self.words = "word", path, words
        self.index = {word: i for i, word in enumerate(words)}
        self.vocab_size, self.eos_id, self.unk_id = len(words), EOS_ID, UNK_ID

    def encode(self, lines: list[str]) -> list[list[int]]:
        return [[self.index.get(normalize_word(w), UNK_ID) for w in line.split()] for line in lines]

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[int(i)] for i in ids)


def normalize_word(word: str) -> str:
    """Mikolov's PTB normalisation: lowercase, and any number (``1,200``, ``3.5``, ``1-1/2``) becomes ``N``."""
    return "N" if _NUMBER.fullmatch(word) else word.lower()


def word_vocabulary(lines: list[str], vocab_size: int) -> list[str]:
    """``["<unk>", "<eos>"]`` + the ``vocab_size - 2`` most frequent normalised words (ties by spelling).

    ValueError if the lines hold fewer distinct words than that.
    """
    counts = Counter(normalize_word(word) for line in lines for word in line.split())
    counts.pop("<unk>", None)
    counts.pop("<eos>", None)
    wanted = vocab_size - 2
    if wanted > len(counts):
        raise ValueError(
            f"vocab_size {vocab_size} is larger than the corpus allows: the training split has "
            f"{len(counts)} distinct words, so word vocab_size must be <= {len(counts) + 2}"
        )
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:wanted]
    return ["<unk>", "<eos>"] + [word for word, _ in ranked]


def build_tokenizer(splits: TextSplits, kind: str = "unigram", vocab_size: int = 4096, *, cache: Path | None = None) -> Tokenizer:
    """A tokenizer of ``kind`` trained on ``splits.train``, loaded from the cache when it was trained before."""
    if kind not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {kind!r}; valid: {', '.join(TOKENIZERS)}")
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be at least 3 (two special ids and one token), got {vocab_size}")
    key = _key(splits.fingerprint("train"), kind, vocab_size)
    stem = (cache or cache_dir()) / "tokenizers" / f"{splits.name}-{kind}-{vocab_size}-{key[:16]}"
    if kind == "word":
        path = stem.with_suffix(".json")
        if not path.is_file():
            _write_atomic(path, json.dumps(word_vocabulary(splits.train, vocab_size)).encode())
        return WordTokenizer(json.loads(path.read_text()), path)
    path = stem.with_suffix(".model")
    if not path.is_file():
        _write_atomic(path, train_sentencepiece(splits.train, kind, vocab_size))
    return SentencePieceTokenizer(path, kind)


def train_sentencepiece(lines: list[str], kind: str, vocab_size: int) -> bytes:
    """Train a SentencePiece ``kind`` model on ``lines``; return the serialised model.

    ValueError (with the largest size SentencePiece would accept) if ``vocab_size`` is too large for the text.
    """
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            model_type=kind,
            vocab_size=vocab_size,
            unk_id=UNK_ID,
            eos_id=EOS_ID,
            bos_id=-1,
            pad_id=-1,
            input_sentence_size=1_000_000,  # a seeded sample bounds memory on WikiText-103
            shuffle_input_sentence=True,
            max_sentence_length=1 << 15,  # WikiText paragraphs exceed the 4192-byte default
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
    except RuntimeError as error:
        limit = re.search(r"value <= (\d+)", str(error))
        if limit is None:
            raise
        raise ValueError(
            f"vocab_size {vocab_size} is larger than the corpus allows for a {kind} model: "
            f"the training split supports at most {limit.group(1)}"
        ) from None
    return model.getvalue()


def encode_split(tokenizer: Tokenizer, splits: TextSplits, split: str, *, cache: Path | None = None) -> Encoded:
    """``splits.<split>`` encoded by ``tokenizer``, cached as ``.npz`` next to the tokenizer's key."""
    lines = splits.split(split)
    if not lines:
        raise ValueError(f"{splits.name}: the {split} split is empty")
    # The tokenizer file's name carries its own key; its folder may move with the cache.
    settings = f"{tokenizer.kind}|{tokenizer.vocab_size}|{Path(getattr(tokenizer, 'path', '') or '').name}"
    key = _key(splits.fingerprint(split), settings, 0)
    path = (cache or cache_dir()) / "encoded" / f"{splits.name}-{split}-{key[:16]}.npz"
    if path.is_file():
        with np.load(path) as stored:
            return Encoded(stored["ids"], stored["offsets"])
    encoded = _encode_lines(tokenizer, lines)
    buffer = io.BytesIO()
    np.savez(buffer, ids=encoded.ids, offsets=encoded.offsets)
    _write_atomic(path, buffer.getvalue())
    return encoded


def _encode_lines(tokenizer: Tokenizer, lines: list[str]) -> Encoded:
    """Encode in chunks into int32 arrays so that a 100M-token corpus never exists as Python lists."""
    id_chunks, lengths = [], []
    for start in range(0, len(lines), _ENCODE_CHUNK):
        pieces = tokenizer.encode(lines[start : start + _ENCODE_CHUNK])
        lengths += [len(p) for p in pieces]
        id_chunks.append(np.fromiter((i for p in pieces for i in p), dtype=np.int32))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Encoded(np.concatenate(id_chunks), offsets)


def _key(fingerprint: str, kind: str, vocab_size: int) -> str:
    return hashlib.sha256(f"{_FORMAT_VERSION}|{fingerprint}|{kind}|{vocab_size}".encode()).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
