"""Test doubles of the parts a user has real ones of: used where a test is about pure logic."""
