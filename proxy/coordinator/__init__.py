"""The coordinator: one run's state machine in Redis, one module per seam around a small store.

Read it top down; an import-linter contract keeps this order (nothing calls up it):
`service` (the facade the HTTP app calls, the round it runs) > the seams (leases, generate tasks, rollouts,
steps and versions, evaluations, snapshot and rebuild, retention, status) > `redis_store` > `scripts` >
`leadership` | keys, errors, metrics, dispatch.

Every change to the state is one Lua script (`lua/<name>.lua`, with `prelude.lua` prepended; its header is the
one statement of its KEYS, ARGV and reply fields), declared in `scripts` with the exception of every refusal.
Four writes are single Redis commands instead, atomic on their own and outside any invariant: a lease's
first-use time (`leases`, HSETNX), the corrupt-object check a halt waits on (`versions`, HSET/HDEL), an evaluate
task's failure report (`evaluations`, ZADD XX) and the trackers' progress (`proxy.tracking.forwarder`, HSET).

Modules:
    service         `Coordinator` (the facade the HTTP app and tests call; a missing state is rebuilt here),
                    `Housekeeping` (the round `tick()` runs) and `StateRestorer`
    leases          grant, renew, release and expire leases on adapter versions; first-use latency
    generate_tasks  dispatch generate tasks (requeue line, seeded prompt order), cancel, expire; in-flight pacing
    rollouts        admit a rollout iff fresh enough; rejection reasons as bounded labels
    steps           claim a step, serve its batch, send and re-send it, its holder and failure reports, publish
                    (CAS) its version; published versions: recorded sha, step record, corruption repair
    evaluations     `[eval]`: due versions, evaluate tasks, their leases, re-sends and records; GC protection
    snapshot        the snapshot document, its group-commit writer and reader; the rebuild of an empty Redis
                    from it (or from the versions in the bucket) and which newer versions a rebuild adopts
    retention       collect old adapter versions and rollout objects past their retention
    status          `/v1/status`, `/v1/run` and `/v1/workers`: views of the state; worker heartbeats
    leadership      one live proxy per run: its lease in Redis and its fencing epoch
    redis_store     `RedisStore`: the Redis client, key names, clock, record TTL, bound scripts, change counter;
                    the run's halt
    scripts         the Lua scripts declared (answers, the exception of each other code), how a script's header
                    is parsed and checked, and how a script is loaded, registered and called
    redis_keys      every Redis key name of a run (`RunKeys`)
    errors          one exception per refusal (non-OK script code) and per coordinator failure
    dispatch        send Celery tasks by name (never importing worker code)
    metrics         the proxy's Prometheus metrics, read from Redis at scrape time
"""
