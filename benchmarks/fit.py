"""Will it fit? ``cudamem.plan`` over a zoo of training steps, against the true largest
batch, under the whole card and under 40 % of it, and against Lightning's
``Tuner.scale_batch_size(mode="binsearch")`` and accelerate's ``find_executable_batch_size``.

The zoo (issue 44): nine training steps of different kinds, built from configs or plain torch
(no download), each with AdamW, its data made on the device inside the step, forward, loss,
backward, optimizer step, ``zero_grad(set_to_none=True)``:

* ``decoder``: a decoder-only LM, 8 layers, d 1024, 16 query heads / 4 kv heads (grouped-query
  attention, kv repeated, ``F.scaled_dot_product_attention``, causal), sequence 1024, vocab
  32000, bf16 autocast;
* ``encoder``: BERT-base (transformers ``BertConfig``, ``BertForMaskedLM``, SDPA), sequence 512;
* ``resnet50``: ResNet-50 at 224² (torchvision, ``weights=None``, where importable, else the
  same network in plain torch), BatchNorm;
* ``convnext``: a ConvNeXt (depthwise 7×7 convolutions, LayerNorm), dims 64-512, depths
  2-2-6-2, 224²;
* ``vit``: a ViT-S/16 (patches + ``nn.TransformerEncoder``, d 384, 12 layers, 6 heads), 224²,
  bf16 autocast;
* ``lstm``: an LSTM language model (``nn.LSTM``, 2 layers, hidden 1024), sequence 256, vocab
  8192;
* ``unet``: a UNet (4 levels down and up with skip connections, 32-512 channels, BatchNorm),
  128², 4 classes a pixel;
* ``mlp``: 6 × (``Linear(4096, 4096)`` + GELU), bf16 autocast with ``torch.amp.GradScaler``, n
  fp32 samples of 4096: its peak is in the optimizer step at small n;
* ``checkpointed``: a transformer, 6 layers, d 384, 6 heads, sequence 512, vocab 8192, each
  block under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

Matmuls run in TF32 (``torch.set_float32_matmul_precision("high")``) so that the largest
batch's step stays well under a second. For each model, on the card at hand, from a fresh
model each tool, with ``gc.collect()`` and ``empty_cache()`` between:

* first, one untimed step of a fresh model at batch 2 (``prime``: the process's first
  kernels and library handles load there, not in whichever tool runs first);
* cudamem: ``plan(step, model=, optimizer=)`` at its default sizes: its time, the step
  executions and the OOMs it saw; ``largest(0.0)`` and ``largest(0.05)`` and whether a plain
  step runs at each; the predicted peak allocated against the measured one at ¼, ½ and ⅘ of
  ``largest(0.0)``;
* the true largest: plain steps, each from an empty cache, from cudamem's margin-0 answer:
  upwards by 3 % until one runs out of memory (downwards by 3 %, 6 %, 12 %, ... until one
  runs if the answer does not), then bisected to the exact integer;
* 40 % of the card: ``largest_for(int(0.4 * total_memory))`` (``largest(0.0, memory=)`` where
  the plan has no ``largest_for``), then under ``set_per_process_memory_fraction(0.4)`` a plain
  step at it and the true largest under the cap, found the same way;
* peers (``--peers``; default decoder, resnet50, mlp): Lightning's binsearch (its defaults, 3
  steps a trial; again with ``max_val`` past twice the true largest where its default 8192
  stops it short, ``lightning max_val``) and accelerate's ``find_executable_batch_size(starting_batch_size=512)``
  (0.9× after each OOM), each from a fresh model.

Usage: ``python benchmarks/fit.py [--quick] [--models M ...] [--peers M ...] [--skip-peers]
[--out benchmarks/results/fit-zoo.json]``; ``--held-out`` runs the eight models held out of the
rules' tuning instead of the zoo (``--out benchmarks/results/fit-held-out.json``); ``--smoke`` runs one step of each model at n=2 on
the CPU at tiny sizes (what ``tests/unit/test_fit_zoo.py`` runs). The JSON is written after
each model (a run cut short keeps what it measured). The whole run is meant to take under 8
minutes on an H100 (about half of it Lightning's binsearch), ``--quick`` about 2.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import CUDA, emit, write_json

import cudamem
from cudamem.allocator import backend as _backend

Step = Callable[[int], torch.Tensor]
Loss = Callable[[int], torch.Tensor]
Device = torch.device | str


def settle() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the networks


class Block(nn.Module):
    """A pre-norm transformer block: causal SDPA with ``kv_heads`` key/value heads (each
    repeated for ``heads // kv_heads`` query heads), then a 4× GELU MLP."""

    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.kv = kv_heads * self.head_dim
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, d + 2 * self.kv, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([d, self.kv, self.kv], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class LM(nn.Module):
    """A decoder-only language model of ``Block`` s; ``checkpointed`` recomputes each block
    in the backward (``checkpoint(..., use_reentrant=False)``)."""

    def __init__(
        self, vocab: int, d: int, layers: int, heads: int, kv_heads: int, checkpointed: bool
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv_heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.checkpointed = checkpointed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(self.norm(x))


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


def resnet(depths: Sequence[int], width: int, classes: int = 1000) -> nn.Sequential:
    """ResNet-50's layout (``depths`` (3, 4, 6, 3), ``width`` 64) in plain torch."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    cin = width
    for i, depth in enumerate(depths):
        w = width * 2**i
        for j in range(depth):
            layers.append(Bottleneck(cin, w, 2 if j == 0 and i > 0 else 1))
            cin = 4 * w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d)
        self.pw1 = nn.Linear(d, 4 * d)
        self.pw2 = nn.Linear(4 * d, d)
        self.gamma = nn.Parameter(torch.full((d,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.pw2(F.gelu(self.pw1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


def convnext(dims: Sequence[int], depths: Sequence[int], classes: int = 1000) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0])]
    for i, (d, depth) in enumerate(zip(dims, depths, strict=True)):
        if i > 0:
            layers += [LayerNorm2d(dims[i - 1]), nn.Conv2d(dims[i - 1], d, 2, stride=2)]
        layers += [ConvNeXtBlock(d) for _ in range(depth)]
    layers += [
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.LayerNorm(dims[-1]),
        nn.Linear(dims[-1], classes),
    ]
    return nn.Sequential(*layers)


class ViT(nn.Module):
    def __init__(
        self, image: int, patch: int, d: int, layers: int, heads: int, classes: int = 1000
    ) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 1 + (image // patch) ** 2, d) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.encoder(x)[:, 0]))


class LSTMLM(nn.Module):
    """An RNN language model: embedding, ``cell`` (an LSTM, or a GRU), a linear head."""

    def __init__(
        self, vocab: int, embed: int, hidden: int, layers: int, cell: type[nn.RNNBase] = nn.LSTM
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.rnn = cell(embed, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(ids))
        return self.head(out)


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(),
    )


class UNet(nn.Module):
    def __init__(self, widths: Sequence[int], classes: int) -> None:
        super().__init__()
        self.down = nn.ModuleList()
        cin = 3
        for w in widths:
            self.down.append(_double_conv(cin, w))
            cin = w
        self.bottom = _double_conv(cin, 2 * cin)
        self.up = nn.ModuleList()
        self.merge = nn.ModuleList()
        for w in reversed(widths):
            self.up.append(nn.ConvTranspose2d(2 * w, w, 2, stride=2))
            self.merge.append(_double_conv(2 * w, w))
        self.out = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottom(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips), strict=True):
            x = merge(torch.cat([up(x), skip], dim=1))
        return self.out(x)


# --------------------------------------------------------------------------- the zoo


@dataclass
class Parts:
    """A model, its loss at batch ``n`` (data made on the device inside), and whether its
    step scales the loss (``GradScaler``)."""

    model: nn.Module
    loss: Loss
    scaled: bool = False


def _autocast(device: torch.device, on: bool) -> Any:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


def _lm_loss(model: nn.Module, device: torch.device, vocab: int, seq: int, bf16: bool) -> Loss:
    def loss(n: int) -> torch.Tensor:
        ids = torch.randint(0, vocab, (n, seq + 1), device=device)
        with _autocast(device, bf16):
            logits = model(ids[:, :-1])
            return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    return loss


def _image_loss(
    model: nn.Module, device: torch.device, image: int, classes: int, bf16: bool = False
) -> Loss:
    def loss(n: int) -> torch.Tensor:
        x = torch.randn(n, 3, image, image, device=device)
        y = torch.randint(0, classes, (n,), device=device)
        with _autocast(device, bf16):
            return F.cross_entropy(model(x).float(), y)

    return loss


def _decoder(
    device: torch.device, small: bool, *, layers: int = 8, compiled: bool = False
) -> Parts:
    vocab, d, heads, kv, seq = (128, 64, 4, 2, 16) if small else (32000, 1024, 16, 4, 1024)
    model: Any = LM(vocab, d, 2 if small else layers, heads, kv, checkpointed=False).to(device)
    if compiled:
        model = torch.compile(model, backend="aot_eager" if small else "inductor")
    return Parts(model, _lm_loss(model, device, vocab, seq, bf16=True))


def _checkpointed(device: torch.device, small: bool) -> Parts:
    vocab, d, layers, heads, seq = (64, 32, 2, 2, 16) if small else (8192, 384, 6, 6, 512)
    model = LM(vocab, d, layers, heads, heads, checkpointed=True).to(device)
    return Parts(model, _lm_loss(model, device, vocab, seq, bf16=False))


def _transformers() -> Any:
    """The ``transformers`` package, its warnings silenced (models from configs, no
    weights: it would warn about every one)."""
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def _encoder(device: torch.device, small: bool) -> Parts:
    transformers = _transformers()
    seq = 16 if small else 512
    if small:
        config: Any = transformers.BertConfig(
            vocab_size=128,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=32,
        )
    else:
        config = transformers.BertConfig()
    config._attn_implementation = "sdpa"
    model = transformers.BertForMaskedLM(config).to(device)
    return Parts(model, _labelled_loss(model, device, config.vocab_size, seq, bf16=False))


def _labelled_loss(
    model: nn.Module, device: torch.device, vocab: int, seq: int, bf16: bool
) -> Loss:
    """A transformers LM's own loss (``labels=`` the input ids) on ``n`` random sequences."""

    def loss(n: int) -> torch.Tensor:
        ids = torch.randint(0, vocab, (n, seq), device=device)
        with _autocast(device, bf16):
            return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]

    return loss


def _resnet50(device: torch.device, small: bool) -> Parts:
    image = 32 if small else 224
    try:
        import torchvision  # type: ignore[import-untyped, unused-ignore]

        model: nn.Module = torchvision.models.resnet50(weights=None)
    except ImportError:
        model = resnet((1, 1, 1, 1) if small else (3, 4, 6, 3), 8 if small else 64)
    model = model.to(device)
    return Parts(model, _image_loss(model, device, image, 1000))


def _convnext(device: torch.device, small: bool) -> Parts:
    dims, depths, image = (
        ((8, 16, 32, 64), (1, 1, 1, 1), 32) if small else ((64, 128, 256, 512), (2, 2, 6, 2), 224)
    )
    model = convnext(dims, depths).to(device)
    return Parts(model, _image_loss(model, device, image, 1000))


def _vit(device: torch.device, small: bool) -> Parts:
    image, patch, d, layers, heads = (32, 8, 32, 2, 2) if small else (224, 16, 384, 12, 6)
    model = ViT(image, patch, d, layers, heads).to(device)
    return Parts(model, _image_loss(model, device, image, 1000, bf16=True))


def _lstm(device: torch.device, small: bool) -> Parts:
    vocab, embed, hidden, seq = (64, 16, 32, 8) if small else (8192, 512, 1024, 256)
    model = LSTMLM(vocab, embed, hidden, 2).to(device)
    return Parts(model, _lm_loss(model, device, vocab, seq, bf16=False))


def _unet(device: torch.device, small: bool) -> Parts:
    widths, image, classes = ((4, 8, 16, 32), 32, 4) if small else ((32, 64, 128, 256), 128, 4)
    model = UNet(widths, classes).to(device)

    def loss(n: int) -> torch.Tensor:
        x = torch.randn(n, 3, image, image, device=device)
        y = torch.randint(0, classes, (n, image, image), device=device)
        return F.cross_entropy(model(x), y)

    return Parts(model, loss)


def _mlp(device: torch.device, small: bool) -> Parts:
    width = 64 if small else 4096
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers).to(device)

    def loss(n: int) -> torch.Tensor:
        x = torch.randn(n, width, device=device)
        with _autocast(device, True):
            return model(x).float().pow(2).mean()

    return Parts(model, loss, scaled=True)


# Held out: models no rule of ``cudamem.fit._steps`` was tuned on (``--held-out``), from
# transformers' and timm's own code, to test the rules where they were not fitted.


def _gpt2(device: torch.device, small: bool) -> Parts:
    transformers = _transformers()
    seq = 16 if small else 512
    if small:
        config: Any = transformers.GPT2Config(
            vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4
        )
    else:
        config = transformers.GPT2Config()  # GPT-2 small: 124 M, vocab 50257, tied head
    model = transformers.GPT2LMHeadModel(config).to(device)
    return Parts(model, _labelled_loss(model, device, config.vocab_size, seq, bf16=True))


def _t5(device: torch.device, small: bool) -> Parts:
    transformers = _transformers()
    source, target = (16, 8) if small else (512, 128)
    if small:
        config: Any = transformers.T5Config(
            vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4
        )
    else:
        config = transformers.T5Config()  # t5-small: d 512, 6 + 6 layers, vocab 32128
    config.pad_token_id = config.decoder_start_token_id = 0  # as t5-small's own config
    model = transformers.T5ForConditionalGeneration(config).to(device)
    vocab = config.vocab_size

    def loss(n: int) -> torch.Tensor:
        ids = torch.randint(0, vocab, (n, source), device=device)
        labels = torch.randint(0, vocab, (n, target), device=device)
        return model(input_ids=ids, labels=labels).loss  # type: ignore[no-any-return]

    return Parts(model, loss)


def _timm(name: str, tiny: Mapping[str, Any]) -> Callable[[torch.device, bool], Parts]:
    """timm's ``name`` at 224² (``tiny``: the keyword arguments that shrink it for a smoke
    step), no weights, bf16 autocast."""

    def make(device: torch.device, small: bool) -> Parts:
        import timm  # type: ignore[import-not-found, unused-ignore]

        kwargs = dict(tiny) if small else {}
        image = int(kwargs.pop("image", 224))
        model = timm.create_model(name, pretrained=False, num_classes=1000, **kwargs).to(device)
        return Parts(model, _image_loss(model, device, image, 1000, bf16=True))

    return make


def _gru(device: torch.device, small: bool) -> Parts:
    vocab, embed, hidden, seq = (64, 16, 32, 8) if small else (16384, 256, 768, 384)
    model = LSTMLM(vocab, embed, hidden, 3, cell=nn.GRU).to(device)
    return Parts(model, _lm_loss(model, device, vocab, seq, bf16=True))


def _moe(device: torch.device, small: bool) -> Parts:
    """A Mixtral-style mixture of experts from transformers' own code: 8 experts a layer,
    2 per token, grouped-query attention; how many tokens each expert gets depends on the
    router, so the per-sample bytes are the routing's, not a fixed shape's."""
    transformers = _transformers()
    seq = 16 if small else 512
    vocab, d, ff, layers, heads, kv, experts = (
        (128, 32, 64, 2, 4, 2, 4) if small else (32000, 768, 1536, 4, 12, 4, 8)
    )
    config = transformers.MixtralConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=2 * seq,
    )
    config._attn_implementation = "sdpa"
    model = transformers.MixtralForCausalLM(config).to(device)
    return Parts(model, _labelled_loss(model, device, config.vocab_size, seq, bf16=True))


def _wav2vec2(device: torch.device, small: bool) -> Parts:
    """wav2vec 2.0 base with a CTC head, from transformers' own code: a 7-layer convolution
    over raw 16 kHz audio (4 s, 64,000 samples a clip), then 12 transformer layers; 50
    labels a clip."""
    transformers = _transformers()
    samples, labels = (1600, 10) if small else (64000, 50)
    if small:
        config: Any = transformers.Wav2Vec2Config(
            vocab_size=32,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            conv_dim=(16, 16),
            conv_kernel=(10, 3),
            conv_stride=(5, 2),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
        )
    else:
        config = transformers.Wav2Vec2Config(vocab_size=32)
    model = transformers.Wav2Vec2ForCTC(config).to(device)
    vocab = config.vocab_size

    def loss(n: int) -> torch.Tensor:
        audio = torch.randn(n, samples, device=device)
        targets = torch.randint(1, vocab, (n, labels), device=device)  # 0 is CTC's blank
        with _autocast(device, True):
            return model(input_values=audio, labels=targets).loss  # type: ignore[no-any-return]

    return Parts(model, loss)


def _compiled(device: torch.device, small: bool) -> Parts:
    """The zoo's decoder LM with 4 layers, under ``torch.compile`` as users call it (no
    arguments: inductor on the GPU; ``aot_eager`` for the CPU's smoke step): a new batch
    size recompiles once (then the batch is dynamic), and inside the compiled graph the
    modules' hooks do not run."""
    return _decoder(device, small, layers=4, compiled=True)


@dataclass(frozen=True)
class Spec:
    label: str
    make: Callable[[torch.device, bool], Parts]
    #: Packages it cannot run without.
    needs: tuple[str, ...] = ()


MODELS: dict[str, Spec] = {
    "decoder": Spec("decoder LM, GQA 16/4, SDPA, bf16 @1024", _decoder),
    "encoder": Spec("BERT-base MLM @512", _encoder, ("transformers",)),
    "resnet50": Spec("ResNet-50 @224", _resnet50),
    "convnext": Spec("ConvNeXt (depthwise, LN) @224", _convnext),
    "vit": Spec("ViT-S/16 bf16 @224", _vit),
    "lstm": Spec("LSTM 2×1024 @256", _lstm),
    "unet": Spec("UNet 32-512 @128", _unet),
    "mlp": Spec("MLP 6×4096 bf16 + GradScaler", _mlp),
    "checkpointed": Spec("transformer, checkpointed @512", _checkpointed),
}
#: Models held out of the rules' tuning: ``--held-out`` runs them (not in the default zoo).
HELD_OUT: dict[str, Spec] = {
    "gpt2": Spec("GPT-2 small (transformers) bf16 @512", _gpt2, ("transformers",)),
    "t5": Spec("T5-small (transformers) 512 -> 128", _t5, ("transformers",)),
    "efficientnet": Spec(
        "EfficientNet-B0 (timm) bf16 @224",
        _timm("efficientnet_b0", {"image": 64}),
        ("timm",),
    ),
    "swin": Spec(
        "Swin-T (timm) bf16 @224",
        _timm(
            "swin_tiny_patch4_window7_224",
            {"embed_dim": 16, "depths": (1, 1, 1, 1), "num_heads": (1, 1, 1, 1)},
        ),
        ("timm",),
    ),
    "gru": Spec("GRU 3×768 bf16 @384", _gru),
    "moe": Spec("Mixtral-style MoE 8×2 (transformers) bf16 @512", _moe, ("transformers",)),
    "wav2vec2": Spec(
        "wav2vec 2.0 base, CTC (transformers) bf16, 4 s", _wav2vec2, ("transformers",)
    ),
    "mobilenetv3": Spec(
        "MobileNetV3-L (timm) bf16 @224", _timm("mobilenetv3_large_100", {"image": 64}), ("timm",)
    ),
    "compiled": Spec("decoder LM 4 layers, torch.compile, bf16 @1024", _compiled),
}
QUICK = ("mlp", "decoder", "convnext")
PEERS = ("decoder", "resnet50", "mlp")


def parts(name: str, device: Device = "cuda", small: bool = False) -> Parts:
    torch.manual_seed(0)
    return spec(name).make(torch.device(device), small)


def spec(name: str) -> Spec:
    """The zoo's model ``name``, or a held-out one."""
    return MODELS[name] if name in MODELS else HELD_OUT[name]


def train_step(model: nn.Module, loss: Loss, opt: torch.optim.Optimizer, scaled: bool) -> Step:
    """One training step at batch ``n``: the loss, backward, the optimizer step (through a
    ``GradScaler`` where ``scaled``), ``zero_grad(set_to_none=True)``; the loss detached."""
    device = next(model.parameters()).device
    scalers = [torch.amp.GradScaler(device.type)] if scaled else []

    def step(n: int) -> torch.Tensor:
        try:
            value = loss(n)
            if not scalers:
                value.backward()
                opt.step()
            else:
                scalers[0].scale(value).backward()
                scalers[0].step(opt)
                scalers[0].update()
        except BaseException:
            # A step that ran out of memory between ``unscale_`` and ``update`` leaves the
            # scaler mid-step (the next ``step`` would refuse): a fresh one, same scale.
            if scalers:
                scalers[0] = torch.amp.GradScaler(device.type, init_scale=scalers[0].get_scale())
            raise
        finally:
            opt.zero_grad(set_to_none=True)
        return value.detach()

    return step


def build(
    name: str, device: Device = "cuda", small: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer, Step]:
    """A fresh model of the zoo, its AdamW and ``step(n)``: one training step at batch ``n``
    (``small``: tiny dimensions, for a smoke run on the CPU)."""
    p = parts(name, device, small)
    opt = torch.optim.AdamW(p.model.parameters(), lr=1e-4)
    return p.model, opt, train_step(p.model, p.loss, opt, p.scaled)


def smoke(name: str, n: int = 2) -> dict[str, Any]:
    """One step of ``name`` at tiny sizes on the CPU: its loss and whether every trained
    parameter changed."""
    model, _, step = build(name, "cpu", small=True)
    before = [p.detach().clone() for p in model.parameters()]
    loss = float(step(n))
    changed = [
        not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters(), strict=True)
    ]
    return {
        "loss": loss,
        "finite": math.isfinite(loss),
        "changed": sum(changed),
        "params": len(changed),
    }


# --------------------------------------------------------------------------- plain steps


class Trials:
    """Plain steps at given sizes, each from an empty cache, remembered: whether it ran, its
    peak reserved, its peak allocated and its seconds."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.seen: dict[int, tuple[bool, int, int, float]] = {}

    def __call__(self, n: int) -> tuple[bool, int, int, float]:
        if n not in self.seen:
            settle()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            try:
                self.step(n)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                peaks = (torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated())
                self.seen[n] = (True, *peaks, seconds)
            except Exception as exc:
                if not _backend.get().is_oom(exc):
                    raise
                self.seen[n] = (False, 0, 0, time.perf_counter() - start)
            settle()
        return self.seen[n]

    def runs(self, n: int) -> bool:
        return self(n)[0]


def true_largest(fits: Callable[[int], bool], start: int) -> int:
    """The largest ``n`` with ``fits(n)``, from ``start`` (at least 1): upwards by 3 % until
    one does not fit (or downwards by 3 %, 6 %, 12 %, ... until one does), then bisected."""
    start = max(1, start)
    lo: int | None = None
    hi: int | None = None
    if fits(start):
        lo = start
        while hi is None:
            candidate = max(lo + 1, math.ceil(lo * 1.03))
            if fits(candidate):
                lo = candidate
            else:
                hi = candidate
    else:
        hi, step = start, 0.03
        while lo is None:
            if hi == 1:
                return 0
            candidate = max(1, min(hi - 1, math.floor(hi * (1 - step))))
            if fits(candidate):
                lo = candidate
            else:
                hi, step = candidate, min(0.5, 2 * step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _error(truth: int, answer: int) -> float | None:
    return (truth - answer) / truth if truth else None


# --------------------------------------------------------------------------- the tools


def largest_for(plan: Any, memory: int) -> dict[str, Any]:
    """``plan.largest_for(memory, margin=0.0)`` where the plan has it, else
    ``plan.largest(0.0, memory=memory)``."""
    method = getattr(plan, "largest_for", None)
    if method is None:
        return {"n": plan.largest(0.0, memory=memory), "assumptions": [], "text": None}
    answer = method(memory, margin=0.0)
    return {
        "n": int(getattr(answer, "n", answer)),
        "assumptions": list(getattr(answer, "assumptions", ())),
        "text": str(answer),
    }


def prime(name: str) -> float:
    """One untimed step of a fresh ``name`` at batch 2, before any tool is timed on it: the
    process's first kernels, cuBLAS and cuDNN handles load here, so that neither the first
    tool timed (cudamem) nor the later ones (the peers, which would find them loaded) pays
    for them. Its seconds."""
    _, _, step = build(name)
    start = time.perf_counter()
    step(2)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del step
    settle()
    return seconds


def run_cudamem(name: str, fraction: float) -> dict[str, Any]:
    model, opt, step = build(name)
    calls: list[int] = []

    def counted(n: int) -> torch.Tensor:
        calls.append(n)
        return step(n)

    settle()
    log(f"[{name}] cudamem.plan")
    start = time.perf_counter()
    plan = cudamem.plan(counted, model=model, optimizer=opt)
    seconds = time.perf_counter() - start
    print(plan, flush=True)
    l0, l5 = plan.largest(0.0), plan.largest(0.05)
    total = torch.cuda.get_device_properties(0).total_memory
    budget = int(fraction * total)
    capped = largest_for(plan, budget)
    out: dict[str, Any] = {
        "seconds": seconds,
        "steps": len(calls),
        "step_sizes": calls,
        "ooms": sum(1 for p in plan.probes if p.oom),
        "probes": [
            {
                "n": p.n,
                "role": p.role,
                "oom": p.oom,
                "allocated": p.allocated,
                "reserved": p.reserved,
                "retries": p.retries,
                "seconds": p.seconds,
                "error": p.error,
                "oom_allocated": p.oom_allocated,
                "oom_reserved": p.oom_reserved,
                "oom_requested": p.oom_requested,
            }
            for p in plan.probes
        ],
        # where the plan's time went beyond its steps: the state copied to the host and
        # back (restore=True), and the rest (collections, the module profile's hooks, the
        # fragmentation snapshot, the fit)
        "step_seconds": sum(p.seconds for p in plan.probes),
        "restore_seconds": plan.restore.seconds if plan.restore is not None else None,
        "allowance": getattr(plan, "allowance", None),
        "available": plan.available,
        "largest_0": l0,
        "largest_5": l5,
        "plan": str(plan),
    }
    trials = Trials(step)
    log(f"[{name}] plain steps at largest(0)={l0}, largest(0.05)={l5}")
    out["ran_0"], out["ran_5"] = trials.runs(l0), trials.runs(l5)
    out["step_seconds_at_largest_0"] = trials.seen[l0][3]
    peaks = {}
    for label, f in (("1/4", 0.25), ("1/2", 0.5), ("4/5", 0.8)):
        n = max(1, round(l0 * f))
        ran, _, allocated, _ = trials(n)
        predicted = plan.predict(n).allocated
        peaks[label] = {
            "n": n,
            "predicted": predicted,
            "measured": allocated if ran else None,
            "error": (predicted - allocated) / allocated if ran and allocated else None,
        }
    out["peaks"] = peaks
    errors = [p["error"] for p in peaks.values() if p["error"] is not None]
    out["worst_peak_error"] = max(errors, key=abs) if errors else None
    log(f"[{name}] true largest from {l0}")
    truth = true_largest(trials.runs, l0)
    out["true_largest"] = truth
    out["error"] = _error(truth, l0)
    out["plain_steps"] = len(trials.seen)

    n40 = capped["n"]
    log(f"[{name}] {fraction:.0%} of the card ({budget / 2**30:.1f} GiB): answer {n40}")
    settle()
    torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        under = Trials(step)
        ran40 = under.runs(n40) if n40 > 0 else None
        truth40 = true_largest(under.runs, max(1, n40))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    out["budget"] = {
        "fraction": fraction,
        "bytes": budget,
        "answer": n40,
        "assumptions": capped["assumptions"],
        "text": capped["text"],
        "ran": ran40,
        "true_largest": truth40,
        "error": _error(truth40, n40),
        "plain_steps": len(under.seen),
    }
    return out


def run_accelerate(name: str) -> dict[str, Any]:
    from accelerate.utils import find_executable_batch_size

    _, _, step = build(name)
    tried: list[int] = []
    failed: list[int] = []

    @find_executable_batch_size(starting_batch_size=512)  # type: ignore[untyped-decorator, unused-ignore]
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        try:
            step(batch_size)
        except Exception as exc:
            if _backend.get().is_oom(exc):
                failed.append(batch_size)
            raise
        torch.cuda.synchronize()
        return batch_size

    settle()
    start = time.perf_counter()
    answer = train()
    seconds = time.perf_counter() - start
    return {"answer": answer, "seconds": seconds, "trials": len(tried), "ooms": len(failed)}


class Sizes(torch.utils.data.Dataset[int]):
    """Lightning's data: a batch is its size alone (fetched at once, not item by item: a
    batch of a million samples would take seconds to collate)."""

    def __len__(self) -> int:
        return 1 << 24

    def __getitem__(self, index: int) -> int:
        return 1

    def __getitems__(self, indices: list[int]) -> list[int]:
        return [len(indices)]


def _first(batch: list[int]) -> int:
    return batch[0]


#: Lightning's binsearch stops at ``max_val`` (8192 by default, less its 5 % margin): where
#: the true largest lies past half of it, the run is repeated with ``max_val`` the power of
#: two past twice the true largest, so that both tools answer the same question.
LIGHTNING_MAX_VAL = 8192


def lightning_max_val(truth: int | None) -> int | None:
    """The ``max_val`` that lets Lightning's binsearch reach ``truth`` (``None``: its
    default already does)."""
    if truth is None or 2 * truth <= LIGHTNING_MAX_VAL:
        return None
    return 1 << math.ceil(math.log2(2 * truth))


def run_lightning(name: str, max_val: int | None = None) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    p = parts(name)  # Lightning makes its own optimizer (configure_optimizers)
    started: list[int] = []
    finished: set[int] = set()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = p.model
            self.batch_size = 2

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(
                Sizes(), batch_size=self.batch_size, collate_fn=_first
            )

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            n = int(batch)
            if n not in started:
                started.append(n)
            return p.loss(n)

        def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
            finished.add(int(batch))  # after backward and the optimizer step

    module = Module()
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        settle()
        start = time.perf_counter()
        answer = Tuner(trainer).scale_batch_size(
            module, mode="binsearch", max_val=max_val or LIGHTNING_MAX_VAL
        )
        seconds = time.perf_counter() - start
    ooms = len([n for n in started if n not in finished])  # a size that never finished
    return {
        "answer": answer,
        "seconds": seconds,
        "trials": len(started),
        "ooms": ooms,
        "max_val": max_val or LIGHTNING_MAX_VAL,
    }


# --------------------------------------------------------------------------- main


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def model_row(name: str, card: str, r: dict[str, Any]) -> list[str]:
    if "error_message" in r:
        return [name, card, r["error_message"]] + [""] * 9
    b = r["budget"]
    return [
        name,
        card,
        f"{r['seconds']:.2f} s",
        f"{r['steps']} / {r['ooms']}",
        str(r["largest_0"]),
        str(r["largest_5"]),
        str(r["true_largest"]),
        _pct(r["error"]),
        f"{'yes' if r['ran_0'] else 'NO'} / {'yes' if r['ran_5'] else 'NO'}",
        _pct(r["worst_peak_error"]),
        f"{b['answer']} / {b['true_largest']} / {_pct(b['error'])}",
        {True: "yes", False: "NO", None: "-"}[b["ran"]],
    ]


def run_smoke(names: Iterable[str]) -> None:
    for name in names:
        start = time.perf_counter()
        r = smoke(name)
        log(
            f"[{name}] loss {r['loss']:.4f}, {r['changed']}/{r['params']} parameters changed, "
            f"{time.perf_counter() - start:.2f} s"
        )
        if not r["finite"]:
            raise SystemExit(f"{name}: the loss is not finite")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--models", nargs="*", choices=[*MODELS, *HELD_OUT], help="only these models"
    )
    parser.add_argument(
        "--held-out",
        action="store_true",
        help=f"the models held out of the rules' tuning: {', '.join(HELD_OUT)}",
    )
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument(
        "--peers",
        nargs="*",
        choices=list(MODELS),
        default=list(PEERS),
        help="models the peers run on",
    )
    parser.add_argument("--skip-peers", action="store_true", help="no Lightning, no accelerate")
    parser.add_argument("--fraction", type=float, default=0.4, help="the smaller budget's share")
    parser.add_argument("--out", default="benchmarks/results/fit-zoo.json")
    parser.add_argument("--smoke", action="store_true", help="one tiny step of each on the CPU")
    args = parser.parse_args()
    models = args.models or (
        list(QUICK) if args.quick else list(HELD_OUT) if args.held_out else list(MODELS)
    )
    if args.smoke:
        run_smoke(models)
        return
    if not CUDA:
        print("benchmarks/fit.py needs a CUDA GPU (--smoke runs on the CPU)")
        return
    torch.set_float32_matmul_precision("high")
    card = torch.cuda.get_device_name()
    total = torch.cuda.get_device_properties(0).total_memory
    peers = [] if args.skip_peers else [m for m in args.peers if m in models]
    data: dict[str, Any] = {
        "commit": os.environ.get("GPU_COMMIT"),  # the tree's commit, where the caller says
        "card": card,
        "total_memory": total,
        "fraction": args.fraction,
        "tf32": True,
        "models": {},
        "peers": {},
    }
    rows: list[list[str]] = []
    peer_rows: list[list[str]] = []
    began = time.perf_counter()
    for name in models:
        log(f"[{name}] {spec(name).label}")
        entry: dict[str, Any] = {"label": spec(name).label, "held_out": name in HELD_OUT}
        try:
            entry["prime_seconds"] = prime(name)
            entry.update(run_cudamem(name, args.fraction))
        except Exception as exc:  # one model's failure must not lose the others
            entry["error_message"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            log(f"[{name}] failed: {entry['error_message']}")
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        settle()  # the model went with run_cudamem's frame
        data["models"][name] = entry
        rows.append(model_row(name, card, entry))
        if name in peers:
            results: dict[str, Any] = {}
            max_val = lightning_max_val(entry.get("true_largest"))
            tools: list[tuple[str, Callable[[], dict[str, Any]]]] = [
                ("lightning", functools.partial(run_lightning, name)),
                ("accelerate", functools.partial(run_accelerate, name)),
            ]
            if max_val is not None:
                tools.insert(
                    1, ("lightning max_val", functools.partial(run_lightning, name, max_val))
                )
            for tool, fn in tools:
                log(f"[{name}] {tool}")
                try:
                    results[tool] = fn()
                except ImportError as exc:
                    results[tool] = {"error": f"not installed: {exc}"}
                settle()
            data["peers"][name] = results
            truth = entry.get("true_largest")
            for tool, r in results.items():
                if "error" in r:
                    peer_rows.append([name, tool, r["error"], "", "", "", ""])
                    continue
                speedup = ""
                if tool.startswith("lightning") and "seconds" in entry:
                    r["speedup_of_cudamem"] = r["seconds"] / entry["seconds"]
                    speedup = f"{r['speedup_of_cudamem']:.1f}×"
                peer_rows.append(
                    [
                        name,
                        tool,
                        f"{r['seconds']:.2f} s",
                        f"{r['trials']} / {r['ooms']}",
                        str(r["answer"]),
                        _pct(_error(truth, r["answer"])) if truth else "-",
                        speedup,
                    ]
                )
        data["seconds"] = time.perf_counter() - began
        write_json({**data, "partial": True}, args.out)  # a run cut short keeps what it has
        log(f"[{name}] done, {data['seconds']:.0f} s so far")
    emit(
        f"Will it fit? the zoo on {card} ({total / 2**30:.0f} GiB)",
        [
            "model",
            "card",
            "plan",
            "steps / OOMs",
            "largest(0)",
            "largest(0.05)",
            "true largest",
            "error",
            "ran at 0 / 0.05",
            "worst peak error ¼ ½ ⅘",
            f"{args.fraction:.0%}: answer / true / error",
            f"{args.fraction:.0%} ran",
        ],
        rows,
        data,
        args.out,
    )
    if peer_rows:
        emit(
            "Peers: the largest batch by Lightning's binsearch and accelerate",
            ["model", "tool", "time", "trials / OOMs", "answer", "error vs true", "cudamem faster"],
            peer_rows,
            data,
            args.out,
        )


if __name__ == "__main__":
    main()
