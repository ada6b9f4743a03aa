"""The Transformers guide's example (docs/guide/transformers.md): memory in the Trainer's log
history, and release_trainer() after train(). A 2-layer GPT-2 built from a config (nothing
is downloaded); CPU mode counts CPU storages, on a GPU drop ``device=`` and ``use_cpu``."""

import sys
import tempfile

import torch

try:
    import accelerate  # noqa: F401 - the Trainer needs it
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.utils import logging
except ImportError as exc:
    sys.exit(
        f"transformers_memory.py: this example needs {exc.name}: "
        "pip install 'cudamem[transformers]'"
    )

from cudamem.integrations.transformers import CudamemTrainerCallback, release_trainer

logging.set_verbosity_error()
GPU = torch.cuda.is_available()

HOST = ("cudamem/host_", "cudamem/workers_", "cudamem/pinned_")


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 1000, (64, 32), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
config = GPT2Config(
    vocab_size=1000, n_positions=64, n_embd=128, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
)
model = GPT2LMHeadModel(config)
args = TrainingArguments(
    output_dir=tempfile.mkdtemp(),
    use_cpu=not GPU,
    max_steps=4,
    per_device_train_batch_size=8,
    logging_steps=2,
    report_to=[],
    save_strategy="no",
    disable_tqdm=True,
)
trainer = Trainer(
    model=model,
    args=args,
    train_dataset=Tokens(),
    callbacks=[CudamemTrainerCallback(device="auto" if GPU else "cpu")],
)
trainer.train()
for entry in trainer.state.log_history:
    if "loss" in entry:
        # The host columns are the OS's figures, varying run to run (docs/guide/host.md).
        shown = {k: v for k, v in entry.items() if not k.startswith(HOST)}
        print({k: round(v, 3) for k, v in shown.items() if k in ("step", "loss") or "cudamem" in k})

print(release_trainer(trainer))  # the script's own `model` still holds the weights
del model
print(release_trainer(trainer))
