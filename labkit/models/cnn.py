"""The kit's models, each also available as a flat ``nn.Sequential`` for pipelining and layer splits.

    model = get_model("resnet32", in_channels=3, image_size=32)           # (B, 3, 32, 32) -> (B, 10)
    pipe = get_model("resnet50", sequential=True)                          # flat: split anywhere
    count_parameters(get_model("resnet32", in_channels=3))                # 464,154

Names (:data:`MODELS`):

- ``mlp``: the PyTorch-quickstart network of the seed-004 slides, Flatten -> 512 -> 512 -> classes.
- ``lenet``: LeNet-5 as in the same slides (two 5x5 conv + max-pool, three linear layers).
- ``resnet20``, ``resnet32``: the CIFAR ResNets of He et al. 2016 (Sec. 4.2): a 3x3 conv, three stages
  of n = 3 / 5 basic blocks with 16 / 32 / 64 channels, global average pool, linear; 6n + 2 layers.
- ``resnet50``: ``torchvision.models.resnet50`` for the GPipe hands-on, adapted to 28x28 inputs.
- ``alexnet_small``: the AlexNet-shaped network whose layers the FlexFlow strategy of seed 000 places:
  conv1 pool2 conv3 pool4 conv5 conv6 conv7 pool8 flat linear9 linear10 linear11.

:func:`to_sequential` lists a model's layers in order (a residual block is one entry, Flatten is its
own entry), sharing the model's modules. Every entry maps one tensor to one tensor, so the flat model
can be cut at any boundary, and its parameters come in the same order as ``model.parameters()``.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from labkit.errors import ConfigError
from labkit.models.names import LANGUAGE_MODELS
from labkit.models.recompute import set_recompute

if TYPE_CHECKING:
    import torchvision


class MLP(nn.Module):
    """Flatten -> Linear(C*S*S, 512) -> ReLU -> Linear(512, 512) -> ReLU -> Linear(512, classes).

    The seed slide ends with one more ReLU on the logits; it clips every negative logit to zero, which
    stalls learning, so it is left out here (as the current PyTorch quickstart does).
    """

    def __init__(self, num_classes: int, in_channels: int, image_size: int):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(OrderedDict(
            fc1=nn.Linear(in_channels * image_size**2, 512), relu1=nn.ReLU(),
            fc2=nn.Linear(512, 512), relu2=nn.ReLU(),
            fc3=nn.Linear(512, num_classes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_relu_stack(self.flatten(x))  # (B, C, S, S) -> (B, C*S*S) -> (B, classes)

    def layers(self) -> list[tuple[str, nn.Module]]:
        return [("flatten", self.flatten), *self.linear_relu_stack.named_children()]


class LeNet(nn.Module):
    """LeNet-5: conv 5x5 (6) -> pool 2 -> conv 5x5 (16) -> pool 2 -> 120 -> 84 -> classes, ReLU between.

    The first linear layer takes 16 * s * s inputs with s = ((S - 4) // 2 - 4) // 2: 5 for 32x32, 4 for 28x28.
    """

    def __init__(self, num_classes: int, in_channels: int, image_size: int):
        super().__init__()
        s = ((image_size - 4) // 2 - 4) // 2
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * s * s, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # (B, 6, (S-4)/2, (S-4)/2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # (B, 16, s, s)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)

    def layers(self) -> list[tuple[str, nn.Module]]:
        return [("conv1", self.conv1), ("relu1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)),
                ("conv2", self.conv2), ("relu2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)), ("flatten", nn.Flatten()),
                ("fc1", self.fc1), ("relu3", nn.ReLU()), ("fc2", self.fc2), ("relu4", nn.ReLU()), ("fc3", self.fc3)]


class BasicBlock(nn.Module):
    """y = relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), 3x3 convs, the first with ``stride``.

    Shortcut option A of He et al. 2016: identity; where the block halves the resolution and widens the
    channels, x is subsampled (x[:, :, ::2, ::2]) and padded with zero channels. It has no parameters,
    which gives the paper's parameter counts (resnet32: 0.46 M).
    """

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.stride, self.extra_channels = stride, planes - in_planes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x[:, :, ::self.stride, ::self.stride] if self.stride > 1 else x
        if self.extra_channels:
            shortcut = F.pad(shortcut, (0, 0, 0, 0, 0, self.extra_channels))  # zero channels at the end
        return F.relu(out + shortcut)


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for small images: conv 3x3 (16) -> 3 stages x n BasicBlocks (16, 32, 64) -> pool -> linear.

    Resolution S -> S/2 -> S/4 across the stages (stride 2 in the first block of stages 2 and 3).
    """

    def __init__(self, n: int, num_classes: int, in_channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        widths, in_planes, stages = (16, 32, 64), 16, []
        for i, planes in enumerate(widths):
            blocks = [BasicBlock(in_planes if j == 0 else planes, planes, 2 if i > 0 and j == 0 else 1)
                      for j in range(n)]
            stages.append(nn.Sequential(*blocks))
            in_planes = planes
        self.layer1, self.layer2, self.layer3 = stages
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")  # He init, as the paper

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))  # (B, 16, S, S)
        x = self.layer3(self.layer2(self.layer1(x)))  # (B, 64, S/4, S/4)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)  # (B, 64)
        return self.fc(x)

    def layers(self) -> list[tuple[str, nn.Module]]:
        blocks = [(f"{stage}_{j}", block) for stage in ("layer1", "layer2", "layer3")
                  for j, block in enumerate(getattr(self, stage))]
        return [("conv1", self.conv1), ("bn1", self.bn1), ("relu", nn.ReLU()), *blocks,
                ("avgpool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten()), ("fc", self.fc)]


class AlexNetSmall(nn.Module):
    """AlexNet's shape (5 conv, 3 max-pool, 3 linear) at half AlexNet's widths, for 32x32 inputs.

    conv1 5x5 (32) pool2 conv3 3x3 (96) pool4 conv5 (192) conv6 (128) conv7 (128) pool8 -> flat ->
    linear9 (512) linear10 (512) linear11 (classes), ReLU after every conv and hidden linear; 2x2 pools,
    so 32x32 becomes 4x4. The convolutions hold most of the compute, the linear layers most of the
    parameters, which is why the seed-000 strategy replicates ``features`` and keeps ``classifier`` on
    one device. No dropout, so parallel and single-device runs compute the same thing. No BatchNorm
    either, as in AlexNet: it trains with a smaller learning rate (its default, :data:`DEFAULT_LR`).
    """

    def __init__(self, num_classes: int, in_channels: int, image_size: int):
        super().__init__()
        s = image_size // 8
        self.features = nn.Sequential(OrderedDict(
            conv1=nn.Conv2d(in_channels, 32, 5, padding=2), relu1=nn.ReLU(), pool2=nn.MaxPool2d(2),
            conv3=nn.Conv2d(32, 96, 3, padding=1), relu3=nn.ReLU(), pool4=nn.MaxPool2d(2),
            conv5=nn.Conv2d(96, 192, 3, padding=1), relu5=nn.ReLU(),
            conv6=nn.Conv2d(192, 128, 3, padding=1), relu6=nn.ReLU(),
            conv7=nn.Conv2d(128, 128, 3, padding=1), relu7=nn.ReLU(), pool8=nn.MaxPool2d(2)))
        self.flat = nn.Flatten()
        self.classifier = nn.Sequential(OrderedDict(
            linear9=nn.Linear(128 * s * s, 512), relu9=nn.ReLU(),
            linear10=nn.Linear(512, 512), relu10=nn.ReLU(),
            linear11=nn.Linear(512, num_classes)))
        # He init: with no BatchNorm, PyTorch's default init shrinks the signal at every layer and this
        # 8-layer net then stays at chance for epochs.
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)
        # ... but He-scaled logits start near ±10 (loss ≈ 7.5) and SGD's first steps blow up: a tenth of that
        # scale in the last layer starts near loss ln(10) and still passes gradients to every layer
        with torch.no_grad():
            self.classifier.linear11.weight.mul_(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.flat(self.features(x)))  # (B, C, S, S) -> (B, 128*s*s) -> (B, classes)

    def layers(self) -> list[tuple[str, nn.Module]]:
        return [*self.features.named_children(), ("flat", self.flat), *self.classifier.named_children()]


def resnet50(num_classes: int = 10, in_channels: int = 1) -> torchvision.models.ResNet:
    """``torchvision.models.resnet50`` (untrained) for 28x28 images with ``in_channels`` channels.

    The 7x7 stride-2 stem conv becomes 3x3 stride 1, so a 28x28 digit is not cut to 14x14 at once; the
    max-pool stays, so the four stages run at 14, 7, 4 and 2 pixels (a quarter of the compute of
    dropping it as well). Each residual block's last BatchNorm starts at zero (``zero_init_residual``,
    Goyal et al. 2017), so the untrained network is a chain of identities and projections: with
    torchvision's default init the logits of 16 stacked blocks blew the loss up from 2.4 to 51 in four steps.
    """
    import torchvision

    model = torchvision.models.resnet50(weights=None, num_classes=num_classes, zero_init_residual=True)
    model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    return model


def _torchvision_resnet_layers(model: torchvision.models.ResNet) -> list[tuple[str, nn.Module]]:
    blocks = [(f"{stage}_{j}", block) for stage in ("layer1", "layer2", "layer3", "layer4")
              for j, block in enumerate(getattr(model, stage))]
    # A fresh, not-in-place ReLU: an in-place one at the start of a pipeline stage would overwrite that stage's
    # input, which autograd may still need.
    return [("conv1", model.conv1), ("bn1", model.bn1), ("relu", nn.ReLU()), ("maxpool", model.maxpool), *blocks,
            ("avgpool", model.avgpool), ("flatten", nn.Flatten()), ("fc", model.fc)]


def to_sequential(model: nn.Module) -> nn.Sequential:
    """The flat ``nn.Sequential`` computing the same function as ``model`` and sharing its parameters."""
    if isinstance(model, nn.Sequential):
        return model
    torchvision = sys.modules.get("torchvision")  # not imported: the model cannot be one of its ResNets
    if torchvision is not None and isinstance(model, torchvision.models.ResNet):
        return nn.Sequential(OrderedDict(_torchvision_resnet_layers(model)))
    if hasattr(model, "layers"):
        return nn.Sequential(OrderedDict(model.layers()))
    raise ConfigError(f"{type(model).__name__} has no flat form; models with one: {', '.join(MODELS)}")


#: name -> (builder(num_classes, in_channels, image_size), smallest image size it accepts)
MODELS: dict[str, tuple[Callable[[int, int, int], nn.Module], int]] = {
    "mlp": (MLP, 1),
    "lenet": (LeNet, 16),
    "resnet8": (lambda k, c, s: CifarResNet(1, k, c), 1),  # the smallest of the family: quick CPU runs
    "resnet20": (lambda k, c, s: CifarResNet(3, k, c), 1),
    "resnet32": (lambda k, c, s: CifarResNet(5, k, c), 1),
    "resnet50": (lambda k, c, s: resnet50(k, c), 1),
    "alexnet_small": (AlexNetSmall, 8),
}


#: the ``--base-lr`` a model trains with by default, when not 0.05 (SGD with momentum 0.9, batch 64); resnet50's
#: 16 bottleneck blocks at 0.05 and batch 16 took the loss from 2.4 to 7 in five steps, at 0.01 it falls steadily
DEFAULT_LR: dict[str, float] = {"alexnet_small": 0.005, "resnet50": 0.01}
#: a GPT's with Adam (its default optimizer, :func:`default_optimizer`): nanoGPT's Shakespeare-character rate;
#: with SGD (momentum 0.9) a transformer wants a larger step
GPT_LR: dict[str, float] = {"adam": 1e-3, "sgd": 0.1}
#: an image model's with the optimizers whose step has Adam's scale (Shampoo grafted to Adam, SOAP, Muon with
#: Moonlight's AdamW-matched rate); 0.05 sends them off. The MLP on mnist-sample, 16 steps of 64: Shampoo's test loss
#: 0.56 at 3e-4, 1.9 at 1e-3, 6.8 at 3e-3; SOAP 0.64 and Muon 1.14 at 3e-3
ADAPTIVE_LR: dict[str, float] = {"shampoo": 3e-4, "soap": 3e-3, "muon": 3e-3}


def default_lr(name: str, optimizer: str = "sgd") -> float:
    """The learning rate ``labkit train --model name`` uses when ``--base-lr`` is not given."""
    if name in LANGUAGE_MODELS:
        return GPT_LR.get(optimizer, GPT_LR["adam"])
    return ADAPTIVE_LR.get(optimizer, DEFAULT_LR.get(name, 0.05))


def check_model_name(name: str) -> None:
    """ConfigError unless ``name`` is a model :func:`get_model` builds."""
    if name not in MODELS and name not in LANGUAGE_MODELS:
        raise ConfigError(f"unknown model {name!r}; choose one of: {', '.join([*MODELS, *LANGUAGE_MODELS])}")


def get_model(name: str, num_classes: int = 10, in_channels: int = 1, image_size: int = 28,
              sequential: bool = False, seq_len: int | None = None, dropout: float = 0.0,
              recompute: str = "none") -> nn.Module:
    """Build model ``name`` for (B, in_channels, image_size, image_size) inputs and ``num_classes`` logits; a
    language model (:data:`LANGUAGE_MODELS`) for (B, T <= seq_len) tokens of a ``num_classes``-token vocabulary.

    Args:
        sequential: return the flat ``nn.Sequential`` form (see :func:`to_sequential`).
        seq_len: a GPT's longest sequence (its position table; default: the size's own).
        dropout: a GPT's dropout probability (other models have none).
        recompute: ``--recompute`` (:mod:`labkit.models.recompute`): ``full`` recomputes each block (a GPT's,
            a ResNet's residual blocks) in backward, ``selective`` a GPT's attention scores.

    Raises:
        ConfigError: unknown name, or sizes the model cannot take.
    """
    if name in LANGUAGE_MODELS:
        if num_classes < 1:
            raise ConfigError(f"{name} needs a vocabulary of >= 1 token, got {num_classes}")
        from labkit.models.gpt import gpt
        from labkit.models.moe import MOE_SIZES, gpt_moe

        build = gpt_moe if LANGUAGE_MODELS[name] in MOE_SIZES else gpt
        model = build(LANGUAGE_MODELS[name], vocab_size=num_classes, block_size=seq_len, dropout=dropout)
        set_recompute(model, recompute, name)
        return to_sequential(model) if sequential else model
    check_model_name(name)
    build, min_size = MODELS[name]
    for what, value, least in (("num_classes", num_classes, 1), ("in_channels", in_channels, 1),
                               ("image_size", image_size, min_size)):
        if value < least:
            raise ConfigError(f"{name} needs {what} >= {least}, got {value}")
    model = set_recompute(build(num_classes, in_channels, image_size), recompute, name)
    return to_sequential(model) if sequential else model


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (each shared tensor counted once)."""
    return sum(p.numel() for p in model.parameters())
