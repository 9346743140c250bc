"""What the tests share: fixture plugins (Redis, S3, the tiny model, coordinators), harnesses and doubles."""
