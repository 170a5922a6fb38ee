"""The curves figure: one legend entry per mechanism, named as the experiment wrote it, in
colours that do not repeat."""

import numpy as np

from sparsefocus.train import report
from sparsefocus.train.report import Curves, plot_curves


def _curves(labels: list[str]) -> dict[str, Curves]:
    rng = np.random.default_rng(0)
    values = {"train_loss": rng.random((3, 5)) + 0.1, "valid_acc": rng.random((3, 5))}
    return {label: Curves(label, [1, 2, 3], values) for label in labels}


def _drawn(monkeypatch, curves: dict[str, Curves], names: dict[str, str] | None, tmp_path):
    figures = []
    monkeypatch.setattr(report, "save_png", lambda figure, path, dpi, **_: figures.append(figure))
    plot_curves(curves, "title", tmp_path / "curves.png", names)
    [figure] = figures
    [legend] = figure.legends
    return figure, [text.get_text() for text in legend.get_texts()]


def test_the_legend_names_each_mechanism_as_written(monkeypatch, tmp_path):
    curves = _curves(["FULL", "zeta:k=5,dk=3,bits=12,window=16"])
    _, texts = _drawn(monkeypatch, curves, {"zeta:k=5,dk=3,bits=12,window=16": "zeta:k=5,window=16"}, tmp_path)
    assert texts == ["FULL (3 seeds)", "zeta:k=5,window=16 (3 seeds)"]
    _, texts = _drawn(monkeypatch, curves, None, tmp_path)
    assert texts[1] == "zeta:k=5,dk=3,bits=12,window=16 (3 seeds)"


def test_eleven_mechanisms_get_eleven_colours(monkeypatch, tmp_path):
    figure, texts = _drawn(monkeypatch, _curves([f"TOPK:{k}" for k in range(1, 12)]), None, tmp_path)
    top = figure.axes[0]
    assert len(texts) == 11 and len({line.get_color() for line in top.get_lines()}) == 11


def test_a_legend_wider_than_the_axes_is_saved_whole(tmp_path):
    """The canvas grows to the legend: a name wider than the default 6.4-inch figure is not cut."""
    import matplotlib.image

    long_name = "nsa:" + ",".join(f"option{i}={i}" for i in range(12))
    plot_curves(_curves(["FULL", long_name]), "title", tmp_path / "curves.png")
    height, width = matplotlib.image.imread(tmp_path / "curves.png").shape[:2]
    assert width > 6.4 * 110
