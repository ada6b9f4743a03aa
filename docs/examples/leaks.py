"""The leak guide's examples (docs/guide/leaks.md), on a GPU: seed 000's two loops caught live."""

import sys
import warnings

import torch

import cudamem

warnings.simplefilter("always", cudamem.LeakWarning)
warnings.showwarning = lambda message, *a, **k: print(f"LeakWarning: {message}\n")

x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
loss_history = []
for step in range(8):
    with cudamem.track("train_step"):
        loss = torch.sigmoid(x * 2).mean()
        loss_history.append(loss)  # seed 000's leak
    print(f"step {step}: allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB", file=sys.stderr)

outputs = []
for step in range(8):
    with cudamem.track("val_step"):
        with torch.no_grad():
            output = torch.sigmoid(x * 2)
        outputs.append(output.detach())  # stays on the GPU

logger = cudamem.ScalarLogger()
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1))
model.cuda()
opt = torch.optim.Adam(model.parameters())
for step in range(200):
    with cudamem.track("clean_step"):
        loss = model(torch.randn(256, 1024, device="cuda")).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        logger.append(loss)
print("clean loop: 200 steps, mean loss", round(logger.mean(), 4), "- no warning above for clean_step")

with cudamem.track("one_step", leaks=True) as span:
    loss_history.append(torch.sigmoid(x * 2).mean())
print(span.leaks)
