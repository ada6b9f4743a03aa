"""The leak guide's identity and culprit examples (docs/guide/leaks.md); CPU or GPU."""

import torch

import cudamem

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

# 1. The same storage, not the same address: gradients re-created by backward() after
#    zero_grad(set_to_none=True) often land where the old ones were.
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
model.to(device)
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(64, 256, device=device)


def step() -> None:
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


step()  # the optimizer's state
print("=== identity ===")
with cudamem.track("step", leaks=True) as span:
    step()
print(span.leaks)
step()  # frees those gradients and makes new ones, on a GPU at the same addresses
print(cudamem.leaks(since=span))

# 2. One culprit per container, however many items it has.
errors = []


def parse(i: int) -> None:
    batch = torch.randn(256, 256, device=device)  # kept alive by the traceback
    raise ValueError(f"bad record {i}: {batch.shape}")


step_outputs = []
with cudamem.track("validation", leaks=True) as span:
    for i in range(40):
        try:
            parse(i)
        except ValueError as exc:
            errors.append(exc)
        preds = torch.randn(64, 512, device=device)
        step_outputs.append({"preds": preds, "target": preds.argmax(-1)})
    del preds
report = str(span.leaks).splitlines()
print("=== containers ===")
print("\n".join(report[:5]))  # the summary and the culprits; the table lists 50 storages
