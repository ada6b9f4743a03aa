"""Unit tests: fakes and hand-built results, no heap walks, no subprocesses."""
