"""Tiny, randomly initialised Hugging Face ``transformers`` models for the training tests, built from configs
(no downloads): hidden size 16-32, one or two layers, two heads, a vocabulary of 50, sequences of 8.

Each model is wrapped so that it takes its inputs positionally, in the order of :attr:`Case.inputs`, and
returns ``(loss, logits)``: the loss the model computes itself from its ``labels`` (CLIP's contrastive loss
takes none). Every config has dropout at 0, eager attention and no cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from tests.training.test_torchvision_models import _import_torchvision

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from configs; transformers would ask the Hub for kernels
_import_torchvision()  # transformers imports torchvision, whose CUDA-built C extension does not load here
import transformers as tf  # noqa: E402 - after the torchvision schemas are declared

BATCH, SEQ, VOCAB, CLASSES = 2, 8, 50, 3
FIRST = 3  # the smallest token drawn: 0-2 are the pad, start and end tokens of these configs
IMAGE = (3, 32, 32)
AUDIO = 400  # raw samples for Wav2Vec2
MELS, FRAMES = 8, 16  # Whisper's log-mel features (2 × max_source_positions frames)

# the fields most text configs take under these names
_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=16,
)
# the models dynamo exports: head_dim 16 and epsilons exact in float32, since dynamo writes Python scalars
# (the attention's 1/sqrt(head_dim), an RMSNorm's epsilon) as float32 constants
_LLAMA = dict(
    _TEXT,
    hidden_size=32,
    num_key_value_heads=1,
    hidden_act="silu",
    attention_dropout=0.0,
    pad_token_id=0,
    rms_norm_eps=2.0**-20,
)

# BART's generator and classifier (one encoder and one decoder layer)
_BART = dict(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
             decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16,
             pad_token_id=1, decoder_start_token_id=2)


class Wrapped(torch.nn.Module):
    """A Hugging Face model taking ``names`` positionally and returning ``(loss, logits)``."""

    def __init__(self, model: torch.nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model = model
        self.names = names

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kw = dict(zip(self.names, args))
        if "labels" not in kw:  # a contrastive model: its loss needs no labels
            out = self.model(**kw, return_loss=True)
            return out.loss, out.logits_per_image
        out = self.model(**kw)
        return out.loss, out.logits


@dataclasses.dataclass(frozen=True)
class Case:
    """One model: its builder (a config class and model class with the config's fields), its inputs (a
    kind: ``mlm``, ``cls``, ``clm``, ``seq2seq``, ``image_cls``, ``clip``, ``audio_cls``, ``speech``)
    and how it is trained and exported."""

    model: str
    config: str
    fields: dict[str, Any]
    kind: str
    optimizer: str = "SGD"
    dynamo: bool = False
    mask: bool = False  # an attention_mask input with padding at the end of the second row
    eos: int | None = None  # a sequence classifier pooling at this token
    f32_scalars: bool = False  # dynamo writes some of its Python float constants (tanh-GELU's) as float32

    def build(self, dropout: float = 0.0) -> torch.nn.Module:
        """The wrapped model with fresh weights (the caller seeds torch), every dropout at ``dropout``."""
        cfg = getattr(tf, self.config)(**self.fields)
        cfg._attn_implementation = "eager"
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False
        for field in (
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
            "dropout",
            "attention_dropout",
            "activation_dropout",
            "classifier_dropout",
            "resid_pdrop",
            "embd_pdrop",
            "attn_pdrop",
            "summary_first_dropout",
            "embed_dropout",
            "attention_dropout_prob",
            "dropout_rate",
            "qa_dropout",
            "seq_classif_dropout",
            "hidden_dropout",
            "feat_proj_dropout",
            "final_dropout",
            "layerdrop",
            "mask_time_prob",
            "drop_path_rate",
            "resid_dropout",
            "embedding_dropout",
            "classifier_dropout_prob",
            "encoder_layerdrop",
            "decoder_layerdrop",
        ):
            if isinstance(getattr(cfg, field, None), float):
                setattr(cfg, field, dropout if "dropout" in field or field.endswith("pdrop") else 0.0)
        return Wrapped(getattr(tf, self.model)(cfg), self.inputs)

    @property
    def inputs(self) -> tuple[str, ...]:
        """The wrapped model's input names, in order."""
        if self.kind == "clip":
            return ("input_ids", "pixel_values")
        first = {"image_cls": "pixel_values", "audio_cls": "input_values", "speech": "input_features"}.get(
            self.kind, "input_ids"
        )
        return (first, "attention_mask", "labels") if self.mask else (first, "labels")

    def batch(self, rng: np.random.Generator, dtype: type) -> dict[str, np.ndarray]:
        """One batch of random inputs, by input name."""
        if self.kind == "clip":
            return {
                "input_ids": rng.integers(FIRST, VOCAB, (BATCH, SEQ)),
                "pixel_values": rng.standard_normal((BATCH, *IMAGE)).astype(dtype),
            }
        if self.kind == "image_cls":
            x = rng.standard_normal((BATCH, *IMAGE)).astype(dtype)
        elif self.kind == "audio_cls":
            x = rng.standard_normal((BATCH, AUDIO)).astype(dtype)
        elif self.kind == "speech":
            x = rng.standard_normal((BATCH, MELS, FRAMES)).astype(dtype)
        else:
            x = rng.integers(FIRST, VOCAB, (BATCH, SEQ))
            if self.eos is not None:  # one end-of-sequence token a row, at its end
                x[x == self.eos] = self.eos + 1
                x[:, -1] = self.eos
        if self.kind in ("cls", "image_cls", "audio_cls"):
            y = rng.integers(0, CLASSES, (BATCH,))
        elif self.kind == "clm":
            y = x.copy()
            y[1, -2:] = -100
        elif self.kind == "mlm":
            y = rng.integers(0, VOCAB, (BATCH, SEQ))
            y[:, ::3] = -100  # positions not predicted
        elif self.kind in ("seq2seq", "speech"):
            y = rng.integers(FIRST, VOCAB, (BATCH, SEQ - 2))
            y[1, -1] = -100
        else:
            raise ValueError(f"no labels for kind {self.kind!r}")
        feeds = {self.inputs[0]: x, "labels": y}
        if self.mask:
            mask = np.ones((BATCH, SEQ), np.int64)
            mask[1, -3:] = 0
            feeds["attention_mask"] = mask
        return feeds


def _case(model: str, config: str, kind: str, base: dict[str, Any] = _TEXT, **kw: Any) -> Case:
    own = {k: kw.pop(k) for k in ("optimizer", "dynamo", "mask", "eos", "f32_scalars") if k in kw}
    return Case(model, config, dict(base, **kw), kind, **own)


CASES: dict[str, Case] = {
    "bert_mlm": _case("BertForMaskedLM", "BertConfig", "mlm", mask=True),
    "bert_cls": _case(
        "BertForSequenceClassification", "BertConfig", "cls", num_labels=CLASSES, mask=True, optimizer="AdamW"
    ),
    "distilbert": _case(
        "DistilBertForMaskedLM",
        "DistilBertConfig",
        "mlm",
        {},
        vocab_size=VOCAB,
        dim=16,
        n_layers=1,
        n_heads=2,
        hidden_dim=32,
        max_position_embeddings=16,
        mask=True,
    ),
    "roberta": _case(
        "RobertaForMaskedLM",
        "RobertaConfig",
        "mlm",
        max_position_embeddings=20,
        pad_token_id=0,
        mask=True,
        optimizer="AdamW",
    ),
    "albert": _case("AlbertForMaskedLM", "AlbertConfig", "mlm", embedding_size=8, num_hidden_layers=2),
    "electra": _case(
        "ElectraForSequenceClassification", "ElectraConfig", "cls", embedding_size=8, num_labels=CLASSES
    ),
    "gpt2": _case(
        "GPT2LMHeadModel",
        "GPT2Config",
        "clm",
        {},
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=16,
        optimizer="AdamW",
        dynamo=True,
        f32_scalars=True,
    ),
    "gpt_neo": _case(
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        "clm",
        {},
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        attention_types=[[["global", "local"], 1]],
        window_size=4,
        max_position_embeddings=16,
        dynamo=True,
        f32_scalars=True,
    ),
    "opt": _case(
        "OPTForCausalLM",
        "OPTConfig",
        "clm",
        {},
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        ffn_dim=32,
        max_position_embeddings=16,
        word_embed_proj_dim=16,
        pad_token_id=0,
    ),
    "llama": _case("LlamaForCausalLM", "LlamaConfig", "clm", _LLAMA, optimizer="AdamW", dynamo=True),
    "mistral": _case("MistralForCausalLM", "MistralConfig", "clm", _LLAMA, sliding_window=4, dynamo=True),
    "qwen2": _case("Qwen2ForCausalLM", "Qwen2Config", "clm", _LLAMA, dynamo=True),
    "phi": _case(
        "PhiForCausalLM",
        "PhiConfig",
        "clm",
        _TEXT,
        hidden_size=32,
        partial_rotary_factor=0.5,
        pad_token_id=0,
        dynamo=True,
        f32_scalars=True,
    ),
    "gemma": _case(
        "GemmaForCausalLM",
        "GemmaConfig",
        "clm",
        _LLAMA,
        head_dim=16,
        hidden_act="gelu_pytorch_tanh",
        dynamo=True,
        f32_scalars=True,
    ),
    "t5": _case(
        "T5ForConditionalGeneration",
        "T5Config",
        "seq2seq",
        {},
        vocab_size=VOCAB,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        decoder_start_token_id=0,
        pad_token_id=0,
        optimizer="AdamW",
    ),
    "bart": _case(
        "BartForConditionalGeneration",
        "BartConfig",
        "seq2seq",
        _BART,
        mask=True,
    ),
    "llama_cls": _case(
        "LlamaForSequenceClassification",
        "LlamaConfig",
        "cls",
        _LLAMA,
        num_labels=CLASSES,
        mask=True,
        dynamo=True,
    ),
    "deberta_v2": _case(
        "DebertaV2ForMaskedLM",
        "DebertaV2Config",
        "mlm",
        relative_attention=True,
        position_buckets=4,
        max_relative_positions=8,
        pos_att_type=["p2c", "c2p"],
        mask=True,
    ),
    "bart_cls": _case(
        "BartForSequenceClassification",
        "BartConfig",
        "cls",
        _BART,
        eos_token_id=2,
        num_labels=CLASSES,
        eos=2,
    ),
    "mobilebert": _case(
        "MobileBertForMaskedLM",
        "MobileBertConfig",
        "mlm",
        embedding_size=8,
        intra_bottleneck_size=8,
        true_hidden_size=8,
        num_feedforward_networks=2,
        mask=True,
    ),
    "funnel": _case(
        "FunnelForSequenceClassification",
        "FunnelConfig",
        "cls",
        {},
        vocab_size=VOCAB,
        d_model=16,
        n_head=2,
        d_head=8,
        d_inner=32,
        block_sizes=[1, 1],
        num_labels=CLASSES,
        mask=True,
    ),
    "vit": _case(
        "ViTForImageClassification",
        "ViTConfig",
        "image_cls",
        {},
        image_size=32,
        patch_size=8,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=CLASSES,
        optimizer="AdamW",
    ),
    "deit": _case(
        "DeiTForImageClassification",
        "DeiTConfig",
        "image_cls",
        {},
        image_size=32,
        patch_size=8,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=CLASSES,
    ),
    "swin": _case(
        "SwinForImageClassification",
        "SwinConfig",
        "image_cls",
        {},
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
        num_labels=CLASSES,
        optimizer="AdamW",
    ),
    "convnext": _case(
        "ConvNextForImageClassification",
        "ConvNextConfig",
        "image_cls",
        {},
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_stages=2,
        num_labels=CLASSES,
        patch_size=4,
    ),
    "clip": _case(
        "CLIPModel",
        "CLIPConfig",
        "clip",
        {},
        projection_dim=8,
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
            eos_token_id=VOCAB - 1,
            hidden_act="gelu",
        ),
        vision_config=dict(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            hidden_act="gelu",
        ),
        optimizer="AdamW",
        dynamo=True,
    ),
    "llama_mask": _case("LlamaForCausalLM", "LlamaConfig", "clm", _LLAMA, mask=True, dynamo=True),
    "wav2vec2": _case(
        "Wav2Vec2ForSequenceClassification",
        "Wav2Vec2Config",
        "audio_cls",
        {},
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=(8, 8),
        conv_stride=(5, 4),
        conv_kernel=(10, 4),
        num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2,
        classifier_proj_size=8,
        num_labels=CLASSES,
        do_stable_layer_norm=True,
        feat_extract_norm="layer",
    ),
    "whisper": _case(
        "WhisperForConditionalGeneration",
        "WhisperConfig",
        "speech",
        {},
        vocab_size=VOCAB,
        num_mel_bins=MELS,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_source_positions=FRAMES // 2,
        max_target_positions=16,
        pad_token_id=0,
        decoder_start_token_id=1,
        eos_token_id=2,
        bos_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        dynamo=True,
    ),
}


@contextlib.contextmanager
def float64_kept() -> Iterator[None]:
    """Within: a float64 tensor's casts to float32 (``.float()``, ``.to(torch.float32)``, softmax's
    ``dtype=torch.float32``) keep float64. Hugging Face models upcast half precision that way (attention
    softmax, RMSNorm's variance, rotary angles, the causal-LM loss's logits); in a float64 run those casts
    would hold both sides to float32 rounding, so the float64 runs trace and train without them."""
    to, flt, softmax = torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax

    def keep(t: torch.Tensor, dtype: Any) -> bool:
        return dtype is torch.float32 and isinstance(t, torch.Tensor) and t.dtype is torch.float64

    def to_kept(self, *args, **kw):
        if keep(self, kw.get("dtype")):
            kw.pop("dtype")
        elif args and keep(self, args[0]):
            args = args[1:]
        return to(self, *args, **kw) if args or kw else self

    def float_kept(self, *args, **kw):
        return self if self.dtype is torch.float64 else flt(self, *args, **kw)

    def softmax_kept(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=None if keep(x, dtype) else dtype)

    torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax = to_kept, float_kept, softmax_kept
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.nn.functional.softmax = to, flt, softmax


def build(name: str, dtype: type, dropout: float = 0.0) -> torch.nn.Module:
    """Model ``name`` with fresh seeded weights in ``dtype``, in training mode."""
    torch.manual_seed(0)
    net = CASES[name].build(dropout)
    for m in net.modules():  # ONNX holds a normalization's epsilon as a float32 attribute
        if isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm)):
            m.eps = float(np.float32(m.eps))
    return net.to(torch.float64 if dtype == np.float64 else torch.float32).train()


def batches(name: str, dtype: type) -> list[dict[str, np.ndarray]]:
    """Two training batches for model ``name``."""
    rng = np.random.default_rng(7)
    return [CASES[name].batch(rng, dtype) for _ in range(2)]
