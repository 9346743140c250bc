"""Fixtures live in role-named plugin modules; this file only loads them."""

pytest_plugins = [
    "tests.fixtures_redis",
    "tests.fixtures_s3",
    "tests.fixtures_model",
    "tests.fixtures_coordinator",
    "tests.e2e_harness",
]
