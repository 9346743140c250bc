"""Experiment trackers (``[tracking] report_to``): the proxy forwards each published step and eval result.

Modules:
    forwarder     one thread per tracker following the step and eval records in the bucket; progress in Redis
    trackers      the trackio, wandb and mlflow adapters, each library imported only when a run reports to it
    metric_names  a step record or eval record as a flat map under TRL's metric names
"""
