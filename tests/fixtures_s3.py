"""Real S3-compatible servers for tests."""
