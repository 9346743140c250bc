"""A run as stored in the bucket: its config, its prompts, and creating or loading it.

Modules:
    config    the run config: one pydantic model loaded from TOML, every field documented and bounded
    datasets  prompt files (jsonl/json/csv/parquet) and the built-in prompt generators
    store     `asyncgrpo run create` and `load_run` (config and prompts verified against the run manifest)
"""
