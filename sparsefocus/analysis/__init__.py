"""Analysis of trained runs: the Semantic Focus statistics (dispersion, separation, sinks), the
paper's bound check, loss landscapes with Lipschitz estimates, top-k recall, and pictures.

Never imported by the core. ``commands`` (``sparsefocus analyze``) and ``pictures``
(``sparsefocus patterns``) are the command-line entry points.
"""

from sparsefocus.analysis.bounds import BoundInputs, check_columns, paper_bound_report
from sparsefocus.analysis.hooks import AttentionCall, capture_attention
from sparsefocus.analysis.landscape import Landscape, lipschitz_profile, loss_grid
from sparsefocus.analysis.recall import RecallStatistics, topk_recall
from sparsefocus.analysis.statistics import ScoreStatistics, dispersion, full_dispersion, separation, sink_counts

__all__ = [
    "AttentionCall",
    "BoundInputs",
    "Landscape",
    "RecallStatistics",
    "ScoreStatistics",
    "capture_attention",
    "check_columns",
    "dispersion",
    "full_dispersion",
    "lipschitz_profile",
    "loss_grid",
    "paper_bound_report",
    "separation",
    "sink_counts",
    "topk_recall",
]
