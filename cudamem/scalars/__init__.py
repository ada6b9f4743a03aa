"""Logging scalars without keeping graphs alive: ``log_scalar`` and ``ScalarLogger``
(``logger``).

May use ``base``, ``native``, ``allocator`` and ``holders``.
"""
