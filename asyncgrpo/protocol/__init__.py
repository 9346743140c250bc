"""What a worker needs to talk to the proxy: messages, records, errors, client, settings, logging.

Imports no redis, celery, fastapi, boto3 or torch (an import-linter contract checks it).

Modules:
    schemas    every JSON message: Celery task kwargs, HTTP request and response bodies
    records    the records stored in the bucket for other processes: rollout header, step record, eval record
    evals      the evaluate task, its lease and result messages, and the merge of chunk summaries
    queues     Celery task names and per-run queue names, each optimize worker's own queue
    errors     the error-code table (code, HTTP status, client exception) and the error body, shared by both ends
    input_bounds  limits on what a request may carry (numbers, lists, maps, valid UTF-8)
    client     the workers' HTTP client of the proxy: bounded retries, one exception per error code
    staleness  the staleness rule, used at admit, at claim and by the trainer
    incarnation  this process's incarnation, which tells a restarted worker from the process it replaced
    settings   the environment settings every process shares (`ASYNCGRPO_*`), on pydantic-settings
    log_setup  one structlog configuration per process (JSON or console)
"""
