"""The `asyncgrpo` command line and the tools it runs for people.

Modules:
    cli            the `asyncgrpo` command line
    demo           `asyncgrpo demo`: the whole system on one machine
    local_cluster  runs Redis, the proxy and workers as local processes (demo and tests)
    status         `asyncgrpo status`
    step_records   reads step records back from the bucket
    plot           `asyncgrpo plot`
    export         `asyncgrpo export`
"""
