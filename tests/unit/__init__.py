"""Unit tests: pure logic, no Redis and no bucket server, one folder per top package."""
