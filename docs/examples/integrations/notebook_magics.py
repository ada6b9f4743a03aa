"""The notebook guide's session (docs/guide/notebooks.md), replayed in a real IPython shell:
each cell is printed after ``In [n]:`` and followed by what IPython showed."""

import sys

try:
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config
except ImportError:
    sys.exit("notebook_magics.py: this example needs IPython: pip install 'cudamem[notebook]'")

config = Config()
config.HistoryManager.enabled = False
config.InteractiveShell.colors = "nocolor"
shell = InteractiveShell.instance(config=config)

CELLS = [
    "%load_ext cudamem",
    "import torch, cudamem\ntorch.manual_seed(0)\nx = torch.randn(1024, 1024)",
    "%%track prepare --leaks\nbatch = torch.randn(512, 1024)\nfeatures = (batch @ x).relu()",
    "features[:2, :3]",
    "del features\n%who_holds Out[4]",
    "%forget out\nprint(cudamem.live_tensors('cpu', holders=True))",
    "def step():\n    activations = torch.zeros(2048, 1024)\n    raise RuntimeError('boom')",
    "step()",
    "print(cudamem.live_tensors('cpu', holders=True))",
    "%forget error\nprint(cudamem.live_tensors('cpu', holders=True))",
]

for source in CELLS:
    n = shell.execution_count
    print(f"In [{n}]: " + source.replace("\n", "\n" + " " * (len(str(n)) + 7)))
    shell.run_cell(source, store_history=True)
    print()
