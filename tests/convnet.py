"""A small fast-neural-style network (Johnson et al.), the conv net circleops supports.

ReflectionPad2d + Conv2d, InstanceNorm2d(affine=True), ReLU, residual blocks and nearest
Upsample, as in pytorch/examples' fast_neural_style TransformerNet, with fewer channels so
tests stay fast. Shared by the lowering, runtime, convert and tflite tests.
"""
from __future__ import annotations

import torch
from torch import nn


class ConvLayer(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        self.pad = nn.ReflectionPad2d(kernel // 2)
        self.conv = nn.Conv2d(cin, cout, kernel, stride)

    def forward(self, x):
        return self.conv(self.pad(x))


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = ConvLayer(channels, channels, 3, 1)
        self.in1 = nn.InstanceNorm2d(channels, affine=True)
        self.conv2 = ConvLayer(channels, channels, 3, 1)
        self.in2 = nn.InstanceNorm2d(channels, affine=True)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.relu(self.in1(self.conv1(x)))
        return self.in2(self.conv2(y)) + x


class UpsampleConvLayer(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, upsample: int):
        super().__init__()
        self.upsample = nn.Upsample(scale_factor=upsample, mode="nearest")
        self.conv = ConvLayer(cin, cout, kernel, 1)

    def forward(self, x):
        return self.conv(self.upsample(x))


class TransformerNet(nn.Module):
    """Image [N, 3, H, W] -> stylised image [N, 3, H, W] (H, W multiples of 4)."""

    def __init__(self, width: int = 8, residual_blocks: int = 2):
        super().__init__()
        w = width
        self.down = nn.Sequential(
            ConvLayer(3, w, 9, 1), nn.InstanceNorm2d(w, affine=True), nn.ReLU(),
            ConvLayer(w, 2 * w, 3, 2), nn.InstanceNorm2d(2 * w, affine=True), nn.ReLU(),
            ConvLayer(2 * w, 4 * w, 3, 2), nn.InstanceNorm2d(4 * w, affine=True), nn.ReLU(),
        )
        self.res = nn.Sequential(*[ResidualBlock(4 * w) for _ in range(residual_blocks)])
        self.up = nn.Sequential(
            UpsampleConvLayer(4 * w, 2 * w, 3, 2), nn.InstanceNorm2d(2 * w, affine=True), nn.ReLU(),
            UpsampleConvLayer(2 * w, w, 3, 2), nn.InstanceNorm2d(w, affine=True), nn.ReLU(),
            ConvLayer(w, 3, 9, 1),
        )

    def forward(self, x):
        return self.up(self.res(self.down(x)))


def build(seed: int = 0, width: int = 8, residual_blocks: int = 2) -> TransformerNet:
    """The net with random weights; instance-norm affines perturbed away from (1, 0) so a
    dropped or misplaced affine cannot pass unnoticed."""
    torch.manual_seed(seed)
    net = TransformerNet(width, residual_blocks)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.InstanceNorm2d):
                m.weight.add_(torch.randn_like(m.weight) * 0.2)
                m.bias.add_(torch.randn_like(m.bias) * 0.2)
    return net.eval()


def example_image(size: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, size, size, generator=g)
