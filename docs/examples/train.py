# docs: cudamem run --top 26 --html report.html
"""The command-line guide's example (docs/guide/cli.md): a training loop that keeps every loss.

Run it under ``cudamem run``; docs/gen_outputs.py does, with the options on the first line
(``--top 26``: the 26 storages of 4 MiB, two per step plus the first layer's weight and its
gradient, so that the list does not cut through storages of one size, whose order is not
fixed from run to run).
Each loss keeps its whole graph (``backward(retain_graph=True)``); on a GPU growth detection
names the list at the fifth step, on the CPU the report still names it among the storages
alive at exit.
"""

import torch

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)
).to(device)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)

loss_history = []
for step in range(12):
    x = torch.randn(1024, 1024, device=device)
    loss = torch.sigmoid(model(x) * 2).mean()
    opt.zero_grad()
    loss.backward(retain_graph=True)
    opt.step()
    loss_history.append(loss)  # keeps every step's graph alive
print("trained", len(loss_history))
