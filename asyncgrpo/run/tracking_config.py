"""The `[tracking]` table: which experiment trackers the proxy forwards step records and eval results to."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class TrackingConfig(BaseModel):
    # As every config section (config._Section): a misspelt field is an error, not an ignored default.
    model_config = ConfigDict(extra="forbid", frozen=True)

    report_to: list[Literal["trackio", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="Experiment trackers the proxy forwards each published step record and each eval result to, "
        "under TRL's metric names: any of 'trackio', 'wandb', 'mlflow' (a list, or one name); [] or 'none': "
        "none. Each needs its extra (pip install 'asyncgrpo[trackio]'); credentials and servers come from the "
        "library's own environment variables. A failing tracker never stops the run.",
    )
    project: str = Field(
        "asyncgrpo",
        min_length=1,
        max_length=128,
        description="Tracker project: the trackio and wandb project, the mlflow experiment.",
    )
    run_name: str = Field(
        "",
        pattern=r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127})?$",
        description="Name (and wandb id) of the tracker run: letters, digits, '.', '_', '-'; empty: the asyncgrpo "
        "run name. A restarted or stand-by proxy resumes this tracker run.",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _none_or_names(cls, value: object) -> object:
        # TRL's report_to takes one string or a list; "none" means no tracker. "all" (every installed
        # integration) is refused: which trackers a run reports to should not depend on what is installed.
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            if value == ["none"]:
                return []
            if "all" in value:
                raise ValueError("'all' is not accepted: list the trackers to report to ('trackio', 'wandb', 'mlflow')")
            duplicates = sorted({name for name in value if isinstance(name, str) and value.count(name) > 1})
            if duplicates:
                raise ValueError(f"trackers {duplicates} are listed more than once; list each once")
        return value
