"""Kernel tests: the interpreter set-up lives in tests/conftest.py (it must happen before any test
module imports triton)."""
