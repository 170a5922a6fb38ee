"""``train.shuffle``: false feeds the training examples in the task's order every epoch (the
Semantic Focus PTB runs feed their windows in corpus order); true reshuffles them every epoch."""

import torch
from torch import nn

from sparsefocus.tasks.base import TaskData
from sparsefocus.train.config import load_config
from sparsefocus.train.loop import train_epoch


class Recorder(nn.Module):
    """A classifier that remembers the first token of every row it is fed."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))
        self.seen: list[int] = []

    def forward(self, idx):
        self.seen += idx[:, 0].tolist()
        return self.weight.expand(idx.shape[0], 3)


def fed_order(shuffle: bool, epochs: int = 2) -> list[list[int]]:
    config = load_config(None, [f"train.shuffle={str(shuffle).lower()}", "train.batch_size=4"])
    rows = torch.arange(10)
    data = TaskData("toy", "classify", torch.stack([rows, rows], 1), rows % 3, rows[:2, None], rows[:2] % 3, 10, 3)
    model = Recorder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    generator = torch.Generator().manual_seed(0)
    orders = []
    for _ in range(epochs):
        model.seen = []
        train_epoch(model, optimizer, scheduler, data, config, generator)
        orders.append(model.seen)
    return orders


def test_shuffle_false_feeds_the_task_order_every_epoch():
    assert fed_order(shuffle=False) == [list(range(10))] * 2


def test_shuffle_true_feeds_a_new_permutation_every_epoch():
    first, second = fed_order(shuffle=True)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != list(range(10)) and first != second
