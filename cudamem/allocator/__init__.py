"""The seam to PyTorch's caching allocator: the backend (``backend``: the only place that calls
``torch.cuda``), allocator counters (``stats``), device arguments (``device_arg``) and
reading allocator snapshots (``snapshot``).

May use ``base`` and ``native``.
"""
