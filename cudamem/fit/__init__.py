"""Will it fit: ``plan`` (``planner``), its result ``MemoryPlan`` (``memory_plan``) and the
arithmetic and step choice behind them (``_terms``, ``_steps``); the steps on the device
(``_runner``), the forward hooks that cut a step into phases and cost its modules
(``_forwards``), and ``restore=True``'s host copy (``_restore``).

May use ``ledger`` and everything below it.
"""
