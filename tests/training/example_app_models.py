"""Small torch stand-ins for the models of onnxruntime-training's on-device example apps, exported the way
each example's offline step exports its model (torch only: no torchvision or transformers downloads).

* ``MNISTNet``: the desktop Python notebook's MLP (784 → 128 → 10), training-mode export at opset 14;
* ``SimpleNet``: the Android demo's CIFAR-10 LeNet (3×32×32 images), training-mode export at opset 14;
* ``TinyMobileNetV2``: the Android C++ app's MobileNetV2 (Conv-BN-ReLU6 stem, depthwise inverted residual
  blocks, ``classifier = Sequential(Dropout, Linear)``), exported with the exporter's defaults (eval mode);
* ``TinyMaskedLM``: the C# app's MobileBERT for masked LM, a BERT-like encoder that computes its own
  cross-entropy (ignore_index -100) from ``labels``; training-mode export at opset 15;
* ``TinyMobileViT``: the C# image app's MobileViT (MV2 blocks and a MobileViT block: local convs, patches
  unfolded into a transformer layer, folded back and fused), training-mode export at opset 12.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional


class MNISTNet(nn.Module):
    def __init__(self, input_size: int = 784, hidden_size: int = 128, num_classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden_size, num_classes)

    def forward(self, model_input):
        return self.fc2(self.relu(self.fc1(model_input)))


class SimpleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: type | None = nn.ReLU6):
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, *([act()] if act is not None else []))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1×1 expansion, 3×3 depthwise, 1×1 linear projection, residual when it fits."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int, act: type = nn.ReLU6) -> None:
        super().__init__()
        hidden = cin * expand
        layers = [_conv_bn(cin, hidden, 1, act=act)] if expand != 1 else []
        layers += [_conv_bn(hidden, hidden, 3, stride, groups=hidden, act=act),
                   _conv_bn(hidden, cout, 1, act=None)]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.conv(x) if self.residual else self.conv(x)


class TinyMobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(_conv_bn(3, 8, 3, 2), InvertedResidual(8, 8, 1, 1),
                                      InvertedResidual(8, 12, 2, 4), InvertedResidual(12, 12, 1, 4),
                                      _conv_bn(12, 32, 1))
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(32, num_classes))

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


class EncoderLayer(nn.Module):
    """A post-norm BERT layer: self-attention with an additive mask, GELU feed-forward."""

    def __init__(self, d: int, heads: int, ff: int, dropout: float, act: type = nn.GELU) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.norm1 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, ff), act(), nn.Linear(ff, d))
        self.norm2 = nn.LayerNorm(d)
        self.drop = nn.Dropout(dropout)

    def attend(self, x, bias):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        if bias is not None:
            scores = scores + bias
        h = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, d)
        return self.drop(self.out(h))

    def forward(self, x, bias=None):
        x = self.norm1(x + self.attend(x, bias))
        return self.norm2(x + self.drop(self.ff(x)))


class TinyMaskedLM(nn.Module):
    """Inputs input_ids, attention_mask, token_type_ids, labels; outputs (loss, logits) as MobileBERT's
    masked-LM head with labels gives them (the decoder shares the word embeddings)."""

    def __init__(self, vocab: int = 40, d: int = 16, heads: int = 2, layers: int = 2, max_len: int = 16,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.word = nn.Embedding(vocab, d)
        self.position = nn.Embedding(max_len, d)
        self.token_type = nn.Embedding(2, d)
        self.register_buffer("position_ids", torch.arange(max_len).unsqueeze(0))
        self.norm = nn.LayerNorm(d)
        self.layers = nn.ModuleList(EncoderLayer(d, heads, 2 * d, dropout) for _ in range(layers))
        self.transform = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d))
        self.decoder_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, input_ids, attention_mask, token_type_ids, labels):
        t = input_ids.shape[1]
        x = self.word(input_ids) + self.position(self.position_ids[:, :t]) + self.token_type(token_type_ids)
        x = self.norm(x)
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.layers:
            x = layer(x, bias)
        logits = self.transform(x) @ self.word.weight.t() + self.decoder_bias
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return loss, logits


class MobileViTBlock(nn.Module):
    """Local 3×3 and 1×1 convs, 2×2 patches unfolded into a transformer layer, folded back, projected and
    fused with the block's input."""

    def __init__(self, c: int, d: int, heads: int = 2) -> None:
        super().__init__()
        self.local = nn.Sequential(_conv_bn(c, c, 3, act=nn.SiLU), nn.Conv2d(c, d, 1, bias=False))
        self.transformer = nn.ModuleList([_PreNormLayer(d, heads, 2 * d)])
        self.norm = nn.LayerNorm(d)
        self.project = _conv_bn(d, c, 1, act=nn.SiLU)
        self.fuse = _conv_bn(2 * c, c, 3, act=nn.SiLU)

    def forward(self, x):
        b, _, h, w = x.shape
        y = self.local(x)
        d = y.shape[1]
        # [B, d, H, W] -> [B * 4, H/2 * W/2, d]: one sequence per position inside the 2×2 patches
        p = y.reshape(b, d, h // 2, 2, w // 2, 2).permute(0, 3, 5, 2, 4, 1)
        p = p.reshape(b * 4, (h // 2) * (w // 2), d)
        for layer in self.transformer:
            p = layer(p)
        p = self.norm(p)
        y = p.reshape(b, 2, 2, h // 2, w // 2, d).permute(0, 5, 3, 1, 4, 2).reshape(b, d, h, w)
        return self.fuse(torch.cat([x, self.project(y)], 1))


class _PreNormLayer(nn.Module):
    def __init__(self, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.attn = EncoderLayer(d, heads, ff, 0.0, act=nn.SiLU)
        self.norm_a = nn.LayerNorm(d)
        self.norm_f = nn.LayerNorm(d)

    def forward(self, x):
        x = x + self.attn.attend(self.norm_a(x), None)
        return x + self.attn.ff(self.norm_f(x))


class TinyMobileViT(nn.Module):
    def __init__(self, num_labels: int = 7) -> None:
        super().__init__()
        self.stem = _conv_bn(3, 8, 3, 2, act=nn.SiLU)
        self.mv2 = InvertedResidual(8, 12, 2, 2, act=nn.SiLU)
        self.vit = MobileViTBlock(12, 16)
        self.head = _conv_bn(12, 24, 1, act=nn.SiLU)
        self.dropout = nn.Dropout(0.0)
        self.classifier = nn.Linear(24, num_labels)

    def forward(self, pixel_values):
        x = self.head(self.vit(self.mv2(self.stem(pixel_values))))
        return self.classifier(self.dropout(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)))


def randomize_batch_norms(net: nn.Module) -> None:
    """Running statistics and affine values away from their defaults, as a pretrained model has them."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.rand(m.num_features, generator=g) - 0.5)
