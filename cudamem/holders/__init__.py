"""Who holds a tensor: the live-storage census (``census``), the holder search over the
object graph (``finder``: ``who_holds``, ``find_graph_holders``; ``_search``,
``_graph_paths``, ``_naming``, ``_autograd``, ``_storages``), holder paths (``holder_path``)
and the culprits grouping (``culprits``).

May use ``base``, ``native`` and ``allocator``.
"""
