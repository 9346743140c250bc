"""The proxy's HTTP face: the FastAPI app over the coordinator, its settings, and `serve()`.

Modules:
    app          routes (the eval tasks' too; the fleet's are async, awaited on the loop, the trainer's and
                 the operator's synchronous, in FastAPI's threads), the tick loop, `serve()` and what it checks
                 before anything listens (the token, Redis eviction, conditional writes, leadership) and
                 keeps while serving (leadership)
    edge         what every request passes: bearer-token auth, the body limit (the body read once, handed
                 on in the scope), timing and logging (plain ASGI); the fleet's routes validated in one pass
                 and answered past the router (FleetRoute, FleetDispatch); which coordinator refusal is which
                 error code, the error body and its handlers
    openapi      `/openapi.json` as the proxy answers: the bearer scheme and every error answer with its body
    settings     the proxy's environment variables
    version_watch  `GET /v1/versions/latest`, the new-version long poll: its waiters, the one watcher that
                 re-reads Redis for them, and the server that answers them all when it stops
"""
