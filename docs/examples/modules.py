"""The per-module guide's example (docs/guide/modules.md): where in a GPT-2 the memory goes.

On a GPU: a 4-layer, 512-wide GPT-2 (built from a config: nothing is downloaded), batch 8 of
512 tokens, AdamW. Without a GPU the same code runs a 1-layer, 32-wide one on CPU tensors,
with live CPU storages standing in for the allocator's counters (what the integrations'
``device='cpu'`` does), so that the bytes are real there too.
"""

import contextlib
import sys
import warnings

import torch

try:
    import transformers
except ImportError:
    sys.exit("modules.py: this example needs transformers: pip install 'cudamem[transformers]'")

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.integrations._cpu import CpuStorageBackend

transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames
torch.manual_seed(0)
cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
counting = contextlib.ExitStack()
if not cuda:  # count live CPU storages: the CPU has no allocator counters
    counting.enter_context(_backend.use(CpuStorageBackend()))
shape = dict(n_layer=4, n_embd=512, n_head=8) if cuda else dict(n_layer=1, n_embd=32, n_head=2)
batch, seq = (8, 512) if cuda else (2, 16)


def build(checkpointing: bool = False):
    config = transformers.GPT2Config(vocab_size=50257 if cuda else 256, n_positions=seq, **shape)
    model = transformers.GPT2LMHeadModel(config).to(device)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


ids = torch.randint(0, 256, (batch, seq), device=device)
model, opt = build()


def step() -> None:
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


step()  # the first step creates AdamW's state (and, on a GPU, cuBLAS's workspaces)

print("=== profile ===")
with cudamem.track_modules(model, optimizer=opt) as prof:
    for _ in range(2):
        step()
print(prof.profile)

print("=== top ===")
for row in prof.profile.top(3):
    print(row)

print("=== checkpointing ===")
model, opt = build(checkpointing=True)
step()
with cudamem.track_modules(model) as ckpt:
    step()
before = prof.profile.module("GPT2LMHeadModel.transformer.h.0")
after = ckpt.profile.module("GPT2LMHeadModel.transformer.h.0")
print(f"h.0 without checkpointing: {before}")
print(f"h.0 with checkpointing:    {after}")
print(ckpt.profile.module("GPT2LMHeadModel.transformer.h.0.mlp.c_fc"))
counting.close()
