"""Tasks: data generators and corpora. Each task is a typed config with ``build(seed) -> TaskData``."""

from sparsefocus.tasks.base import TASKS, TaskData, build_task, register_task, task_config_class

__all__ = ["TASKS", "TaskData", "build_task", "register_task", "task_config_class"]
