"""The proxy's HTTP face: the FastAPI app over the coordinator, its settings, and `serve()`.

Modules:
    app            routes (the evaluate tasks' and the new-version long poll too), the tick loop, `serve()`
    edge           what every request passes: bearer-token auth, the body limit, timing and logging (plain
                   ASGI); which coordinator refusal is which error code, the error body and its handlers
    guards         start-up checks (Redis eviction policy, create-only writes, leadership); keeping leadership
    openapi        `/openapi.json` as the proxy answers: the bearer scheme and every error answer with its body
    token_policy   which tokens the proxy serves with: blank, placeholder and short ones refused at start-up
    settings       the proxy's environment variables
"""
