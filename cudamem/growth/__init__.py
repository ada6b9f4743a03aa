"""Memory that grows: leak detection over spans (``detector``: ``leaks``, ``LeakSettings``,
``LeakWarning``) and comparing two results of one kind (``compare``: ``diff``).

May use everything below ``ledger``: ``base``, ``native``, ``allocator``, ``holders``,
``spans``, ``host``, ``scalars``.
"""
