"""The coordinator: one run's state machine in Redis, one module per seam around a small store.

Read it top down; an import-linter contract keeps this order (nothing calls up it):
`service` (the facade the HTTP app calls, the round it runs) > `fleet` (the fleet's requests) > the seams (the
views it answers, leases and retention, generate tasks, rollouts, steps and versions, evals, snapshot and
leadership, rebuild, workers) > `redis_store` > `scripts` > metrics, dispatch.

Every change to the state is one Lua script (`lua/<seam>/<name>.lua`, beside the seam module of that name that
runs it, with `prelude.lua` prepended; its header is the one statement of its KEYS, ARGV and reply fields),
declared in `scripts` with the exception of every refusal. Scripts write through the prelude's `call()`, which
notes each change for the snapshot log (`snapshot_log`); so does `RedisStore.write_logged_field` (the
corrupt-object check a halt waits on, `steps`, and the trackers' progress, `proxy.tracking.forwarder`), which
refuses once Redis emptied. Two writes are Redis commands from Python instead, atomic on their own and outside
any invariant: a lease's first-use time (`leases`, HSETNX, not in the snapshot) and an
eval task's failure report (`evals`, ZADD XX, not in the snapshot). The proxy's leadership
(`snapshot`) runs two inline scripts of its own: it guards the state, it is not part of it.

Each request is answered one way. The fleet's (heartbeats, leases, renewals, releases, submits) are awaited
on the event loop, their five scripts bound to its asyncio client alone (`LoopScripts`, `AsyncBoundScript`);
every other script is bound to the synchronous client alone (`Scripts`), which the housekeeping round (a loop
task, run in a thread) and the trainer's and operator's routes use: they read and write the bucket, which blocks.
The group commit has one writer (`SnapshotWriter.write_through`); a submit awaits it on a future, never a thread.

Modules:
    service         `Coordinator` (the facade the HTTP app and tests call; a missing state is rebuilt here),
                    `Housekeeping` (the round `tick()` runs: each part its own `tick`), `StateRestorer`
    fleet           `FleetRequests`: the fleet's requests awaited on the event loop, over its asyncio Redis
                    client (one per loop), a missing state rebuilt (in a thread) and the request run again
    views           the views of the state, reads only: `/v1/run`, `/v1/status`, `/metrics`' gauges, a group
    leases          grant, renew, release and expire leases on adapter versions; first-use latency; retention:
                    collect old adapter versions and rollout objects that no lease, window or evaluation holds
    generate_tasks  dispatch generate tasks (requeue line, seeded prompt order), cancel, expire; in-flight pacing
    rollouts        admit a rollout iff fresh enough; rejection reasons as bounded labels
    steps           claim a step, serve its batch, send and re-send it, its holder and failure reports, publish
                    (CAS) its version; published versions: recorded sha, step record, corruption repair
    evals           `[eval]`: due versions, eval tasks, their leases, re-sends and records; GC protection
    snapshot        the snapshot document, its group-commit writer (log segments, and compactions) and reader
                    (the snapshot with its log applied); leadership: one live proxy per run, its key in Redis
                    and the fencing epoch every snapshot and segment put carries
    snapshot_log    what a log segment holds (the writes `call()` in `prelude.lua` notes), how segments replay
                    onto the snapshot document, and when the writer compacts
    rebuild         the rebuild of an empty Redis from the snapshot (or from the versions in the bucket) and
                    which newer versions a rebuild adopts
    workers         the fleet's heartbeats: each worker's last report (`/v1/workers`), liveness by role,
                    restarts told apart by incarnation
    redis_store     `RedisStore`: the Redis client, every key name of a run (`RunKeys`), clock, record TTL, bound
                    scripts (and `LoopScripts`, the fleet's, bound to an event loop's client), change counter; the
                    run's halt
    scripts         the Lua scripts declared (answers, the exception of each other code), one exception per
                    refusal, how a script's header is parsed and checked, and how a script is loaded, registered
                    and called
    dispatch        send Celery tasks by name (never importing worker code)
    metrics         the proxy's Prometheus metrics, read from Redis at scrape time
"""
