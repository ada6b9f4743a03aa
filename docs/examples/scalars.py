"""The logging guide's examples (docs/guide/logging.md), on CPU tensors (any machine).

ScalarLogger, log_scalar, to_host and find_graph_holders work the same on a GPU; on the CPU
the values are the same, only the device buffers are host memory.
"""

import torch

import cudamem

torch.manual_seed(0)

print("=== scalar-logger ===")
x = torch.randn(1024, 1024, requires_grad=True)
history = cudamem.ScalarLogger()
for _ in range(10):
    loss = torch.sigmoid(x * 2).mean()
    history.append(loss)  # was: loss_history.append(loss)

print(len(history), f"{history.last:.4f}", f"{history.mean():.4f}")
print(type(history[0]).__name__, history[-3:] == [history[7], history[8], history[9]])
print(history.stats)

print("=== what-it-keeps ===")
recent = cudamem.ScalarLogger(maxlen=1000)
everything = cudamem.ScalarLogger()
for step in range(1_000_000):
    recent.append(step * 0.5)
    everything.append(step * 0.5)

print(recent.stats)
print(everything.stats)
print(len(recent), recent[0], recent.summary()[0].count)
del recent, everything

print("=== series ===")
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data, target = torch.randn(64, 8), torch.randn(64, 1)

with cudamem.ScalarLogger(flush_every=64) as log:
    for step in range(100):
        out = model(data)
        loss = torch.nn.functional.mse_loss(out, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        log.log_dict({"loss": loss, "out_mean": out.mean()}, step=step)
        if step % 50 == 0:
            log.log("lr", opt.param_groups[0]["lr"], step=step)

print(log)
print(log["loss"].steps[:3], log["lr"].items())

print("=== log-scalar ===")
print(cudamem.log_scalar(torch.tensor([0.25])), cudamem.log_scalar(True))
try:
    cudamem.log_scalar(torch.zeros(2, 3))
except ValueError as exc:
    print(f"ValueError: {exc}")

print("=== to-host ===")
x = torch.randn(1024, 1024, requires_grad=True)
outputs = [cudamem.to_host(torch.sigmoid(x * 2)) for _ in range(3)]
print(outputs[0].grad_fn, outputs[0].device, outputs[0].shape)

print("=== to-host-cycles ===")
out = torch.randn(4, requires_grad=True) * 2
state = {"out": out, "again": out}
state["self"] = state  # a structure that contains itself
host = cudamem.to_host(state)
print(host["self"] is host, host["out"] is host["again"], host["out"].grad_fn)

print("=== graph-holders ===")
del history, loss, out, outputs, state, host
x = torch.randn(1024, 1024, requires_grad=True)
loss_history = []
for _ in range(10):
    loss_history.append(torch.sigmoid(x * 2).mean())

print(cudamem.find_graph_holders())
