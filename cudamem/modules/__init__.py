"""Memory per ``nn.Module``: the profiler (``profiler``: ``track_modules``), its results
(``profile``) and module-tree byte counts (``_tree_bytes``).

May use everything below ``ledger``: ``base``, ``native``, ``allocator``, ``holders``,
``spans``, ``host``, ``scalars``.
"""
