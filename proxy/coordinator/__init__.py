"""The coordinator: one run's state machine in Redis, one module per concern around a small store.

Every change to the state is one Lua script (`lua/<name>.lua`, with `prelude.lua` prepended), declared in
`scripts` with its KEYS, ARGV, answers and the exception of every other return code.

Modules:
    service         the `Coordinator` facade the HTTP app and the tests call
    housekeeping    `tick()`, the loop body: expire, reap dead workers' tasks, claim, dispatch, snapshot, send, GC
    redis_store     `RedisStore`: the Redis client, key names, clock, record TTL, bound scripts, rebuild on a miss;
                    the run's halt
    scripts         the Lua scripts declared (evaluations' too): KEYS, ARGV, answers, the exception of each other code
    lua_script      how a script is declared, loaded (`importlib.resources`), registered and called
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
    rebuild         restore an empty Redis from the snapshot, or from the versions in the bucket
    adoption        which newer versions a rebuild adopts: contiguous, and only batches the snapshot accounts for
    leadership      one live proxy per run: its lease in Redis and its fencing epoch
    pacing          how many groups to keep in flight plus buffered, from the measured trainer and generate times;
                    time credited to a full buffer and to a starved trainer
    dispatch        send Celery tasks by name (never importing worker code)
    metrics         the proxy's Prometheus metrics, read from Redis at scrape time
    versions        published versions: recorded manifest sha, the step record copied at publish, corruption repair
    evaluations     `[eval]`: due versions, evaluate tasks, their leases, re-sends and records; GC protection
"""
