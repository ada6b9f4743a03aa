"""The sequential-training recipe (docs/recipes/sequential-training.md): seed 001's model
trained three times in one process, without and with ``del optimizer``, then on a new stream
per run. It measures what ``release()`` gives back to CUDA, so it needs a GPU.
"""

import sys

import torch

import cudamem

if not torch.cuda.is_available():
    sys.exit("sequential.py: this example needs a CUDA GPU")


class NaiveN(torch.nn.Module):
    def __init__(self, nx):
        super().__init__()
        self.lin1 = torch.nn.Linear(nx, nx)
        self.lin2 = torch.nn.Linear(nx, 1)
        self.act = torch.nn.ReLU()

    def forward(self, x):
        o = self.act(self.lin1(x))
        o = self.act(self.lin2(x))  # the seed's code: lin1's output is unused
        return o


dev = torch.device("cuda:0")


def one_run():
    global model, optimizer, x, y, loss
    model = NaiveN(1024).to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.ones(1024, 1024, device=dev)
    y = torch.ones(1024, 1, device=dev)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()


for k in range(3):
    one_run()
    del loss, x, y, model  # ... and the optimizer?
    if k == 2:
        print("=== keep ===")  # the same after each run
    print(cudamem.release())

del optimizer
cudamem.release()
for k in range(3):
    one_run()
    del loss, x, y, model, optimizer
    if k == 2:
        print("=== del ===")
    print(cudamem.release())

print("=== streams ===")
for k in range(3):
    s = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(s):
        one_run()
        del loss, x, y, model, optimizer
torch.cuda.synchronize()
print(cudamem.explain())
