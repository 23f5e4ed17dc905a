"Small models that are not chains, for the tests of the graph and of every tool that walks one."
import numpy as np

from tinycomp import nn
from tinycomp.tensor import cat


def images(batch, seed=0, channels=1, size=8):
    return np.random.default_rng(seed).standard_normal((batch, channels, size, size)).astype(np.float32)


class ResidualBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = self.bn1(self.conv1(x)).relu()
        return (self.bn2(self.conv2(y)) + x).relu()


class BranchyNet(nn.Module):
    "A residual block, a depthwise conv scaled by a constant and concatenated, a pointwise conv, a mean, a flatten."
    def __init__(self):
        super().__init__()
        self.stem, self.block = nn.Conv2d(1, 8, 3, padding=1), ResidualBlock(8)
        self.depthwise, self.pointwise = nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(16, 4, 1)
        self.fc = nn.Linear(4, 10)

    def forward(self, x):
        x = self.block(self.stem(x))
        x = cat([x, self.depthwise(x) * 0.5], dim=1)
        return self.fc(self.pointwise(x).mean((2, 3)).flatten(1))


def trained_like(model, seed=0):
    "Non-trivial BatchNorm statistics, so eval mode differs from train mode."
    rng = np.random.default_rng(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean[:] = rng.standard_normal(m.running_mean.shape)
            m.running_var[:] = rng.uniform(0.5, 2, m.running_var.shape)
    return model.eval()
