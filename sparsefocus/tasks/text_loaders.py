"""Text corpora as train / valid / test lists of lines, from the Brown cache or from files the user has.

Nothing here downloads. PTB, WikiText-2/103 and plain-text folders are read from a path the user gives:

| corpus | ``path`` holds | one line is |
|---|---|---|
| ``brown`` | nothing (the cache of ``python -m sparsefocus.tasks.corpus fetch``) | a sentence |
| ``ptb`` | ``ptb.train.txt``, ``ptb.valid.txt``, ``ptb.test.txt`` (Mikolov's files) | a sentence |
| ``wikitext2`` / ``wikitext103`` | ``wiki.{train,valid,test}.tokens`` or, with ``raw=True``, ``.raw`` | a paragraph or heading |
| ``folder`` | ``*.txt`` files, or ``train/``, ``valid/``, ``test/`` subfolders of them | a non-blank line |

A plain folder without split subfolders is split by file (document), stratified like Brown.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path

from sparsefocus.tasks.corpus import SPLITS, load_brown, split_documents

CORPORA = ("brown", "ptb", "wikitext2", "wikitext103", "folder")


@dataclass(frozen=True)
class TextSplits:
    """A corpus as lines of text per split; ``name`` identifies it in cache keys and reports."""

    name: str
    train: list[str]
    valid: list[str]
    test: list[str]
    info: dict[str, object] = field(default_factory=dict, compare=False)

    def split(self, name: str) -> list[str]:
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; valid: {', '.join(SPLITS)}")
        return getattr(self, name)

    def fingerprint(self, split: str = "train") -> str:
        """sha256 of a split's lines: the key that ties a cached tokenizer or encoding to its text."""
        digest = hashlib.sha256()
        for line in self.split(split):
            digest.update(line.encode("utf-8"))
            digest.update(b"\n")
        return digest.hexdigest()


def read_text_file(path: Path) -> str:
    """A file's text, strictly UTF-8. ValueError if it is missing, not UTF-8 or has no non-blank text."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 (byte {error.start}: {data[error.start : error.start + 1]!r})") from None
    if not text.strip():
        raise ValueError(f"{path}: file is empty (no non-blank text)")
    return text


def nonblank_lines(text: str) -> list[str]:
    """The stripped non-blank lines of ``text``."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def load_brown_splits(*, split_seed: int = 0, fractions: tuple[float, float] = (0.1, 0.1)) -> TextSplits:
    """Brown from the cache, split by document (see ``corpus.split_documents``); a line is a sentence."""
    parts = split_documents(load_brown(), fractions=fractions, seed=split_seed)
    lines = {name: [" ".join(sentence) for d in docs for sentence in d.sentences] for name, docs in parts.items()}
    info = {name: [d.doc_id for d in docs] for name, docs in parts.items()}
    return TextSplits(f"brown-s{split_seed}", lines["train"], lines["valid"], lines["test"], {"documents": info})


def load_ptb(path: str | Path) -> TextSplits:
    """Penn Treebank (Mikolov's ``ptb.{train,valid,test}.txt``) from folder ``path``; a line is a sentence."""
    folder = _existing_folder(path, "ptb")
    lines = {name: nonblank_lines(read_text_file(folder / f"ptb.{name}.txt")) for name in SPLITS}
    return TextSplits("ptb", lines["train"], lines["valid"], lines["test"], {"path": str(folder)})


def load_wikitext(path: str | Path, *, raw: bool = False, name: str = "wikitext103") -> TextSplits:
    """WikiText-2 or -103 from folder ``path``: ``wiki.{split}.tokens`` (or ``.raw`` with ``raw=True``).

    Headings (`` = Title = ``) are kept as lines, as in the usual word-level setup; blank lines are dropped.
    """
    folder = _existing_folder(path, name)
    suffix = "raw" if raw else "tokens"
    lines = {split: nonblank_lines(read_text_file(folder / f"wiki.{split}.{suffix}")) for split in SPLITS}
    tag = f"{name}-raw" if raw else name
    return TextSplits(tag, lines["train"], lines["valid"], lines["test"], {"path": str(folder)})


def load_folder(path: str | Path, *, split_seed: int = 0, fractions: tuple[float, float] = (0.1, 0.1)) -> TextSplits:
    """Plain UTF-8 ``*.txt`` files under ``path``: from ``train/ valid/ test/`` subfolders if all three
    exist, else split by file with a seeded shuffle (``round(n * fraction)``, at least one file each)."""
    folder = _existing_folder(path, "folder")
    if all((folder / split).is_dir() for split in SPLITS):
        lines = {split: _lines_of_files(_text_files(folder / split)) for split in SPLITS}
        order = "subfolders"
    else:
        files = _text_files(folder)
        if len(files) < 3:
            raise ValueError(f"{folder}: {len(files)} .txt file(s); a split by document needs at least 3")
        random.Random(f"{split_seed}:folder").shuffle(files)
        num_valid, num_test = (max(round(len(files) * f), 1) for f in fractions)
        if num_valid + num_test >= len(files):
            raise ValueError(f"{folder}: {len(files)} files leave no training file after the split {fractions}")
        parts = {"valid": files[:num_valid], "test": files[num_valid : num_valid + num_test]}
        parts["train"] = files[num_valid + num_test :]
        lines = {split: _lines_of_files(sorted(parts[split])) for split in SPLITS}
        order = f"by file, seed {split_seed}"
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:8]
    return TextSplits(f"folder-{digest}", lines["train"], lines["valid"], lines["test"], {"path": str(folder), "split": order})


def load_text(corpus: str, path: str | Path = "", *, raw: bool = False, split_seed: int = 0) -> TextSplits:
    """Dispatch on ``corpus`` (one of ``CORPORA``); ``path`` is required for all but ``brown``."""
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; valid: {', '.join(CORPORA)}")
    if corpus == "brown":
        return load_brown_splits(split_seed=split_seed)
    if not str(path):
        raise ValueError(f"corpus {corpus!r} needs path= (a folder on disk); nothing is downloaded")
    if corpus == "ptb":
        return load_ptb(path)
    if corpus in ("wikitext2", "wikitext103"):
        return load_wikitext(path, raw=raw, name=corpus)
    return load_folder(path, split_seed=split_seed)


def _existing_folder(path: str | Path, corpus: str) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{corpus}: folder {folder} does not exist (give the folder holding the corpus files)")
    return folder


def _text_files(folder: Path) -> list[Path]:
    files = sorted(p for p in folder.rglob("*.txt") if p.is_file())
    if not files:
        raise ValueError(f"{folder}: no .txt files")
    return files


def _lines_of_files(files: list[Path]) -> list[str]:
    return [line for path in files for line in nonblank_lines(read_text_file(path))]
