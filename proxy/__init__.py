"""The proxy: the coordinator of one run, its HTTP face and its experiment trackers.

Never imports `worker`, `cli`, torch, transformers or peft; it meets the workers over HTTP, Redis and the bucket,
in the vocabulary of `asyncgrpo` (protocol, bucket, run). Import-linter contracts in pyproject.toml check it.

Packages:
    coordinator  the run's state machine in Redis, its snapshot and rebuild, task dispatch
    tracking     experiment trackers (trackio, wandb, mlflow): each published step and eval result forwarded
    api          the FastAPI app, the proxy's settings and `serve()`
"""
