"""The who-holds guide's examples (docs/guide/who-holds.md).

The holder search is about Python objects, so every part but the last runs on CPU tensors,
on any machine. The last part (what the census does not see: autograd-only storages and
cuBLAS workspaces against the allocator's bytes) runs only on a GPU.
"""

import torch

import cudamem

torch.manual_seed(0)

print("=== saved ===")
x = torch.ones((8192, 8192), dtype=torch.float32)  # device="cuda" in the seed: 256 MiB
saved = [x]
del x
print(cudamem.who_holds(saved[0]))
del saved

print("=== inner ===")
w = torch.randn(1024, 1024, requires_grad=True)
loss_history = []
for step in range(10):
    loss = torch.sigmoid(w * 2).mean()
    loss_history.append(loss)  # keeps the graph: sigmoid's 4 MiB output is saved

inner = loss_history[3].grad_fn.next_functions[0][0]._saved_result
print(cudamem.who_holds(inner))
del inner

print("=== census ===")
census = cudamem.live_tensors(holders=True)
print("\n".join(str(census).splitlines()[:5]))  # the first rows of the table
print(f"... {len(census)} storages in all")
del census

print("=== detach ===")
outputs = []
for step in range(3):
    output = torch.sigmoid(w * 2)
    outputs.append(output.detach())
del output
print(cudamem.who_holds(outputs[0]))

print("=== model ===")
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU())
optimizer = torch.optim.Adam(model.parameters())
model(torch.randn(8, 1024)).sum().backward()
optimizer.step()
print(cudamem.who_holds(model[0].weight))
print()
print(cudamem.who_holds(optimizer.state[model[0].weight]["exp_avg"]))

print("=== frames ===")


def evaluate(batch):
    cache = {"last": batch[:2]}  # noqa: F841 (a frame local holding a view: named below)
    return cudamem.who_holds(batch)


print(evaluate(torch.ones(4, 1024)))

print("=== cycle ===")


class Node:
    pass


a, b = Node(), Node()
a.other, b.other = b, a  # a reference cycle: only gc.collect() frees it
b.payload = torch.ones(1000)
probe = b.payload
del a, b
print(cudamem.who_holds(probe))
del probe

if torch.cuda.is_available():
    print("=== unaccounted ===")
    w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    loss_history = []
    for _ in range(10):
        loss = torch.sigmoid(w * 2).mean()
        loss_history.append(loss)
    print(cudamem.unaccounted(0))

    print("=== cublas ===")
    torch._C._cuda_clearCublasWorkspaces()
    a = torch.randn(1024, 1024, device="cuda")
    b = a @ a
    torch.cuda.synchronize()
    print(cudamem.unaccounted(0))
