"""The who-holds guide's GPU examples (docs/guide/who-holds.md)."""

import torch

import cudamem

w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
loss_history = []
for _ in range(10):
    loss = torch.sigmoid(w * 2).mean()
    loss_history.append(loss)
print(cudamem.unaccounted(0))
print()
torch._C._cuda_clearCublasWorkspaces()
a = torch.randn(1024, 1024, device="cuda")
b = a @ a
torch.cuda.synchronize()
print(cudamem.unaccounted(0))
