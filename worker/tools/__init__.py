"""The `asyncgrpo` command line and the tools it runs for people.

Modules:
    cli            the `asyncgrpo` command line
    local_run      `asyncgrpo local CONFIG`: any run config on one machine, live progress, summary, resume
    demo           `asyncgrpo demo`: `asyncgrpo local` on the embedded tiny-model config
    local_cluster  runs Redis, the proxy and workers as local processes (local runs and tests)
    status         `asyncgrpo status`
    step_records   reads step and eval records back from the bucket
    plot           `asyncgrpo plot`
    export         `asyncgrpo export`
"""
