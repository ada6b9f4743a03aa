"""Host (CPU) memory: copies to the host (``copy``: ``to_host``), the process's memory from
``/proc`` (``procfs``), the host ledger (``ledger``) and dataloader workers (``workers``).

May use ``base``, ``native``, ``allocator`` and ``holders``.
"""
