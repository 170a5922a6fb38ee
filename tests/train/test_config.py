"""Config layering (defaults <- YAML <- overrides) and errors that name the bad key."""

import pytest

from sparsefocus.train.config import expand_settings, load_config
from sparsefocus.train.experiment import check_experiment

TINY_TASK = "task={name: parity, length: 12, num_train: 40, num_valid: 20}"


def test_yaml_overrides_defaults_and_dotted_overrides_override_yaml(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text("name: study\nmodel: {blocks: 4, dim: 32}\noptim: {lr: 1e-3}\nmechanisms: [FULL, 'TOPK:5']\n")
    config = load_config(path, ["model.blocks=6", "mechanisms=[FULL,TOPK:3,BAND:5(1)]"])
    assert config.name == "study"
    assert config.model.blocks == 6 and config.model.dim == 32 and config.model.heads == 1
    assert config.optim.lr == pytest.approx(1e-3)
    assert config.mechanisms == ["FULL", "TOPK:3", "BAND:5(1)"]
    assert config.optim.grad_clip == 0.5  # untouched default


def test_settings_expand_to_every_combination():
    config = load_config(None, ["settings={model.blocks: [1, 2], optim.lr: [0.1, 1.0]}"])
    settings = expand_settings(config)
    assert [label for label, _ in settings] == [
        "model.blocks=1,optim.lr=0.1",
        "model.blocks=1,optim.lr=1.0",
        "model.blocks=2,optim.lr=0.1",
        "model.blocks=2,optim.lr=1.0",
    ]
    assert settings[3][1].model.blocks == 2 and settings[3][1].optim.lr == 1.0


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["model.bloks=3"], "model.bloks"),
        (["optimizer.lr=3"], "optimizer"),
        (["model.blocks=three"], "model.blocks"),
        (["model.paper_mode=3"], "model.paper_mode"),
        (["optim.lr=fast"], "optim.lr"),
        (["model.heads=3"], "model.heads"),
        (["optim.name=adam"], "optim.name"),
        (["train.epochs=0"], "train.epochs"),
    ],
)
def test_bad_keys_and_values_name_the_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["mechanisms=[FULL,TOPK:13]"], r"mechanisms\[1\]"),
        (["mechanisms=[FULL,WOBBLE:3]"], r"mechanisms\[1\]"),
        (["task.name=sudoku"], r"task\.name"),
        (["task={name: parity, lenght: 3}"], r"task\.lenght"),
        (["mechanisms=[[FULL,TOPK:3,FULL]]", "model.blocks=2"], r"mechanisms\[0\]"),
        (["settings={model.blocks: [1, 2], model.heads: [1, 3]}", "model.dim=10"], r"setting .*model\.heads"),
        (["settings={model.nope: [1]}"], r"model\.nope"),
    ],
)
def test_impossible_experiments_stop_before_training_naming_the_key(overrides, key):
    config = load_config(None, [TINY_TASK, *overrides])
    with pytest.raises(ValueError, match=key):
        check_experiment(config)


def test_paper_mode_rejects_weighting_mechanisms():
    config = load_config(None, [TINY_TASK, "model.paper_mode=true", "mechanisms=[FULL,sparsemax]"])
    with pytest.raises(ValueError, match=r"mechanisms\[1\].*paper_mode"):
        check_experiment(config)
