"""Make tests/data/torch_cnn.onnx and tests/data/torch_cnn_io.npz: a small float CNN trained briefly in PyTorch on the
shipped digits and exported once with `torch.onnx.export`, with inputs and PyTorch's outputs recorded as plain arrays.

PyTorch is never a dependency of tinycomp: run this with a separate environment that has torch, onnx and numpy, e.g.

    python3 -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch==2.13.0 onnx numpy
    /tmp/torchvenv/bin/python tests/data/make_torch_onnx.py

The digits are read from tinycomp's own data file and normalized exactly as `tinycomp.data.load_digits` does (the
test checks that the recorded inputs equal `load_digits('test')[0][:N]`), so the imported model can be evaluated
and compressed with the course's tools on the same data.
"""
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
DIGITS = HERE.parents[1] / 'tinycomp' / 'data_files' / 'digits.npz'
DIGITS_MEAN, DIGITS_STD = 0.3057098267474186, 0.3762841735082196     # tinycomp.data.DIGITS_MEAN / DIGITS_STD
SPLITS = {'train': 0, 'val': 1, 'test': 2}                         # tinycomp.data.DIGITS_SPLITS
N_RECORDED = 64


MNIST = HERE.parents[1] / 'tinycomp' / 'data_files' / 'mnist5k.npz'
MNIST_MEAN, MNIST_STD = 0.1313527096552907, 0.3086119540657072   # tinycomp.data.MNIST5K_MEAN / MNIST5K_STD


def load(split, data='digits'):
    "A split of tinycomp's shipped digits ('digits') or MNIST digits ('mnist5k'), normalized as tinycomp normalizes it."
    path, scale, mean, std = (DIGITS, 16, DIGITS_MEAN, DIGITS_STD) if data == 'digits' else (MNIST, 255, MNIST_MEAN, MNIST_STD)
    d = np.load(path, allow_pickle=False)
    keep = d['split'] == SPLITS[split]
    X = ((d['images'][keep].astype(np.float32)[:, None] / scale - mean) / std).astype(np.float32)
    return X, d['labels'][keep].astype(np.int64)


def make_model():
    "conv-bn-relu, conv-bn-relu, maxpool, flatten, dropout, linear-relu, linear: 1x8x8 in, 10 classes out."
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Dropout(0.1),
        nn.Linear(16 * 4 * 4, 32), nn.ReLU(),
        nn.Linear(32, 10))


def train_and_export(make, stem, epochs, data='digits', lr=1e-2):
    """Train `make()` briefly on `data` (seed 0, Adam, batch 64), export it to `{stem}.onnx` and record inputs and
    PyTorch's outputs in `{stem}_io.npz`."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    X, y = load('train', data)
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)
    for epoch in range(epochs):                 # a brief training run: the file should be a real, working model
        model.train()
        for idx in torch.randperm(len(X), generator=gen).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(model(Xt[idx]), yt[idx]).backward()
            opt.step()
    model.eval()
    Xtest, ytest = load('test', data)
    with torch.no_grad():
        acc = (model(torch.from_numpy(Xtest)).argmax(1).numpy() == ytest).mean()
        x = torch.from_numpy(Xtest[:N_RECORDED])
        out = model(x).numpy()
    onnx_path = HERE / f'{stem}.onnx'
    torch.onnx.export(model, (x[:1],), str(onnx_path), dynamo=False, input_names=['input'], output_names=['logits'],
                      dynamic_axes={'input': {0: 'batch'}, 'logits': {0: 'batch'}}, opset_version=17,
                      training=torch.onnx.TrainingMode.PRESERVE)   # keep BatchNormalization (EVAL would fold it into the convs)
    np.savez(HERE / f'{stem}_io.npz', inputs=x.numpy(), outputs=out.astype(np.float32), labels=ytest[:N_RECORDED],
             test_accuracy=np.float64(acc), torch_version=np.array(torch.__version__))
    print(f"torch {torch.__version__}: test accuracy {acc:.4f}; wrote {onnx_path} ({onnx_path.stat().st_size} bytes) "
          f"and {stem}_io.npz ({N_RECORDED} inputs and PyTorch's outputs)")


def main(): train_and_export(make_model, 'torch_cnn', 8)


if __name__ == '__main__':
    sys.exit(main())
