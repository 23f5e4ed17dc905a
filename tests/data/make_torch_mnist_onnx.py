"""Make tests/data/torch_resnet8.onnx and tests/data/torch_mobilenet.onnx (and their *_io.npz): MLPerf Tiny's ResNet-8
and a MobileNetV2-style net (inverted residual blocks with depthwise convolutions) written the way a PyTorch user
writes them, trained briefly on tinycomp's shipped MNIST digits (28x28) and exported once with `torch.onnx.export`,
with inputs and PyTorch's outputs recorded as plain arrays.

PyTorch is never a dependency of tinycomp: run this with a separate environment that has torch, onnx and numpy, e.g.

    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch==2.13.0 onnx numpy
    /tmp/torchvenv/bin/python tests/data/make_torch_mnist_onnx.py

The digits are read and normalized as `tinycomp.data.load_mnist5k` does (the test checks that the recorded inputs
equal `load_mnist5k('test')[0][:N]`).
"""
import sys
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_torch_onnx import train_and_export                                # noqa: E402
from make_torch_resnet_onnx import BasicBlock                               # noqa: E402


class ResNet8(nn.Module):
    "MLPerf Tiny's ResNet-8 on one channel: conv16-bn-relu, basic blocks of 16, 32 (stride 2), 64 (stride 2), pool, linear."
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
        self.layer1, self.layer2, self.layer3 = BasicBlock(16, 16), BasicBlock(16, 32, 2), BasicBlock(32, 64, 2)
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(64, 10)

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x))))))
        return self.fc(self.avgpool(x).flatten(1))


class InvertedResidual(nn.Module):
    "1x1 expansion, 3x3 depthwise, 1x1 projection, each with BatchNorm (ReLU after the first two); the input added when the shape stays."
    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        hidden = cin * expand
        layers = [nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU()] if expand != 1 else []
        layers += [nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.ReLU(),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv, self.residual = nn.Sequential(*layers), stride == 1 and cin == cout

    def forward(self, x): return x + self.conv(x) if self.residual else self.conv(x)


class MobileNet(nn.Module):
    "A stem conv8-bn-relu and inverted residual blocks (8, 16/2, 16, 24/2, 24 channels), pool, linear."
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(InvertedResidual(8, 8, 1, 1), InvertedResidual(8, 16, 2, 4), InvertedResidual(16, 16, 1, 4),
                                    InvertedResidual(16, 24, 2, 4), InvertedResidual(24, 24, 1, 4))
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(24, 10)

    def forward(self, x): return self.fc(self.avgpool(self.blocks(self.stem(x))).flatten(1))


def main():
    train_and_export(ResNet8, 'torch_resnet8', 4, data='mnist5k', lr=3e-3)
    train_and_export(MobileNet, 'torch_mobilenet', 4, data='mnist5k', lr=3e-3)


if __name__ == '__main__':
    sys.exit(main())
