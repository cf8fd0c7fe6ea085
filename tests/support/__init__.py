"""Fixtures and helpers several test files share, so that each is written once."""
