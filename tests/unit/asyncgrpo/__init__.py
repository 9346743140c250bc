"""Unit tests of the shared package: config, datasets, keys, error codes, staleness, settings."""
