"""Real-text tasks: block and window construction, caps, errors, registration, and a training smoke run
through ``sparsefocus.train`` whose held-out perplexity falls."""

import json
import math
import random
from pathlib import Path

import pytest
import torch

from sparsefocus.tasks import build_task, task_config_class
from sparsefocus.tasks.corpus import brown_dir
from sparsefocus.tasks.lm import CausalLMTask, WindowNextTokenTask, mean_token_nll, perplexity

REAL_BROWN = brown_dir()


def write_corpus(folder, num_lines: dict[str, int], seed: int = 0):
    """A ``folder`` corpus in split subfolders, sentences from a tiny grammar (learnable structure)."""
    rng = random.Random(seed)
    subjects, verbs, objects = (
        ["the cat", "a dog", "my friend", "the bird"],
        ["sees", "likes", "finds"],
        ["the ball", "a tree", "the sun"],
    )
    for split, count in num_lines.items():
        (folder / split).mkdir(parents=True)
        lines = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} ." for _ in range(count)]
        (folder / split / "text.txt").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture
def corpus_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFOCUS_CACHE", str(tmp_path / "cache"))
    return write_corpus(tmp_path / "text", {"train": 300, "valid": 40, "test": 40})


def word_task(cls, corpus_dir, **fields):
    return cls(corpus="folder", path=str(corpus_dir), tokenizer="word", vocab_size=16, **fields)


def test_perplexity_is_exp_of_mean_nll():
    assert perplexity(0.0) == 1.0
    assert perplexity(math.log(37.0)) == pytest.approx(37.0)
    assert perplexity(1e6) == math.inf
    logits = torch.zeros(2, 3, 5)
    assert perplexity(float(mean_token_nll(logits, torch.tensor([[1, 2, -100], [0, 4, 3]])))) == pytest.approx(5.0)


def test_lm_blocks_are_the_contiguous_stream_shifted_by_one(corpus_dir):
    data = word_task(CausalLMTask, corpus_dir, block_size=7).build(seed=0)
    assert data.kind == "next_token" and data.seq_len == 7 and data.vocab_size == 16 == data.num_classes
    inputs, targets = data.train_inputs, data.train_targets
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert torch.equal(targets[:-1, -1], inputs[1:, 0])  # consecutive blocks continue the stream
    # 300 lines of 6 words + <eos> = 2100 tokens -> (2100 - 1) // 7 blocks
    assert inputs.shape[0] == 2099 // 7
    eos_positions = (inputs.reshape(-1) == data.info["eos_id"]).nonzero().flatten()
    assert torch.equal(eos_positions[:3], torch.tensor([6, 13, 20]))
    assert data.test_inputs is not None and data.info["unigram_perplexity"]["valid"] > 1


def test_lm_block_longer_than_a_split_is_a_value_error(corpus_dir):
    with pytest.raises(ValueError, match=r"block_size 400 is longer than the valid split \(280 tokens\)"):
        word_task(CausalLMTask, corpus_dir, block_size=400).build(seed=0)


def test_caps_keep_a_seeded_subset_independent_of_the_training_seed(corpus_dir):
    task = word_task(CausalLMTask, corpus_dir, block_size=7, max_train=10, max_valid=5)
    full = word_task(CausalLMTask, corpus_dir, block_size=7).build(seed=0)
    first, second = task.build(seed=0), task.build(seed=1)
    assert first.train_inputs.shape == (10, 7) and first.valid_inputs.shape == (5, 7)
    assert torch.equal(first.train_inputs, second.train_inputs) and torch.equal(first.valid_targets, second.valid_targets)
    full_rows = {tuple(row) for row in full.train_inputs.tolist()}
    assert all(tuple(row) in full_rows for row in first.train_inputs.tolist())
    assert first.test_inputs.shape[0] == full.test_inputs.shape[0]


def write_lines(folder, lines: dict[str, str]):
    for split, text in lines.items():
        (folder / split).mkdir(parents=True)
        (folder / split / "t.txt").write_text(text)
    return folder


def test_windows_slide_inside_lines_and_label_the_next_token(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFOCUS_CACHE", str(tmp_path / "cache"))
    folder = write_lines(tmp_path / "text", {"train": "a b c d e\nb c\nc d e a b c\n", "valid": "a b c d\n", "test": "e d c b\n"})
    task = WindowNextTokenTask(corpus="folder", path=str(folder), tokenizer="word", vocab_size=7, window=3)
    data = task.build(seed=0)
    index = {word: i for i, word in enumerate(json.loads(Path(data.info["tokenizer_file"]).read_text()))}
    expected = [("a b c", "d"), ("b c d", "e"), ("c d e", "a"), ("d e a", "b"), ("e a b", "c")]
    assert data.kind == "classify" and data.seq_len == 3
    assert data.train_inputs.tolist() == [[index[w] for w in window.split()] for window, _ in expected]
    assert data.train_targets.tolist() == [index[target] for _, target in expected]
    assert data.valid_inputs.tolist() == [[index[w] for w in "abc"]] and data.valid_targets.tolist() == [index["d"]]


def test_window_zero_uses_the_mean_training_line_length(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFOCUS_CACHE", str(tmp_path / "cache"))
    folder = write_lines(
        tmp_path / "text", {"train": "a b\na b c d\na b c d e f\n", "valid": "a b c d e\n", "test": "f e d c b\n"}
    )
    data = WindowNextTokenTask(corpus="folder", path=str(folder), tokenizer="word", vocab_size=8).build(seed=0)
    assert data.info["window"] == 4 and data.seq_len == 4
    assert data.train_inputs.shape[0] == 2  # only the six-word line is longer than the window


def test_window_not_shorter_than_any_line_is_a_value_error(corpus_dir):
    with pytest.raises(ValueError, match=r"window 6 is not shorter than any line of the train split \(longest 6"):
        word_task(WindowNextTokenTask, corpus_dir, window=6).build(seed=0)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"corpus": "enwik8"}, "unknown corpus 'enwik8'"),
        ({"corpus": "ptb"}, "needs path"),
        ({"corpus": "ptb", "path": "x", "raw": True}, "raw applies to wikitext"),
        ({"tokenizer": "char"}, "unknown tokenizer 'char'"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"max_train": -1}, "max_train must be >= 0"),
    ],
)
def test_bad_fields_fail_before_any_work(fields, message):
    with pytest.raises(ValueError, match=message):
        build_task("lm", 0, **fields)


def test_tasks_are_registered_and_typed_for_the_training_config():
    from sparsefocus.train.config import make_task_config

    assert task_config_class("lm") is CausalLMTask and task_config_class("lm_window") is WindowNextTokenTask
    config = make_task_config({"name": "lm", "corpus": "ptb", "path": "/data/ptb", "block_size": 64})
    assert config.block_size == 64 and config.kind == "next_token"
    with pytest.raises(ValueError, match="block_size"):
        make_task_config({"name": "lm", "block_size": "long"})


def test_training_smoke_run_lowers_held_out_perplexity(corpus_dir, tmp_path):
    from sparsefocus.train.config import from_dict
    from sparsefocus.train.loop import RunSpec, train_run

    task = {"name": "lm", "corpus": "folder", "path": str(corpus_dir), "tokenizer": "word", "vocab_size": 16, "block_size": 14}
    config = from_dict(
        {
            "task": task,
            "model": {"blocks": 1, "dim": 16, "mlp_dim": 32, "dropout": 0.0},
            "optim": {"name": "adamw", "lr": 0.01, "schedule": "constant"},
            "train": {"epochs": 3, "batch_size": 16, "train_loss": "running"},
        }
    )
    metrics = train_run(RunSpec(tmp_path / "run", config, "default", "TOPK:4", seed=0))
    first, last = perplexity(metrics[0]["valid_loss"]), perplexity(metrics[-1]["valid_loss"])
    assert last < first < 16
    unigram = build_task("lm", 0, **{k: v for k, v in task.items() if k != "name"}).info["unigram_perplexity"]["valid"]
    assert last < unigram  # the grammar's word order is learnable; a unigram model cannot use it
    assert metrics[-1]["valid_ppl"] == pytest.approx(last)
    assert metrics[-1]["test_ppl"] == pytest.approx(perplexity(metrics[-1]["test_loss"])) and metrics[-1]["test_ppl"] < 16


def test_report_has_a_perplexity_table_for_language_models(corpus_dir, tmp_path):
    from sparsefocus.train.config import from_dict
    from sparsefocus.train.experiment import run_experiment
    from sparsefocus.train.report import write_report

    task = {"name": "lm", "corpus": "folder", "path": str(corpus_dir), "tokenizer": "word", "vocab_size": 16, "block_size": 14}
    config = from_dict(
        {
            "name": "lm_report",
            "out_dir": str(tmp_path),
            "task": task,
            "mechanisms": ["FULL", "BAND:3"],
            "seeds": [0],
            "model": {"blocks": 1, "dim": 16, "mlp_dim": 32, "dropout": 0.0},
            "optim": {"name": "adamw", "lr": 0.01, "schedule": "constant"},
            "train": {"epochs": 1, "batch_size": 16, "train_loss": "running"},
        }
    )
    report, _ = write_report(run_experiment(config, quiet=True))
    text = report.read_text()
    assert "final held-out perplexity" in text and "final test perplexity" in text and "| BAND:3 |" in text


@pytest.mark.skipif(not REAL_BROWN.is_dir(), reason=f"Brown corpus not cached at {REAL_BROWN}; run the setup step")
def test_real_brown_window_task_matches_the_paper_setting(monkeypatch):
    monkeypatch.setenv("SPARSEFOCUS_CACHE", str(REAL_BROWN.parent.parent))
    data = build_task("lm_window", 0, max_train=200, max_valid=100, max_test=100)
    assert data.info["window"] == 29 and data.vocab_size == 4096
    assert data.train_inputs.shape == (200, 29) and int(data.train_targets.max()) < 4096
