"""The test suite, one package per layer (tests/conftest.py marks each test with its layer)."""
