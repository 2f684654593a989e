"""What several test modules share: plain functions and classes, imported as `helpers.<module>` (tests/ is on
sys.path under pytest). Fixtures live in tests/conftest.py; a test module never imports another test module."""
