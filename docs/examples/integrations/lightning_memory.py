"""The Lightning guide's example (docs/guide/lightning.md): memory metrics in the CSV log and
a leak caught by its holder. Runs on the CPU (``device="cpu"`` counts CPU storages); on a GPU
drop ``device=`` and use ``accelerator="gpu"``."""

import csv
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as L
    from lightning.pytorch.loggers import CSVLogger
except ImportError:
    sys.exit("lightning_memory.py: this example needs lightning: pip install 'cudamem[lightning]'")

import cudamem
from cudamem.integrations.lightning import CudamemCallback

warnings.simplefilter("always", cudamem.LeakWarning)
warnings.filterwarnings("ignore", category=FutureWarning)  # lightning's, not ours
warnings.showwarning = lambda message, *a, **k: print(f"LeakWarning: {message}\n")
GPU = torch.cuda.is_available()


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(256, 1024)
        self.seen = []  # the bug: every step's output is kept

    def training_step(self, batch, batch_idx):
        (x,) = batch
        out = self.net(x)
        self.seen.append(out)
        loss = out.sigmoid().mean()
        self.log("loss", loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


model = Model()
logs = Path(tempfile.mkdtemp())
trainer = L.Trainer(
    accelerator="gpu" if GPU else "cpu",
    max_steps=8,
    log_every_n_steps=1,
    logger=CSVLogger(logs, name="demo"),
    callbacks=[CudamemCallback(device="auto" if GPU else "cpu")],
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
)
trainer.fit(model, DataLoader(TensorDataset(torch.randn(512, 256)), batch_size=64))

with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
    rows = [r for r in csv.DictReader(f) if r.get("cudamem/allocated_mib")]
# The host columns (host_rss_mib, host_uss_mib, workers_uss_mib) are the OS's figures and vary
# run to run: docs/guide/host.md shows them.
HOST = ("cudamem/host_", "cudamem/workers_", "cudamem/pinned_")
names = [c for c in rows[0] if c.startswith("cudamem/") and not c.startswith(HOST)]
print("step  " + "  ".join(n.removeprefix("cudamem/") for n in names))
for r in rows:
    print(f"{r['step']:>4}  " + "  ".join(f"{float(r[n]):>{len(n) - 8}.3f}" for n in names))
sys.stdout.flush()
