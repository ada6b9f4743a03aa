"""The ground floor: formatting, argument checks, warnings, the result-to-renderer registry
(``present``), plain data, item sequences and which frames are cudamem's own.

Imports nothing else of cudamem; everything above may use it.
"""
