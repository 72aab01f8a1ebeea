"""The `make demo` scenario: driver, report and the script that runs them (demo/run.py)."""
