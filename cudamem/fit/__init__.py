"""Will it fit: ``plan`` (``planner``), its result ``MemoryPlan`` (``memory_plan``) and the
arithmetic and step choice behind them (``_terms``, ``_steps``).

May use ``ledger`` and everything below it.
"""
