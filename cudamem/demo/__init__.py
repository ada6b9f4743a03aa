"""The two seed user stories as experiments with PASS/FAIL checks: the front end that only
``python -m cudamem demo`` (and tests) import; ``import cudamem`` loads none of it.

* ``seeds``: the experiments themselves (seed 000's loss history, seed 001's nvidia-smi
  numbers);
* ``seed001_runs``: seed 001's candidate causes, each run in a fresh process
  (``python -m cudamem.demo.seed001_runs CASE DEVICE``);
* ``render``: their text for the command line.
"""

from __future__ import annotations

from .registry import Check, Experiment
from .render import render_experiment, render_summary
from .seed000 import seed000_lifecycle
from .seed001 import NaiveN
from .seeds import experiments, run_demo

__all__ = [
    "Check",
    "Experiment",
    "NaiveN",
    "experiments",
    "render_experiment",
    "render_summary",
    "run_demo",
    "seed000_lifecycle",
]
