"""The README's 30-second example, as printed there (docs/output/quickstart*.txt is its output).

On a machine without a GPU it runs on the CPU: who_holds names the list the same way, and the
span and explain() say that there is no CUDA device to measure.
"""

import torch

import cudamem

device = "cuda" if torch.cuda.is_available() else "cpu"

saved = []
with cudamem.track("create") as span:
    x = torch.ones((8192, 8192), device=device)  # 256 MiB
    saved.append(x)
print(span)

del x  # the list still holds it: nothing is freed
print(cudamem.who_holds(saved[0]))  # __main__.saved[0]

loss_history = cudamem.ScalarLogger()  # instead of a list of loss tensors (graphs stay alive)
print(cudamem.explain())  # nvidia-smi's number, line by line: reserve, context, cache, tensors
