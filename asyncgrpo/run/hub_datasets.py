"""``dataset.hub_id``: prompts from a Hugging Face Hub dataset or a local dataset folder, read at ``run create``.

Three spellings, one field: a Hub id (``openai/gsm8k``, with ``subset``/``split``/``revision``), a folder
written by ``Dataset.save_to_disk``/``DatasetDict.save_to_disk`` (recognised by its ``dataset_dict.json`` or
``state.json`` + ``dataset_info.json``; read with ``load_from_disk``), or any other local folder of
parquet/arrow/json/csv files (``load_dataset(folder)``, which names splits after the files). A relative folder
resolves against the config file's folder; an existing folder wins over a Hub id of the same spelling, as in
``datasets`` itself.

``datasets`` is imported here only, lazily: the proxy runs without it unless a run names ``hub_id``. The
rows become prompt records (``asyncgrpo.run.prompt_records``) that ``run create`` freezes into the bucket, so
neither the proxy nor any worker reads the dataset again.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import structlog

from asyncgrpo.run.config import DatasetConfig
from asyncgrpo.run.prompt_records import PromptFileError, PromptRecord, RecordSpec

log = structlog.get_logger()

INSTALL_HINT = "pip install 'asyncgrpo[hub]'"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def load_hub_dataset(config: DatasetConfig, base_dir: Path | None = None) -> list[PromptRecord]:
    """The records of ``config.hub_id``'s split, first ``config.max_rows`` rows only when set."""
    assert config.hub_id is not None
    datasets = _import_datasets()
    folder = _local_folder(config.hub_id, base_dir)
    if folder is not None and _saved_to_disk(folder):
        table, source = _load_saved(datasets, folder, config), str(folder)
    elif folder is not None:
        table, source = _load(datasets, str(folder), config), str(folder)
    elif _HUB_ID.match(config.hub_id):
        table, source = _load(datasets, config.hub_id, config), config.hub_id
    else:
        raise PromptFileError(
            f"dataset.hub_id={config.hub_id!r} is neither an existing local folder nor a Hub dataset id "
            "(org/name); fix the path or the id"
        )
    if config.max_rows is not None and len(table) > config.max_rows:
        table = table.select(range(config.max_rows))
    spec = RecordSpec.of(config)
    where = f"{source} split {config.split!r}"
    spec.check_columns(where, list(table.column_names))
    records = [spec.record(where, f"row {index}", row) for index, row in enumerate(table)]
    if not records:
        raise PromptFileError(f"{where} has no rows; pick another dataset.split")
    log.info("run.dataset_loaded", source=source, subset=config.subset, split=config.split, rows=len(records))
    return records


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise PromptFileError(
            f"dataset.hub_id needs the `datasets` library, which is not installed: {INSTALL_HINT}"
        ) from None
    return datasets


def _local_folder(hub_id: str, base_dir: Path | None) -> Path | None:
    path = Path(hub_id).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if path.is_dir():
        return path
    if path.exists():
        raise PromptFileError(
            f"dataset.hub_id={hub_id!r} is a file ({path}); use dataset.path for a prompt file, hub_id for a folder"
        )
    if hub_id.startswith((".", "/", "~")):
        raise PromptFileError(f"dataset.hub_id={hub_id!r}: folder {path} does not exist")
    return None


def _saved_to_disk(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    )


def _load_saved(datasets: Any, folder: Path, config: DatasetConfig) -> Any:
    for name in ("subset", "revision"):
        if getattr(config, name) is not None:
            raise PromptFileError(
                f"dataset.{name} does not apply to {folder}, a folder written by save_to_disk; remove it"
            )
    loaded = datasets.load_from_disk(str(folder))
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded  # one saved Dataset is one split, whatever its name
    if config.split not in loaded:
        present = ", ".join(repr(name) for name in loaded) or "none"
        raise PromptFileError(f"dataset.split={config.split!r} is not a split of {folder}; splits present: {present}")
    return loaded[config.split]


def _load(datasets: Any, source: str, config: DatasetConfig) -> Any:
    what = f"{source!r} (dataset.subset={config.subset!r}, dataset.split={config.split!r})"
    try:
        return datasets.load_dataset(source, name=config.subset, split=config.split, revision=config.revision)
    except ValueError as error:
        # datasets lists the choices in these messages: "Unknown split ... Should be one of [...]",
        # "BuilderConfig 'x' not found. Available: [...]", "Config name is missing ... among [...]".
        message = str(error)
        lowered = message.lower()
        field = "dataset.split" if "split" in lowered else "dataset.subset" if "config" in lowered else "dataset"
        raise PromptFileError(f"{field}: cannot load {what}: {message}") from None
    except (OSError, ConnectionError) as error:  # not found, offline, no such revision
        raise PromptFileError(
            f"dataset.hub_id: cannot load {what}: {error}. Check the id and dataset.revision, the network, "
            "and HF_DATASETS_OFFLINE / HF_TOKEN for private datasets"
        ) from None
