"""A training loop's data side: labels in a list of 200 k dicts, read by 2 forked workers
(``tests/integration/test_cli_run.py``, ``cudamem run``)."""

from torch.utils.data import DataLoader, Dataset


class Records(Dataset):
    def __init__(self, n):
        self.records = [{"id": i, "path": f"img_{i:07d}.jpg", "label": i % 10} for i in range(n)]

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]["label"]


loader = DataLoader(Records(200_000), batch_size=256, num_workers=2, shuffle=True)
seen = 0
for step, labels in enumerate(loader):
    seen += len(labels)
    if step == 300:
        break
