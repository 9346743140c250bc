"""What a worker needs to talk to the proxy; imports no redis, celery, fastapi or torch.

- ``schemas``: every JSON message of the protocol (task kwargs, HTTP request and response bodies).
- ``records``: the records stored in the bucket for other processes (rollout header, step record).
- ``errors``: the error-code table (code, HTTP status, client exception) shared by server and client.
- ``client``: the HTTP client of the proxy, with bounded retries.
- ``staleness``: the staleness rule, used at admit, at claim and by the trainer.
- ``log_setup``: one structlog configuration for every process.
"""
