"""The proxy's HTTP face: the FastAPI app over the coordinator, its settings, and `serve()`.

Modules:
    app            routes, error mapping, the tick loop, `serve()`
    middleware     bearer-token auth and request timing/logging, as plain ASGI
    settings       the proxy's environment variables
    version_watch  `GET /v1/versions/latest`: the long poll that tells generate workers of a new version
"""
