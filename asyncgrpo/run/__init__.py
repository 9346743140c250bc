"""A run as stored in the bucket: its config, its prompts, and creating or loading it.

Modules:
    config    the run config: one pydantic model loaded from TOML, every field documented and bounded, with
              its `[dataset]` (prompt source, columns, chat template) and `[tracking]` tables
    reward_config  the `[[rewards]]` entries: reward functions by name, reward models (`model`) and their folders
    agent_config  the `[agent]` table: tools, environments, tool-call rounds, timeouts and the tool-call format
    datasets  prompt files (jsonl/json/csv/parquet) and the built-in prompt generators
    hub_datasets  Hub datasets and local dataset folders (save_to_disk, parquet/arrow) via `datasets`
    prompt_records  one dataset row -> one prompt record (prompt or chat, answer extraction)
    creation  `asyncgrpo run create` and `load_run` (config and prompts verified against the run manifest)
"""
