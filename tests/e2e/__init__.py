"""End-to-end tests: real processes (proxy, Celery workers, Redis, SeaweedFS), most of them slow."""
