"""The `asyncgrpo` command line, the entry of every process, and the tools it runs for people.

The top floor: it imports `proxy`, `worker` and the shared `asyncgrpo`, and nothing imports it (import-linter
contracts in pyproject.toml). `python -m cli` is the same command as the `asyncgrpo` binary; `asyncgrpo proxy`
and `asyncgrpo worker` are the commands `python -m proxy` and `python -m worker` define.

Modules:
    main           the `asyncgrpo` command line: `proxy`, `worker`, `run create`, `local`, `demo`, `status`...
    local_run      `asyncgrpo local CONFIG`: any run config on one machine, live progress, summary, resume
    demo           `asyncgrpo demo`: `asyncgrpo local` on the embedded tiny-model config
    local_cluster  runs Redis, the proxy and workers as local processes (local runs and tests)
    status         `asyncgrpo status`
    scaler         `asyncgrpo scale-generate`: one host's generate worker units follow the proxy's wanted count
    history        reads a run's step and eval records back from the bucket (for status and plot)
    plot           `asyncgrpo plot`
    export         `asyncgrpo export`
"""
