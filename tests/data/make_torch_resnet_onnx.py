"""Make tests/data/torch_resnet.onnx and tests/data/torch_resnet_io.npz: a small ResNet (residual blocks, a strided
block with a 1x1 downsample conv, a BatchNorm after the last residual add, global average pooling) trained briefly in
PyTorch on the shipped digits and exported once with `torch.onnx.export`, with inputs and PyTorch's outputs recorded
as plain arrays.

PyTorch is never a dependency of tinycomp: run this with a separate environment that has torch, onnx and numpy, e.g.

    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch==2.13.0 onnx numpy
    /tmp/torchvenv/bin/python tests/data/make_torch_resnet_onnx.py

The digits are read and normalized as in make_torch_onnx.py (the test checks that the recorded inputs equal
`load_digits('test')[0][:N]`).
"""
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_torch_onnx import train_and_export                                # noqa: E402


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        y = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(y + (x if self.downsample is None else self.downsample(x)))


class TinyResNet(nn.Module):
    "conv-bn-relu, two basic blocks (8 channels, then 16 at stride 2), a BatchNorm after the last add, pool, linear."
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU()
        self.layer1, self.layer2 = BasicBlock(8, 8), BasicBlock(8, 16, 2)
        self.post_bn = nn.BatchNorm2d(16)                 # a BatchNorm that follows no conv
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(16, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(self.avgpool(self.post_bn(x)), 1))


def main(): train_and_export(TinyResNet, 'torch_resnet', 10)


if __name__ == '__main__':
    sys.exit(main())
