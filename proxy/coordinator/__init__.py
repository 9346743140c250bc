"""The coordinator: one run's state machine in Redis, one module per seam around a small store.

Read it top down; an import-linter contract keeps this order (nothing calls up it):
`service` (the facade the HTTP app calls; it answers a missing state by rebuilding) > `housekeeping` (the round,
over parts handed in) > the seams (leases, generate tasks, rollouts, steps, versions, evaluations, snapshot
and rebuild, retention, pacing, status) > `redis_store` > `scripts` > `lua_script` > keys, errors, metrics.

Every change to the state is one Lua script (`lua/<name>.lua`, with `prelude.lua` prepended; its header is the
one statement of its KEYS, ARGV and reply fields), declared in `scripts` with the exception of every refusal.
Four writes are single Redis commands instead, atomic on their own and outside any invariant: a lease's
first-use time (`leases`, HSETNX), the corrupt-object check a halt waits on (`versions`, HSET/HDEL), an evaluate
task's failure report (`evaluations`, ZADD XX) and the trackers' progress (`proxy.tracking.forwarder`, HSET).

Modules:
    service         the `Coordinator` facade the HTTP app and the tests call; a missing state is rebuilt here
    housekeeping    the round `tick()` runs: expire, reap dead workers' tasks, claim, dispatch, snapshot, send, GC
    redis_store     `RedisStore`: the Redis client, key names, clock, record TTL, bound scripts, change counter;
                    the run's halt
    scripts         the Lua scripts declared (evaluations' too): their answers and the exception of each other code
    lua_script      how a script is declared, its header parsed and checked, loaded, registered and called
    redis_keys      every Redis key name of a run (`RunKeys`)
    errors          one exception per refusal (non-OK script code) and per coordinator failure
    leases          grant, renew, release and expire leases on adapter versions; first-use latency
    generate_tasks  dispatch generate tasks from the requeue line and the seeded prompt order; cancel, expire
    rollouts        admit a rollout iff fresh enough; rejection reasons as bounded labels
    steps           claim a step, serve its batch, publish (CAS) its version
    step_sending    send the in-flight step to the trainer holding its base; re-send it when its holder dies
    step_failures   a step's holder and failure reports: reject a bad rollout and un-claim, attempt limit, halt
    status          `/v1/status`, `/v1/run` and `/v1/workers`: views of the state; worker heartbeats
    retention       collect old adapter versions and rollout objects past their retention
    snapshot        the snapshot document, its group-commit writer and its reader (`runs/<run>/proxy/snapshot.json`)
    rebuild         restore an empty Redis from the snapshot, or from the versions in the bucket (`StateRestorer`)
    adoption        which newer versions a rebuild adopts: contiguous, and only batches the snapshot accounts for
    leadership      one live proxy per run: its lease in Redis and its fencing epoch
    pacing          how many groups to keep in flight plus buffered, from the measured trainer and generate times;
                    time credited to a full buffer and to a starved trainer
    dispatch        send Celery tasks by name (never importing worker code)
    metrics         the proxy's Prometheus metrics, read from Redis at scrape time
    versions        published versions: recorded manifest sha, the step record copied at publish, corruption repair
    evaluations     `[eval]`: due versions, evaluate tasks, their leases, re-sends and records; GC protection
"""
