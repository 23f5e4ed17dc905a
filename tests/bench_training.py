"""Benchmark (not collected by pytest): one training epoch of the digits CNNs (Adam, batch 64, cross-entropy) in
tinycomp against the same architecture in PyTorch, on one thread each, interleaved round by round. PyTorch is not a
dependency of tinycomp: install it to run this (`pip install torch`). Run from the repository:
`python tests/bench_training.py [ROUNDS]` (about a minute)."""
import sys
import time

import numpy as np
import torch

from tinycomp.data import load_digits
from tinycomp.models import digits_cnn, digits_cnn_wide
from tinycomp.nn.functional import cross_entropy
from tinycomp.optim import Adam
from tinycomp.profiling.timing import using_threads
from tinycomp.tensor import Tensor, manual_seed

X, y = load_digits('train')
BATCHES = [(X[i:i + 64], y[i:i + 64]) for i in range(0, len(X), 64)]


def torch_twin(model):
    "The same layers in PyTorch, with the same initial weights."
    layers = []
    for m in model:
        name = type(m).__name__
        if name == 'Conv2d':
            t = torch.nn.Conv2d(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, bias=m.bias is not None)
        elif name == 'Linear': t = torch.nn.Linear(m.in_features, m.out_features)
        elif name == 'BatchNorm2d': t = torch.nn.BatchNorm2d(m.num_features)
        elif name == 'ReLU': t = torch.nn.ReLU()
        elif name == 'MaxPool2d': t = torch.nn.MaxPool2d(m.kernel_size)
        elif name == 'Flatten': t = torch.nn.Flatten()
        elif name == 'Dropout': t = torch.nn.Dropout(m.p)
        else: raise TypeError(name)
        with torch.no_grad():
            for k, p in m.named_parameters(): getattr(t, k).copy_(torch.from_numpy(p.data))
        layers.append(t)
    return torch.nn.Sequential(*layers)


def tinycomp_epoch(model, opt):
    for xb, yb in BATCHES:
        loss = cross_entropy(model(Tensor(xb)), yb)
        opt.zero_grad(); loss.backward(); opt.step()


def torch_epoch(model, opt):
    for xb, yb in BATCHES:
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(xb)), torch.from_numpy(yb).long())
        opt.zero_grad(); loss.backward(); opt.step()


def main(rounds=5):
    torch.set_num_threads(1)
    print(f"one epoch = {len(X)} digits in {len(BATCHES)} batches of 64, Adam; median of {rounds} interleaved rounds, "
          f"1 thread each (torch {torch.__version__})")
    with using_threads(1):
        for make in (digits_cnn, digits_cnn_wide):
            manual_seed(0)
            ours = make().train()
            theirs = torch_twin(ours).train()
            runs = {'tinycomp': (ours, Adam(ours.parameters(), lr=1e-3), tinycomp_epoch),
                    'pytorch': (theirs, torch.optim.Adam(theirs.parameters(), lr=1e-3), torch_epoch)}
            for m, opt, epoch in runs.values(): epoch(m, opt)          # warm-up: compilation, caches
            times = {k: [] for k in runs}
            rng = np.random.default_rng(0)
            for _ in range(rounds):
                for k in rng.permutation(list(runs)):
                    m, opt, epoch = runs[k]
                    t0 = time.perf_counter(); epoch(m, opt); times[k].append(time.perf_counter() - t0)
            ours_s, theirs_s = np.median(times['tinycomp']), np.median(times['pytorch'])
            print(f"{make.__name__:16s} tinycomp {ours_s:6.3f} s   pytorch {theirs_s:6.3f} s   tinycomp / pytorch {ours_s / theirs_s:5.2f}")


if __name__ == '__main__':
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
