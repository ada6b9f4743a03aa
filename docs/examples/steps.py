"""The span guide's step spans (docs/guide/spans.md, "Steps without a with block"). Run on a
GPU: python docs/examples/steps.py

A training loop whose step begins in one callback and ends in another has no ``with`` block
to put around it; ``cudamem.StepSpan`` measures it by calls.
"""

import sys

import torch

import cudamem

if not torch.cuda.is_available():
    sys.exit("steps.py: this example needs a CUDA GPU")
torch.manual_seed(0)

model = torch.nn.Sequential(
    torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)
).cuda()
opt = torch.optim.AdamW(model.parameters())


class Callbacks:
    """What a trainer calls: the step starts in one method and ends in another."""

    def __init__(self) -> None:
        self.step = cudamem.StepSpan("train step")

    def on_step_start(self) -> None:
        self.step.start()

    def on_step_end(self) -> None:
        span = self.step.stop()
        print(span)


print("=== steps ===")
cb = Callbacks()
for _ in range(3):
    cb.on_step_start()
    x = torch.randn(512, 2048, device="cuda")
    with cudamem.track("forward"):  # stays top-level: the step is detached from the stack
        loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    cb.on_step_end()
print("=== history ===")
print(cudamem.history())
