"""The command line (``commands``): ``python -m cudamem demo | run | status | build-reader``.

The top floor: may use everything.
"""
