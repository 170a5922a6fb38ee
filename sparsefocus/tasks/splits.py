"""Helpers shared by the synthetic generators: config checks, distinct-row drawing, TaskData assembly.

Every generator draws train, held-out and test sequences from ONE random stream and keeps only
inputs never drawn before, so no held-out or test sequence equals a training sequence (and no
split holds the same sequence twice). The first ``num_train`` distinct rows are the training set,
the next ``num_valid`` the held-out set, the next ``num_test`` the test set.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable, Sequence

import numpy as np
import torch

from sparsefocus.tasks.base import TaskData

Sampler = Callable[[int], tuple[np.ndarray, np.ndarray]]


def require_int(task: str, field: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    """ValueError naming ``field`` unless ``value`` is an int (not a bool) in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{task}: {field} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{task}: {field} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{task}: {field} must be <= {maximum}, got {value}")


def require_choice(task: str, field: str, value: Any, choices: Sequence[str]) -> None:
    """ValueError naming ``field`` and the valid choices unless ``value`` is one of them."""
    if value not in choices:
        raise ValueError(f"{task}: unknown {field} {value!r}; valid: {', '.join(choices)}")


def require_bool(task: str, field: str, value: Any) -> None:
    """ValueError naming ``field`` unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{task}: {field} must be true or false, got {value!r}")


def require_sizes(task: str, num_train: Any, num_valid: Any, num_test: Any) -> None:
    """Split sizes: at least one training and one held-out example; the test split may be empty."""
    require_int(task, "num_train", num_train, 1)
    require_int(task, "num_valid", num_valid, 1)
    require_int(task, "num_test", num_test, 0)


def resolve_preset(task: str, config: Any, presets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A preset task config's values: ``presets[config.preset]`` overridden by every field that is not None."""
    require_choice(task, "preset", config.preset, list(presets))
    values = dict(presets[config.preset])
    values.update({key: value for key, value in asdict(config).items() if value is not None and key != "preset"})
    return values


ROUND_CAP = 1 << 16  # rows drawn per round at most, so a round stays a few tens of MB
DRY_DRAWS = 1 << 16  # no new row in this many draws (and 16 x the request) = the space is exhausted


def draw_distinct(
    task: str, sample: Sampler, total: int, space_size: int | None = None, max_rounds: int = 64
) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``total`` examples with pairwise distinct input rows.

    sample(n) -> (inputs [n, L] int, targets [n] or [n, L] int), drawing from the caller's seeded
    generator, so the result is deterministic. Rows equal to an earlier row are dropped and more are
    drawn until ``total`` distinct rows are kept: the first ``max_rounds`` rounds draw a little more
    than is missing (so one round usually suffices), later rounds double in size (up to
    ``ROUND_CAP`` rows), which finds the last rows of a nearly exhausted space quickly.
    space_size: the number of distinct rows the sampler can produce, if known; a request above it
        is refused before any draw.
    Raises:
        ValueError: ``total`` > ``space_size``, or no new row appeared in the last
            max(``DRY_DRAWS``, 16 x max(total, space_size)) draws (the space is too small).
    Returns (inputs [total, L], targets [total, ...]) in draw order.
    """
    if space_size is not None and total > space_size:
        raise ValueError(
            f"{task}: asks for {total} distinct sequences (num_train + num_valid + num_test) but only "
            f"{space_size} exist: lower the sizes or lengthen the sequences"
        )
    dry_limit = max(DRY_DRAWS, 16 * max(total, space_size or 0))
    seen: set[bytes] = set()
    kept_inputs: list[np.ndarray] = []
    kept_targets: list[np.ndarray] = []
    count, dry, size, rounds = 0, 0, 0, 0
    while count < total:
        need = total - count
        size = need + need // 16 + 4 if rounds < max_rounds else min(max(2 * size, need), ROUND_CAP)
        rounds += 1
        inputs, targets = sample(size)
        keep = _first_unseen_rows(inputs, seen, need)
        dry = dry + size if not keep else size - 1 - keep[-1]
        rows = slice(0, len(keep)) if keep == list(range(len(keep))) else keep  # a view in the usual case
        kept_inputs.append(inputs[rows])
        kept_targets.append(targets[rows])
        count += len(keep)
        if count < total and dry >= dry_limit:
            raise ValueError(
                f"{task}: drew only {count} distinct sequences of the {total} asked for (num_train + num_valid "
                f"+ num_test); no new one in the last {dry} draws, so the sequence space holds about {count}: "
                f"lower the sizes or lengthen the sequences"
            )
    if len(kept_inputs) == 1:
        return kept_inputs[0], kept_targets[0]
    return np.concatenate(kept_inputs), np.concatenate(kept_targets)


def _first_unseen_rows(inputs: np.ndarray, seen: set[bytes], limit: int) -> list[int]:
    """Indices of rows not in ``seen`` (adding them), in order, at most ``limit`` of them."""
    inputs = np.ascontiguousarray(inputs)
    keep: list[int] = []
    for index in range(inputs.shape[0]):
        key = inputs[index].tobytes()
        if key in seen:
            continue
        seen.add(key)
        keep.append(index)
        if len(keep) == limit:
            break
    return keep


def split_task_data(
    name: str,
    kind: str,
    inputs: np.ndarray,
    targets: np.ndarray,
    sizes: tuple[int, int, int],
    *,
    vocab_size: int,
    num_classes: int,
    pad_id: int | None,
    info: dict[str, Any],
) -> TaskData:
    """Cut distinct rows into train / held-out / test (in that order) and wrap them as long tensors."""
    num_train, num_valid, num_test = sizes
    x = torch.as_tensor(np.ascontiguousarray(inputs), dtype=torch.long)
    y = torch.as_tensor(np.ascontiguousarray(targets), dtype=torch.long)
    bounds = (0, num_train, num_train + num_valid, num_train + num_valid + num_test)
    parts = [(x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return TaskData(
        name=name,
        kind=kind,  # type: ignore[arg-type]
        train_inputs=parts[0][0],
        train_targets=parts[0][1],
        valid_inputs=parts[1][0],
        valid_targets=parts[1][1],
        vocab_size=vocab_size,
        num_classes=num_classes,
        pad_id=pad_id,
        test_inputs=parts[2][0] if num_test else None,
        test_targets=parts[2][1] if num_test else None,
        info=info,
    )


def distinct_splits(
    name: str,
    kind: str,
    sample: Sampler,
    sizes: tuple[int, int, int],
    space_size: int | None = None,
    **split_options: Any,
) -> TaskData:
    """``draw_distinct`` rows from ``sample`` for every split at once, then ``split_task_data``
    (train, held-out, test in that order; ``split_options``: vocab_size, num_classes, pad_id, info)."""
    inputs, targets = draw_distinct(name, sample, sum(sizes), space_size)
    return split_task_data(name, kind, inputs, targets, sizes, **split_options)
