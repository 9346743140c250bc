"""Real Redis for tests: a private redis-server on a free port."""
