"""The proxy: the coordinator of one run, and the protocol and storage every process shares.

Never imports `worker`, torch, transformers or peft (an import-linter contract in pyproject.toml checks it).

Packages:
    protocol     what a worker needs to talk to the proxy: messages, staleness, client, settings, logging
    storage      the bucket interface, its backends, keys and manifests
    run          the run config, prompt datasets, creating and loading a run
    coordinator  the run's state machine in Redis, its snapshot and rebuild, task dispatch
    tracking     experiment trackers (trackio, wandb, mlflow): each published step and eval result forwarded
    api          the FastAPI app, the proxy's settings and `serve()`
"""
