"""The coordinator: one run's state machine in Redis, one module per concern around a small store.

Every change to the state is one Lua script (`lua/<name>.lua`, with `prelude.lua` prepended), declared in
`scripts` with its KEYS, ARGV, answers and the exception of every other return code.

Modules:
    service         the `Coordinator` facade the HTTP app and the tests call
    housekeeping    `tick()`, the loop body: expire, reap dead workers' tasks, claim, dispatch, snapshot, send, GC
    store           `RunStore`: the Redis client, key names, clock, record TTL, bound scripts, rebuild on a miss
    scripts         the Lua scripts declared: KEYS, ARGV, answers and the exception of every other code
    lua_script      how a script is declared, loaded (`importlib.resources`), registered and called
    redis_keys      every Redis key name of a run (`RunKeys`)
    errors          one exception per refusal (non-OK script code) and per coordinator failure
    leases          grant, renew, release and expire leases on adapter versions; first-use latency
    generate_tasks  dispatch generate tasks from the requeue line and the seeded prompt order; cancel, expire
    rollouts        admit a rollout iff fresh enough; rejection reasons as bounded labels
    steps           claim a step, serve its batch, publish (CAS) its version
    step_sending    send the in-flight step to the trainer holding its base; re-send it when its holder dies
    step_failures   a step's holder and failure reports: reject a bad rollout and un-claim, attempt limit, halt
    halt            the run's halt: a reason in the state hash that stops steps, set and cleared by its source
    workers         worker heartbeats and the `/v1/workers` list
    status          `/v1/status` and `/v1/run`: read-only views of the state
    retention       collect old adapter versions and rollout objects past their retention
    snapshot        the snapshot document, its group-commit writer and its reader (`runs/<run>/proxy/snapshot.json`)
    rebuild         restore an empty Redis from the snapshot, or from the versions in the bucket
    adoption        which newer versions a rebuild adopts: contiguous, and only batches the snapshot accounts for
    proxy_lease     one live proxy per run: the lease in Redis and its fencing epoch
    accounting      time credited to a full buffer (dispatch held back) and to a starved trainer
    pacing          how many groups to keep in flight plus buffered, from the measured trainer and generate times
    dispatch        send Celery tasks by name (never importing worker code); a recording double for tests
    metrics         the proxy's Prometheus metrics, read from Redis at scrape time
    versions        published versions: recorded manifest sha, the step record copied at publish, corruption repair
    evaluations     `[eval]`: due versions, evaluate tasks, their leases, re-sends and records; GC protection
    eval_scripts    the Lua scripts of evaluations, declared (part of `scripts.ALL_SCRIPTS`)
"""
