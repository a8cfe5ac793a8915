"""Free-form models for the ``seqpipe.to_sequential`` tests (none is an ``nn.Sequential``).

* ``LoopMLP``: a Python loop over a ``ModuleList``, a keyword argument (a mask and a
  scale), a long skip from the stem to the head, a glue weight, and a head tied to the
  stem;
* ``UNet``: a small convolutional U-Net whose encoder features skip to the decoder;
* ``ResNet``: a small ResNet with BatchNorm (train mode), written here (torchvision's
  wheel does not load under torch+cpu);
* ``gpt2``: Hugging Face GPT-2 from a tiny config (tied ``wte``/``lm_head``, attention
  mask as a keyword), dropout off so losses compare exactly;
* ``FlagNet`` (``flags``, ``flags-post``): a forward that branches in Python on its
  configuration (``Flags``), never on data;
* ``TableNet`` (``tables``): a module of constant tables (non-persistent buffers) called
  once per kind, and blocks called with a string, as Gemma 3's rotary embedding;
* ``RoutedNet`` (``routed``): blocks that branch on tensor values, which no trace can
  enter (opaque units);
* ``TorchvisionResNet`` (``tvresnet``): torchvision's ResNet code with Bottleneck blocks,
  narrow (its wheel does not load here);
* ``ZOO``: the other architectures users bring, each from a tiny Hugging Face config (2
  layers, hidden 32, sequence 8, no weights downloaded), dropout off, in double precision:
  Llama (rotary, RMSNorm, GQA, tied head), Mistral (sliding window), Qwen2 (sliding window
  on one layer of two), BERT (``token_type_ids``, classification head), GPT-NeoX (partial
  rotary, parallel residual), OPT, T5 and BART (encoder-decoder), ViT (images), Gemma,
  Gemma 3 (sliding and full attention layers), Phi-3, GPT-J, RoBERTa, DistilBERT
  and ModernBERT (classification heads), Whisper (audio features into an
  encoder-decoder), ConvNeXt, Swin and DeiT (images), Mamba and RWKV (recurrent, their
  pure-PyTorch paths); and ``mixtral`` (mixture of experts) in bfloat16 and, as
  ``mixtral-fp32``, in float32 (its layers opaque). ``BY_HAND``: Mamba-2, checked the same
  way by hand. The table of docs/models.md ("Models tested") lists them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WIDTH, CLASSES = 16, 5


class LoopMLP(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(CLASSES, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(depth))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.gate = nn.Parameter(torch.full((WIDTH,), 0.5))
        self.head.weight = nn.Parameter(self.stem.weight.t().contiguous())
        self.tied = nn.Linear(WIDTH, CLASSES, bias=False)
        self.tied.weight = self.head.weight  # a tie across the first and last units

    def forward(self, x: Tensor, mask: Optional[Tensor] = None, scale: float = 1.0) -> Tensor:
        h = torch.tanh(self.stem(x))
        skip = h
        for block in self.blocks:
            h = h + torch.relu(block(h)) * self.gate
        if mask is not None:
            h = h * mask.unsqueeze(-1)
        h = self.norm(h + skip)
        return {"logits": self.head(h) * scale + self.tied(skip), "hidden": h}


class Conv(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.conv(x))


class UNet(nn.Module):
    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.down1, self.down2 = Conv(3, c), Conv(c, 2 * c)
        self.mid = Conv(2 * c, 2 * c)
        self.up2, self.up1 = Conv(4 * c, c), Conv(2 * c, c)
        self.out = nn.Conv2d(c, 2, 1)

    def forward(self, x: Tensor) -> Tensor:
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        m = self.mid(F.max_pool2d(d2, 2))
        u2 = self.up2(torch.cat([F.interpolate(m, scale_factor=2.0), d2], 1))
        u1 = self.up1(torch.cat([F.interpolate(u2, scale_factor=2.0), d1], 1))
        return self.out(u1)


class Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, width: int = 4, classes: int = CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(Basic(width, width, 1), Basic(width, width, 1))
        self.layer2 = nn.Sequential(Basic(width, 2 * width, 2), Basic(2 * width, 2 * width, 1))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Bottleneck(nn.Module):
    """torchvision's ``Bottleneck`` as written there (ResNet-50's block): one ``ReLU`` object,
    in place, called three times, and ``out += identity``."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TorchvisionResNet(nn.Module):
    """torchvision's ``ResNet`` as written there (its wheel does not load under torch+cpu
    here), narrow: the 7x7 stem, an in-place ``ReLU``, max pooling, four stages built by
    ``_make_layer``, ``AdaptiveAvgPool2d`` and ``torch.flatten`` before ``fc``."""

    def __init__(self, layers: Tuple[int, ...] = (1, 1, 1, 1), width: int = 4,
                 classes: int = CLASSES) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(2 * width, layers[1], stride=2)
        self.layer3 = self._make_layer(4 * width, layers[2], stride=2)
        self.layer4 = self._make_layer(8 * width, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width * Bottleneck.expansion, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


@dataclass(frozen=True)
class Flags:
    """A configuration the forward branches on in Python (never on data)."""

    pre_norm: bool = True  # pre-norm blocks and a final norm, or post-norm blocks
    gated: bool = True  # a sigmoid gate in every block
    skip_every: int = 2  # the stem's output added after every n-th block (0: never)
    aux: bool = True  # an extra head on the stem's output


class FlagBlock(nn.Module):
    def __init__(self, flags: Flags) -> None:
        super().__init__()
        self.flags = flags
        self.norm, self.fc = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Linear(WIDTH, WIDTH) if flags.gated else None

    def forward(self, h: Tensor) -> Tensor:
        y = self.fc(self.norm(h) if self.flags.pre_norm else h)
        if self.gate is not None:
            y = y * torch.sigmoid(self.gate(h))
        h = h + torch.relu(y)
        return h if self.flags.pre_norm else self.norm(h)


class FlagNet(nn.Module):
    def __init__(self, flags: Flags) -> None:
        super().__init__()
        self.flags = flags
        self.embed = nn.Linear(CLASSES, WIDTH)
        self.blocks = nn.ModuleList(FlagBlock(flags) for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH) if flags.pre_norm else None
        self.head = nn.Linear(WIDTH, CLASSES)
        self.aux = nn.Linear(WIDTH, CLASSES) if flags.aux else None

    def forward(self, x: Tensor) -> Tensor:
        h = stem = self.embed(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.flags.skip_every and i % self.flags.skip_every == 0:
                h = h + stem
        if self.flags.pre_norm:
            h = self.norm(h)
        out = self.head(h)
        return out + self.aux(stem) if self.aux is not None else out


class Tables(nn.Module):
    """Constant tables (buffers kept out of the state dict) looked up by a string: called
    once per kind, like Gemma 3's rotary embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("even", torch.linspace(0.5, 1.5, WIDTH), persistent=False)
        self.register_buffer("odd", torch.linspace(-1.0, 1.0, WIDTH), persistent=False)
        self.register_buffer("base", torch.full((WIDTH,), 0.75), persistent=False)

    def forward(self, h: Tensor, kind: str) -> Tensor:  # base: read by every kind's layer
        return torch.sigmoid(h) * getattr(self, kind) + self.base


class Keyed(nn.Module):
    """A block called with a string: export's record of a call takes no strings."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: Tensor, scale: Tensor, kind: str) -> Tensor:
        out = self.fc(h * scale)
        return h + (torch.tanh(out) if kind == "even" else torch.relu(out))


class TableNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.tables = nn.Linear(CLASSES, WIDTH), Tables()
        self.blocks = nn.ModuleList([Keyed(), Keyed()])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        scales = {kind: self.tables(h, kind) for kind in ("even", "odd")}
        for i, block in enumerate(self.blocks):
            kind = ("even", "odd")[i % 2]
            h = block(h, scales[kind], kind)
        return self.head(h)


class Routed(nn.Module):
    """A block whose branch depends on tensor values: no trace can enter it (opaque)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        if h.sum() > 0:
            return torch.tanh(self.up(h)) * mask
        return self.down(h)


class RoutedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(CLASSES, WIDTH)
        self.blocks = nn.ModuleList([Routed(), Routed()])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h, mask[:, None])
        return self.head(h)


def gpt2(layers: int = 2) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging
    logging.set_verbosity_error()
    config = GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


VOCAB, LENGTH, LABELS = 64, 8, 3
MELS, FRAMES = 8, 16  # Whisper: mel bins, input frames (twice its positions)


IMAGES = ("vit", "convnext", "swin", "deit")


def zoo_model(name: str) -> nn.Module:
    """``ZOO`` model ``name``, built on the current default device and dtype."""
    import transformers as hf
    from transformers.utils import logging
    logging.set_verbosity_error()
    ids = dict(pad_token_id=0, bos_token_id=0, eos_token_id=1)
    decoder = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                   **ids)
    bert = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if name == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(**decoder, tie_word_embeddings=True))
    if name == "mixtral":  # 4 experts, 2 per token
        return hf.MixtralForCausalLM(hf.MixtralConfig(**decoder, num_local_experts=4,
                                                      num_experts_per_tok=2))
    if name == "mistral":
        return hf.MistralForCausalLM(hf.MistralConfig(**decoder, sliding_window=4))
    if name == "qwen2":
        return hf.Qwen2ForCausalLM(hf.Qwen2Config(**decoder, use_sliding_window=True,
                                                  sliding_window=4, max_window_layers=1))
    if name == "bert":
        return hf.BertForSequenceClassification(hf.BertConfig(
            vocab_size=VOCAB, max_position_embeddings=32, type_vocab_size=2,
            num_labels=LABELS, **bert))
    if name == "neox":
        return hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=32, rotary_pct=0.5,
            hidden_dropout=0.0, attention_dropout=0.0, **ids))
    if name == "opt":
        return hf.OPTForCausalLM(hf.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
            num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=32,
            dropout=0.0, attention_dropout=0.0, **ids))
    if name == "t5":
        return hf.T5ForConditionalGeneration(hf.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    if name == "bart":
        return hf.BartForConditionalGeneration(hf.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=1, **ids))
    if name == "gemma":
        return hf.GemmaForCausalLM(hf.GemmaConfig(**decoder, head_dim=8))
    if name == "gemma3":  # one rotary embedding called per attention type
        return hf.Gemma3ForCausalLM(hf.Gemma3TextConfig(
            **decoder, head_dim=8, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"]))
    if name == "phi3":
        return hf.Phi3ForCausalLM(hf.Phi3Config(**decoder, resid_pdrop=0.0, embd_pdrop=0.0))
    if name == "gptj":
        return hf.GPTJForCausalLM(hf.GPTJConfig(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids))
    if name == "roberta":
        return hf.RobertaForSequenceClassification(hf.RobertaConfig(
            vocab_size=VOCAB, max_position_embeddings=40, type_vocab_size=1, num_labels=LABELS,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, **bert))
    if name == "modernbert":  # global and local rotary: one module called per kind
        return hf.ModernBertForSequenceClassification(hf.ModernBertConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=32, num_labels=LABELS,
            global_attn_every_n_layers=2, local_attention=4, embedding_dropout=0.0,
            mlp_dropout=0.0, attention_dropout=0.0, classifier_dropout=0.0, **ids))
    if name == "distilbert":
        return hf.DistilBertForSequenceClassification(hf.DistilBertConfig(
            vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
            max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
            seq_classif_dropout=0.0, num_labels=LABELS, pad_token_id=0))
    if name == "whisper":
        return hf.WhisperForConditionalGeneration(hf.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=MELS, d_model=32, encoder_layers=2,
            decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=FRAMES // 2,
            max_target_positions=32, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, decoder_start_token_id=1, **ids))
    if name == "convnext":
        return hf.ConvNextForImageClassification(hf.ConvNextConfig(
            num_channels=3, patch_size=2, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
            num_labels=LABELS, drop_path_rate=0.0))
    if name == "swin":
        return hf.SwinForImageClassification(hf.SwinConfig(
            image_size=8, patch_size=2, num_channels=3, embed_dim=8, depths=[1, 1],
            num_heads=[2, 2], window_size=2, num_labels=LABELS, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, drop_path_rate=0.0))
    if name == "deit":
        return hf.DeiTForImageClassification(hf.DeiTConfig(
            image_size=8, patch_size=4, num_channels=3, num_labels=LABELS, **bert))
    if name == "mamba":  # its pure-PyTorch scan (no CUDA kernels here)
        return hf.MambaForCausalLM(hf.MambaConfig(
            vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
            conv_kernel=3, time_step_rank=4, **ids))
    if name == "mamba2":
        return hf.Mamba2ForCausalLM(hf.Mamba2Config(
            vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
            conv_kernel=3, num_heads=8, head_dim=8, n_groups=1, chunk_size=4, **ids))
    if name == "rwkv":
        return hf.RwkvForCausalLM(hf.RwkvConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
            intermediate_size=64, context_length=32, **ids))
    assert name == "vit", name
    return hf.ViTForImageClassification(hf.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, num_labels=LABELS, **bert))


ZOO = ("llama", "mistral", "qwen2", "bert", "neox", "opt", "t5", "bart", "vit", "gemma", "phi3",
       "gptj", "roberta", "distilbert", "whisper", "convnext", "swin", "gemma3", "modernbert",
       "deit", "mamba", "rwkv")
# built and checked like ZOO, by hand (SEQPIPE_BY_HAND=1), not in CI: close kin of a ZOO model
BY_HAND = ("mamba2",)


def build(name: str) -> nn.Module:
    """A fresh model, the same on every call (and every rank), in double precision (GPT-2:
    float32)."""
    torch.manual_seed(0)
    if name in ZOO or name in BY_HAND or name == "t5-labels":
        return zoo_model(name.split("-")[0]).double()
    if name == "mixtral":  # bfloat16: torch's grouped_mm traces only that (see docs/models.md)
        return zoo_model(name).to(torch.bfloat16)
    if name == "mixtral-fp32":  # its layers cannot be traced: opaque units
        return zoo_model("mixtral").float()
    if name.startswith("flags"):  # flags: the defaults; flags-post: every flag the other way
        post = Flags(pre_norm=False, gated=False, skip_every=0, aux=False)
        return FlagNet(post if name == "flags-post" else Flags()).double()
    model = {"mlp": LoopMLP, "unet": UNet, "resnet": ResNet, "gpt2": gpt2,
             "routed": RoutedNet, "tables": TableNet,
             "tvresnet": lambda: TorchvisionResNet((2, 1, 1, 1))}[name]()
    return model.double() if name != "gpt2" else model


def _zoo_example(name: str, batch: int, gen: torch.Generator
                 ) -> Tuple[Tuple[Any, ...], Dict[str, Any], Tensor]:
    """The documented call of each ``ZOO`` model: a padded attention mask, ``use_cache=False``
    where the model has a cache, ``token_type_ids`` for BERT, decoder ids for T5/BART."""
    if name in IMAGES:
        images = torch.randn(batch, 3, 8, 8, generator=gen, dtype=torch.double)
        return (images,), {}, torch.randint(LABELS, (batch,), generator=gen)
    ids = torch.randint(2, VOCAB, (batch, LENGTH), generator=gen)
    mask = torch.ones(batch, LENGTH, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    target = torch.randint(VOCAB, (batch, LENGTH), generator=gen)
    if name == "whisper":
        features = torch.randn(batch, MELS, FRAMES, generator=gen, dtype=torch.double)
        dec = torch.randint(2, VOCAB, (batch, LENGTH), generator=gen)
        return (features,), {"decoder_input_ids": dec, "use_cache": False}, target
    if name in ("roberta", "distilbert", "modernbert"):
        return (ids,), {"attention_mask": mask}, torch.randint(LABELS, (batch,), generator=gen)
    if name == "bert":
        types = torch.zeros(batch, LENGTH, dtype=torch.long)
        types[:, LENGTH // 2:] = 1
        return (ids,), {"attention_mask": mask, "token_type_ids": types}, torch.randint(
            LABELS, (batch,), generator=gen)
    if name == "rwkv":  # no attention mask (RWKV ignores one)
        return (ids,), {"use_cache": False}, target
    kwargs: Dict[str, Any] = {"attention_mask": mask, "use_cache": False}
    if name in ("t5", "bart"):
        kwargs["decoder_input_ids"] = torch.randint(2, VOCAB, (batch, LENGTH), generator=gen)
    return (ids,), kwargs, target


def example(name: str, batch: int = 6, step: int = 0
            ) -> Tuple[Tuple[Any, ...], Dict[str, Any], Tensor]:
    """``(args, kwargs, target)`` of one batch for ``name``."""
    gen = torch.Generator().manual_seed(100 + step)
    if name == "t5-labels":  # labels instead of decoder_input_ids: the glue shifts them
        args, kwargs, target = _zoo_example("t5", batch, gen)
        del kwargs["decoder_input_ids"]
        return args, {**kwargs, "labels": target}, target
    if name in ZOO or name in BY_HAND or name.startswith("mixtral"):
        return _zoo_example(name, batch, gen)
    if name.startswith("flags") or name == "tables":
        x = torch.randn(batch, CLASSES, generator=gen, dtype=torch.double)
        return (x,), {}, torch.randint(CLASSES, (batch,), generator=gen)
    if name in ("mlp", "routed"):
        x = torch.randn(batch, CLASSES, generator=gen, dtype=torch.double)
        mask = (torch.rand(batch, generator=gen) > 0.2).double()
        target = torch.randint(CLASSES, (batch,), generator=gen)
        if name == "routed":
            return (x, mask), {}, target
        return (x,), {"mask": mask, "scale": 2.0}, target
    if name == "tvresnet":  # 64 pixels: 2 x 2 in layer4 (at 1 x 1, a micro-batch of 2 gives
        # BatchNorm two values per channel, so ill-conditioned that rounding grows to 1e-7)
        x = torch.randn(batch, 3, 64, 64, generator=gen, dtype=torch.double)
        return (x,), {}, torch.randint(CLASSES, (batch,), generator=gen)
    if name in ("unet", "resnet"):
        x = torch.randn(batch, 3, 8, 8, generator=gen, dtype=torch.double)
        if name == "unet":
            return (x,), {}, torch.randn(batch, 2, 8, 8, generator=gen, dtype=torch.double)
        return (x,), {}, torch.randint(CLASSES, (batch,), generator=gen)
    ids = torch.randint(64, (batch, 12), generator=gen)
    mask = torch.ones(batch, 12, dtype=torch.long)
    mask[0, :4] = 0
    return (ids,), {"attention_mask": mask, "use_cache": False}, torch.randint(
        64, (batch, 12), generator=gen)


# Mamba's heads return float32 logits whatever the model's dtype: the loss is taken in
# double on both sides, so that the pipeline's sum over micro-batches compares exactly
FLOAT_LOGITS = ("mamba", "mamba2")


def loss_of(name: str) -> Any:
    """The loss on the pipeline's output (the flat output: see docs/models.md)."""
    if name == "mlp":
        return lambda out, y: F.cross_entropy(out[0], y)
    if name == "unet":
        return F.mse_loss
    if name in ("resnet", "tvresnet", "routed", "tables") or name.startswith("flags"):
        return F.cross_entropy
    if name in ("t5", "bart", "whisper"):  # (logits, encoder_last_hidden_state)
        return lambda out, y: _token_loss(out[0], y)
    if name == "t5-labels":  # (loss, logits, encoder_last_hidden_state): its own loss
        return lambda out, y: out[0]
    if name in FLOAT_LOGITS:
        return lambda logits, y: _token_loss(logits.double(), y)
    return _token_loss


def _token_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Cross entropy per token ((batch, length, vocab) logits) or per sample."""
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def model_loss(name: str, output: Any, target: Tensor) -> Tensor:
    """The same loss on the model's own output."""
    if name == "mlp":
        return F.cross_entropy(output["logits"], target)
    if name in FLOAT_LOGITS:
        return _token_loss(output.logits.double(), target)
    if name == "t5-labels":
        return output.loss
    if name == "gpt2" or name.startswith("mixtral") or name in ZOO or name in BY_HAND:
        return _token_loss(output.logits, target)
    return loss_of(name)(output, target)
