"""The device ledger: nvidia-smi reconciled with PyTorch (``device``: ``explain``,
``fragmentation``, ``machine_status``), free space and fragmentation (``free_space``),
giving memory back (``reclaim``: ``release``), snapshots for the memory viewer
(``memviz``), NVML (``nvml``, the only module that imports ``pynvml``) and the OOM
post-mortem (``oom``).

May use every capability below it (``base`` … ``growth``, ``modules``).
"""
