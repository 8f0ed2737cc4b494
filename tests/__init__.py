"""Cadence's pytest suite, a package so that its folders import each other by full name
(`tests.support.helpers`, `tests.unit.test_scheduler`) from the repository root, which
pytest puts on sys.path (`pythonpath` in pyproject.toml)."""
