"""Integration tests: real Redis, a real bucket (file://, SeaweedFS or moto) and real torch, in one process."""
