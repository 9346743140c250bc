"""One adapter per experiment tracker (trackio, wandb, mlflow), each a thin layer over the library's own API.

The libraries are imported inside the adapters, only when a run reports to them, so the proxy runs without
any of them installed. Where they log to, and with which credentials, is each library's business, read from its
own environment variables (``TRACKIO_DIR``/``TRACKIO_SPACE_ID``, ``WANDB_API_KEY``/``WANDB_MODE``,
``MLFLOW_TRACKING_URI``); the proxy reads none of them. Every adapter resumes the tracker run of the same name,
so a restarted or stand-by proxy goes on with the run it left. An adapter is driven by one thread
(``proxy.tracking.forwarder``), so the libraries' per-thread current-run state is never shared.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar


@dataclass(frozen=True)
class TrackerRun:
    """What every tracker gets: where to log and the run config (the tracker run's config)."""

    project: str
    name: str
    config: dict[str, Any]


class Tracker:
    """The calls the forwarder makes; each may raise, the forwarder counts and retries."""

    name: ClassVar[str]
    module: ClassVar[str]
    """The library's import name; its pip extra is ``asyncgrpo[<name>]``."""

    def __init__(self, run: TrackerRun) -> None:
        self.run = run

    @classmethod
    def installed(cls) -> bool:
        if cls.module in sys.modules:  # imported already (find_spec refuses a module without a spec)
            return sys.modules[cls.module] is not None
        return importlib.util.find_spec(cls.module) is not None

    def _library(self) -> ModuleType:
        return importlib.import_module(self.module)

    def start(self) -> None:
        raise NotImplementedError

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_eval(self, metrics: dict[str, float], step: int) -> None:
        """An eval result of version ``step``; it may arrive after later steps were logged."""
        self.log(metrics, step)

    def finish(self) -> None:
        raise NotImplementedError


class TrackioTracker(Tracker):
    """trackio: local SQLite under ``TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``), or a Space."""

    name = "trackio"
    module = "trackio"

    def start(self) -> None:
        # The returned run, not trackio's module-level current run: that one lives in a context variable.
        # No CPU/GPU sampling: those would be the proxy's own, not the training's.
        self._run = self._library().init(
            project=self.run.project,
            name=self.run.name,
            config=self.run.config,
            resume="allow",
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def finish(self) -> None:
        self._run.finish()


class WandbTracker(Tracker):
    """Weights & Biases: the run's id is its name, resumed with ``resume="allow"``; x axis ``train/global_step``."""

    name = "wandb"
    module = "wandb"
    STEP = "train/global_step"
    """The x axis of every metric, as transformers' WandbCallback (which TRL logs through) defines it."""

    def start(self) -> None:
        wandb = self._library()
        self._run = wandb.init(
            project=self.run.project,
            name=self.run.name,
            id=self.run.name,
            resume="allow",
            config=self.run.config,
            # wandb would copy the process's stdout and stderr into the run: the proxy's logs, not the training's.
            settings=wandb.Settings(console="off"),
        )
        # Not wandb's own step (``log(step=)``): an eval result arrives after later steps were logged, and a
        # row logged below wandb's step is dropped, while one without a step takes the next, so two evals in a
        # row made wandb drop the next training step. wandb numbers its rows; we plot against our step.
        self._run.define_metric(self.STEP)
        self._run.define_metric("*", step_metric=self.STEP, step_sync=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log({**metrics, self.STEP: step})

    def finish(self) -> None:
        self._run.finish()


_MLFLOW_UNSAFE = re.compile(r"[^\w\-. /]")
RUN_TAG = "asyncgrpo_run"
"""The mlflow tag naming the tracker run, to find it again on resume."""


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"optimizer": {"learning_rate": 0.002}}`` -> ``{"optimizer.learning_rate": "0.002"}``."""
    params: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            params.update(flat_params(value, f"{prefix}{key}."))
        else:
            params[f"{prefix}{key}"] = str(value)
    return params


class MlflowTracker(Tracker):
    """MLflow: the experiment is the project; the run is found again by its ``asyncgrpo_run`` tag."""

    name = "mlflow"
    module = "mlflow"

    def start(self) -> None:
        mlflow = self._library()
        if mlflow.active_run() is not None:  # a start that failed half-way, retried
            mlflow.end_run()
        mlflow.set_experiment(self.run.project)
        found = mlflow.search_runs(
            experiment_names=[self.run.project],
            filter_string=f"tags.{RUN_TAG} = '{self.run.name}'",
            output_format="list",
        )
        if found:
            mlflow.start_run(run_id=found[0].info.run_id)
            return
        mlflow.start_run(run_name=self.run.name, tags={RUN_TAG: self.run.name})
        # Params are write-once in mlflow: only a new run gets them.
        mlflow.log_params(flat_params(self.run.config))
        mlflow.log_dict(self.run.config, "run_config.json")

    def log(self, metrics: dict[str, float], step: int) -> None:
        # mlflow names allow letters, digits, '_', '-', '.', ' ' and '/': 'eval/pass@1' becomes 'eval/pass_1'.
        self._library().log_metrics(
            {_MLFLOW_UNSAFE.sub("_", name): value for name, value in metrics.items()}, step=step
        )

    def finish(self) -> None:
        self._library().end_run()


TRACKERS: dict[str, type[Tracker]] = {cls.name: cls for cls in (TrackioTracker, WandbTracker, MlflowTracker)}
"""``tracking.report_to`` name -> adapter (a test keeps these equal to the config's choices)."""


def install_hint(name: str) -> str:
    return f"pip install 'asyncgrpo[{name}]'"
