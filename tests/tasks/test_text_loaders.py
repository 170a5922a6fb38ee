"""Local loaders (PTB, WikiText, plain folders, Brown from the cache) on small files the tests write."""

import io
import tarfile

import pytest

from sparsefocus.tasks import corpus
from sparsefocus.tasks.corpus import install_brown, sha256_file
from sparsefocus.tasks.text_loaders import load_folder, load_ptb, load_text, load_wikitext, read_text_file


def write_split_files(folder, pattern: str, texts: dict[str, str]):
    folder.mkdir(parents=True, exist_ok=True)
    for split, text in texts.items():
        (folder / pattern.format(split=split)).write_text(text, encoding="utf-8")
    return folder


PTB = {
    "train": " aer banknote berlitz \n no it was n't black monday \n\n",
    "valid": " consumers may want to move their telephones \n",
    "test": " no it was <unk> \n the N stock \n",
}


def test_ptb_reads_one_sentence_per_nonblank_line(tmp_path):
    splits = load_ptb(write_split_files(tmp_path / "ptb", "ptb.{split}.txt", PTB))
    assert splits.train == ["aer banknote berlitz", "no it was n't black monday"]
    assert splits.valid == ["consumers may want to move their telephones"]
    assert splits.test == ["no it was <unk>", "the N stock"]


def test_ptb_missing_file_and_missing_folder_are_named(tmp_path):
    folder = write_split_files(tmp_path / "ptb", "ptb.{split}.txt", {"train": "a b", "valid": "c"})
    with pytest.raises(FileNotFoundError, match=r"ptb\.test\.txt"):
        load_ptb(folder)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_ptb(tmp_path / "nowhere")


def test_non_utf8_and_empty_files_raise_value_errors(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 latin-1\n")
    with pytest.raises(ValueError, match=r"bad\.txt: not UTF-8 \(byte 3"):
        read_text_file(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n\n\t\n")
    with pytest.raises(ValueError, match=r"empty\.txt: file is empty"):
        read_text_file(empty)
    folder = write_split_files(tmp_path / "ptb", "ptb.{split}.txt", {**PTB, "valid": ""})
    with pytest.raises(ValueError, match=r"ptb\.valid\.txt: file is empty"):
        load_ptb(folder)


WIKI = {
    "train": " \n = Valkyria Chronicles = \n \n Senjō no Valkyria 3 is a game . \n",
    "valid": " \n = Homarus = \n Homarus is a genus . \n",
    "test": " \n = Robert = \n Robert is an actor . \n",
}


def test_wikitext_tokens_and_raw_variants(tmp_path):
    folder = write_split_files(tmp_path / "wt", "wiki.{split}.tokens", WIKI)
    write_split_files(folder, "wiki.{split}.raw", {k: v.replace(" .", ".") for k, v in WIKI.items()})
    tokens = load_wikitext(folder, name="wikitext2")
    assert tokens.train == ["= Valkyria Chronicles =", "Senjō no Valkyria 3 is a game ."]
    assert tokens.name == "wikitext2"
    raw = load_text("wikitext103", folder, raw=True)
    assert raw.valid == ["= Homarus =", "Homarus is a genus."] and raw.name == "wikitext103-raw"


def test_folder_with_split_subfolders(tmp_path):
    for split in ("train", "valid", "test"):
        (tmp_path / split).mkdir()
        (tmp_path / split / "a.txt").write_text(f"{split} one\n\n{split} two\n")
    splits = load_folder(tmp_path)
    assert splits.train == ["train one", "train two"] and splits.test == ["test one", "test two"]


def test_folder_split_by_file_is_deterministic_and_disjoint(tmp_path):
    for i in range(20):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i} line a\ndocument {i} line b\n")
    first, again = load_folder(tmp_path, split_seed=3), load_folder(tmp_path, split_seed=3)
    assert first == again
    docs = {name: {line.split()[1] for line in first.split(name)} for name in ("train", "valid", "test")}
    assert [len(docs[name]) for name in ("train", "valid", "test")] == [16, 2, 2]
    assert not (docs["train"] & docs["valid"]) and not (docs["train"] & docs["test"]) and not (docs["valid"] & docs["test"])
    assert load_folder(tmp_path, split_seed=4).valid != first.valid


def test_folder_needs_three_files_to_split(tmp_path):
    (tmp_path / "a.txt").write_text("one\n")
    (tmp_path / "b.txt").write_text("two\n")
    with pytest.raises(ValueError, match="at least 3"):
        load_folder(tmp_path)


def test_load_text_rejects_unknown_corpus_and_missing_path():
    with pytest.raises(ValueError, match="unknown corpus 'enwik8'"):
        load_text("enwik8", "x")
    with pytest.raises(ValueError, match="needs path="):
        load_text("ptb")


def test_brown_lines_come_from_the_cache_split_by_document(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFOCUS_CACHE", str(tmp_path / "cache"))
    tarball = tmp_path / "brown.tgz"
    with tarfile.open(tarball, "w:gz") as archive:
        for genre in "ab":
            for i in range(1, 11):
                data = f"\tDoc/nn {genre}{i}/cd ./.\n\n\tSecond/od line/nn ./.\n".encode()
                info = tarfile.TarInfo(f"package/c{genre}{i:02d}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    monkeypatch.setattr(corpus, "BROWN_SHA256", sha256_file(tarball))
    install_brown(tarball)
    splits = load_text("brown")
    assert len(splits.train) == 2 * 16 and len(splits.valid) == 2 * 2 and len(splits.test) == 2 * 2
    assert "Second line ." in splits.valid
    documents = splits.info["documents"]
    assert not set(documents["train"]) & set(documents["valid"] + documents["test"])
    assert splits.fingerprint("train") != splits.fingerprint("valid")
