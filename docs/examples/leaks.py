"""The leak guide's examples (docs/guide/leaks.md).

Growth detection watches the CUDA allocator, so its part (seed 000's two loops caught live, a
clean loop, one span's leftovers) runs only on a GPU. ``track(..., leaks=True)`` compares the
live storages at a span's entry and exit, which works on CPU tensors too: that part runs on
the CPU, on any machine.
"""

import sys
import warnings

import torch

import cudamem

torch.manual_seed(0)
warnings.simplefilter("always", cudamem.LeakWarning)
warnings.showwarning = lambda message, *a, **k: print(f"LeakWarning: {message}\n")

if torch.cuda.is_available():
    print("=== train-step ===")
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    loss_history = []
    for step in range(8):
        with cudamem.track("train_step"):
            loss = torch.sigmoid(x * 2).mean()
            loss_history.append(loss)  # seed 000's leak
        mib = torch.cuda.memory_allocated() / 2**20
        print(f"step {step}: allocated {mib:.1f} MiB", file=sys.stderr)

    print("=== val-step ===")
    outputs = []
    for step in range(8):
        with cudamem.track("val_step"):
            with torch.no_grad():
                output = torch.sigmoid(x * 2)
            outputs.append(output.detach())  # stays on the GPU

    print("=== clean-step ===")
    logger = cudamem.ScalarLogger()
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)
    ).cuda()
    opt = torch.optim.Adam(model.parameters())
    for step in range(200):
        with cudamem.track("clean_step"):
            loss = model(torch.randn(256, 1024, device="cuda")).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            logger.append(loss)
    print("clean loop: 200 steps, no warning above for clean_step")

    print("=== one-step ===")
    with cudamem.track("one_step", leaks=True) as span:
        loss_history.append(torch.sigmoid(x * 2).mean())
    print(span.leaks)
    del x, loss_history, outputs, output, loss, model, opt, logger, span

# -- on the CPU: what did this block leave behind? ------------------------------------------
print("=== leaks-true ===")
x = torch.randn(1024, 1024, requires_grad=True)  # on a GPU: device="cuda"
loss_history = []
for step in range(3):
    with cudamem.track("train_step", leaks=True) as span:
        loss = torch.sigmoid(x * 2).mean()
        loss_history.append(loss)
print(span.leaks)

print("=== leaks-since ===")
outputs = []
with cudamem.track("val_step", leaks=True) as span:
    output = torch.sigmoid(x * 2)
    outputs.append(output.detach())
outputs.clear()
print(cudamem.leaks(since=span))
