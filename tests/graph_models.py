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


class QuantizableNet(nn.Module):
    "A residual block, a depthwise-separable branch concatenated with it, pooling and a classifier: layers int8 has."
    def __init__(self, c=16):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.block = ResidualBlock(c)
        self.depthwise, self.pointwise = nn.Conv2d(c, c, 3, padding=1, groups=c), nn.Conv2d(c, c, 1)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(2), nn.Linear(8 * c, 10)

    def forward(self, x):
        x = self.block(self.bn(self.stem(x)).relu())
        branch = self.pointwise(self.depthwise(x)).relu()
        return self.fc(self.pool(cat([x, branch], 1)).flatten(1))


def trained_quantizable(epochs=8, seed=0):
    "QuantizableNet trained on the digits (Adam, lr 0.01): a model whose accuracy means something."
    from tinycomp.data import DataLoader, load_digits
    from tinycomp.models import fit
    from tinycomp.optim import Adam
    from tinycomp.tensor import manual_seed
    manual_seed(seed)
    net = QuantizableNet()
    x, y = load_digits('train')
    fit(net, DataLoader(x, y, batch_size=64, shuffle=True, seed=seed), epochs=epochs,
        optimizer=Adam(net.parameters(), lr=1e-2), progress=False)
    return net.eval()
