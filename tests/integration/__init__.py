"""Integration tests on the CPU: real heap searches, censuses, subprocesses, frameworks."""
