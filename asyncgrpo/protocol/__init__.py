"""What a worker needs to talk to the proxy: messages, records, errors, client, settings, logging.

Imports no redis, celery, fastapi, boto3 or torch (an import-linter contract checks it).

Modules:
    schemas    every JSON message (task kwargs, HTTP bodies), request limits, task and queue names, staleness
    records    the records stored in the bucket for other processes: rollout header, step record, eval record
    evals      the eval task, its lease and result messages, and the merge of chunk summaries
    errors     the error-code table (code, HTTP status, client exception) and the error body, shared by both ends
    client     the workers' HTTP client of the proxy: bounded retries, one exception per error code; this
               process's incarnation
    settings   the environment settings every process shares (`ASYNCGRPO_*`), on pydantic-settings
    log_setup  one structlog configuration per process (JSON or console)
"""
