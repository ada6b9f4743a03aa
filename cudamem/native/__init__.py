"""cudamem's native code: the optional compiled span core, heap pass and C++ counter reader,
their sources (``src/``, one folder per extension, split by concern with headers), their
build, their per-user cache and the Python that serves wherever they do not.

May use: the standard library, torch (the reader's build and load), and nothing else of
cudamem: every other package may use this one.
"""
