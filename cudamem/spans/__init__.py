"""Spans: measured regions of code (``track``, ``MemorySpan``, ``StepSpan``) and everything a
span does on its way in and out.

A span reads three allocator counters (allocated, reserved, peak) of every device involved
when it opens and when it closes. The hot path keeps those raw integers in a ``RawSpan``
(``raw``); the frozen results (``SpanRecord``, ``DeviceSpan``: ``record``) are built the
first time someone reads them, so a span nobody looks at costs two counter reads and a few
attribute stores. ``python_path`` opens and closes spans in Python, the compiled span core
(``cudamem.native``) does the common case in C through the one table ``core`` hands it, and
``span`` switches between them. ``history`` keeps the finished top-level spans,
``leftovers`` is the type of a span's leak report.

Features attach through hooks rather than imports (``state``): growth detection and
``leaks=True`` and OOM post-mortems register entry/exit hooks, and the span history takes
the top-level spans from a queue ``state`` holds (``finished``, ``set_finished_sink``); no
module here imports them.

Peaks: PyTorch keeps one peak counter per device for the whole process. A span with
``peak=True`` resets it on entry, after folding the value it held into every open span (all
threads) and into cudamem's process-wide maximum, so nested spans never hide each other's
peaks; ``max_allocated`` gives the true process-wide peak. While every open span belongs
to one thread, nothing takes a lock; spans of several threads at once fold under one.

Stacks: each thread and asyncio task has its own chain of open spans (a context variable
holding the innermost one; each span knows its parent). A span closed on another thread, or
out of order, is simply marked closed; later spans skip closed ancestors, so nothing is ever
left stranded on a stack.

May use: the allocator seam, the base helpers, the native extensions (the span core), and
the holders' types; never a feature that hooks into spans (growth, OOM, modules).
"""
