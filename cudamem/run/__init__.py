"""``cudamem run``: running a script or module under measurement (``runner``).

May use ``fit``, ``distributed`` and everything below; never ``render``.
"""
