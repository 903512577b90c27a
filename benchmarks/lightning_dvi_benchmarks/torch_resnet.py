"""torchvision-shaped ResNets in plain torch (torchvision's wheels do not import with CPU torch here).

The module tree, parameter names and forward graphs follow ``torchvision.models.resnet``
(``conv1``, ``bn1``, ``relu``, ``maxpool``, ``layer1``..``layer4`` of :class:`BasicBlock` or
:class:`Bottleneck` with a 1x1-conv + BatchNorm ``downsample``, ``avgpool``, ``torch.flatten``,
``fc``), so a converter that handles these handles torchvision's models, and a torchvision
``state_dict`` loads into them. :class:`PreActBlock` is the pre-activation block of He et al.
(2016, "Identity mappings in deep residual networks").

``small_input=True`` gives the CIFAR-style stem (3x3 conv, stride 1, no max pool) that small
images (digits' 8x8, CIFAR's 32x32) need; ``width`` scales every stage's channels.

Examples:
    >>> import torch
    >>> net = resnet18(num_classes=1000)
    >>> sum(p.numel() for p in net.parameters())  # torchvision's resnet18: 11,689,512
    11689512
    >>> small = resnet18(num_classes=10, in_channels=1, small_input=True, width=8)
    >>> tuple(small.eval()(torch.randn(2, 1, 8, 8)).shape)
    (2, 10)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = [
    "BasicBlock",
    "Bottleneck",
    "PreActBlock",
    "ResNet",
    "preact_resnet18",
    "resnet18",
    "resnet50",
]


def _conv3x3(inplanes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)


def _conv1x1(inplanes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a skip connection (torchvision's ``BasicBlock``)."""

    expansion = 1

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        """``relu(bn2(conv2(relu(bn1(conv1(x))))) + downsample(x))``."""
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        result: Tensor = self.relu(out)
        return result


class Bottleneck(nn.Module):
    """1x1, 3x3 (strided), 1x1 convolutions with BatchNorm and a skip (ResNet-50's block)."""

    expansion = 4

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        """``relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + downsample(x))``."""
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        result: Tensor = self.relu(out)
        return result


class PreActBlock(nn.Module):
    """Pre-activation block: ``conv2(relu(bn2(conv1(relu(bn1(x)))))) + shortcut``.

    The shortcut is the identity, or a 1x1 convolution of the pre-activated input when the
    shape changes (He et al. 2016, v2).
    """

    expansion = 1

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(inplanes)
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        """Pre-activated residual branch plus the (projected) shortcut."""
        out = torch.relu(self.bn1(x))
        shortcut = self.downsample(out) if self.downsample is not None else x
        out = self.conv1(out)
        out = self.conv2(torch.relu(self.bn2(out)))
        result: Tensor = out + shortcut
        return result


_Block = type[BasicBlock] | type[Bottleneck] | type[PreActBlock]


class ResNet(nn.Module):
    """torchvision's ``ResNet`` layout over a block type.

    Args:
        block: :class:`BasicBlock`, :class:`Bottleneck` or :class:`PreActBlock`.
        layers: blocks per stage, e.g. ``[2, 2, 2, 2]`` for ResNet-18.
        num_classes: width of ``fc``.
        in_channels: input channels (3 for RGB, 1 for digits).
        width: channels of the first stage (64 in torchvision); stages use 1, 2, 4, 8 times it.
        small_input: 3x3 stride-1 stem without max pool (CIFAR/digits-size images).
    """

    def __init__(
        self,
        block: _Block,
        layers: list[int],
        num_classes: int = 1000,
        in_channels: int = 3,
        width: int = 64,
        small_input: bool = False,
    ) -> None:
        super().__init__()
        self.inplanes = width
        if small_input:
            self.conv1 = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        else:
            self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool: nn.Module = (
            nn.Identity() if small_input else nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        )
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, 2 * width, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * width, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * width, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_layer(
        self, block: _Block, planes: int, blocks: int, stride: int = 1
    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            out = planes * block.expansion
            if block is PreActBlock:
                downsample = nn.Sequential(_conv1x1(self.inplanes, out, stride))
            else:
                downsample = nn.Sequential(
                    _conv1x1(self.inplanes, out, stride), nn.BatchNorm2d(out)
                )
        stage: list[nn.Module] = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        stage += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*stage)

    def forward(self, x: Tensor) -> Tensor:
        """Stem, four stages, global average pool, ``torch.flatten``, ``fc``."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        logits: Tensor = self.fc(x)
        return logits


def resnet18(**kwargs: int | bool) -> ResNet:
    """ResNet-18: :class:`BasicBlock`, stages ``[2, 2, 2, 2]`` (keyword arguments of :class:`ResNet`)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], **kwargs)  # type: ignore[arg-type]  # int|bool kwargs


def resnet50(**kwargs: int | bool) -> ResNet:
    """ResNet-50: :class:`Bottleneck`, stages ``[3, 4, 6, 3]``."""
    return ResNet(Bottleneck, [3, 4, 6, 3], **kwargs)  # type: ignore[arg-type]  # int|bool kwargs


def preact_resnet18(**kwargs: int | bool) -> ResNet:
    """Pre-activation ResNet-18: :class:`PreActBlock`, stages ``[2, 2, 2, 2]``."""
    return ResNet(PreActBlock, [2, 2, 2, 2], **kwargs)  # type: ignore[arg-type]  # int|bool kwargs
