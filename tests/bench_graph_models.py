"""Benchmark (not collected by pytest): the course's tools on two networks that are not chains, trained on the digits
here (none ships pretrained): `digits_resnet` (residual blocks, a strided 1x1 downsample branch) and
`digits_mobilenet` (inverted residual blocks with depthwise convs). For each: training time; the traced graph against
the model (bit-exact); `quantize_static` against float; 50 % channel pruning with dependency groups and a short
fine-tune against the unpruned model, latency at batch 1 and 64 measured in one `compare` run; ONNX Runtime against
us (float, pruned, int8). Then a ResNet exported by PyTorch, imported against PyTorch's recorded outputs.
Run from the repository: `python tests/bench_graph_models.py` (about two minutes on two cores)."""
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime

from tinycomp.benchmarking import compare
from tinycomp.data import DataLoader, load_digits
from tinycomp.graph import trace
from tinycomp.models import digits_mobilenet, digits_resnet, evaluate, fit
from tinycomp.onnx import export_onnx, import_onnx, ort_agreement
from tinycomp.onnx.export import OnnxBuilder, _nodes
from tinycomp.optim import Adam, CosineAnnealingLR
from tinycomp.pruning import prune_channels
from tinycomp.quantization import quantize_static
from tinycomp.tensor import Tensor, manual_seed, no_grad

EPOCHS, TUNE_EPOCHS, LR = 10, 6, 3e-3
X_train, y_train = load_digits('train')
X_test, y_test = load_digits('test')
HERE = Path(__file__).resolve().parent


def train(model, epochs, lr=LR, seed=0):
    "Adam with a cosine schedule, batch 64."
    manual_seed(seed)
    opt = Adam(model.parameters(), lr=lr)
    fit(model, DataLoader(X_train, y_train, batch_size=64, shuffle=True, seed=seed), epochs=epochs, optimizer=opt,
        scheduler=CosineAnnealingLR(opt, epochs), progress=False)
    return model.eval()


def per_layer_lsb(q, path):
    """For every integer node of `q`: the share of its int8 outputs where ONNX Runtime (the exported file, each node's
    tensor made a graph output) differs from ours, and the largest difference, on the test split."""
    g = OnnxBuilder(onnx, 17)
    g.shapes['input'] = (1, 1, 8, 8)
    names = _nodes(g, q)
    m = onnx.load(path)
    made = {o for n in m.graph.node for o in n.output}
    for t in sorted({names[n.name] for n in q} & made - {'output'}): m.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
    sess = onnxruntime.InferenceSession(m.SerializeToString(), providers=['CPUExecutionProvider'])
    theirs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {'input': X_test})))
    with no_grad(): ours = q(Tensor(X_test), keep_all=True)
    rows = []
    for n in q:
        a, b = ours[n.name].data, theirs.get(names[n.name])
        if b is None or a.dtype != np.int8: continue
        d = np.abs(a.astype(np.int32) - (b.astype(np.int32) - 128 if b.dtype == np.uint8 else b))
        rows.append(f"{n.name} {np.mean(d > 0):.1%} (max {d.max()})")
    return rows


def acc(model): return evaluate(model, (X_test, y_test)).accuracy


def main():
    tmp = Path(tempfile.mkdtemp())
    for make in (digits_resnet, digits_mobilenet):
        name = make.__name__
        manual_seed(0)
        t0 = time.perf_counter()
        model = train(make(), EPOCHS)
        trained_s = time.perf_counter() - t0
        graph = trace(model, X_test[:1])
        with no_grad(): same = np.array_equal(graph(Tensor(X_test)).data, model(Tensor(X_test)).data)
        q = quantize_static(model, X_train[:256])
        pruned = prune_channels(model, 0.5, input_shape=(1, 1, 8, 8))
        t0 = time.perf_counter()
        tuned = train(pruned, TUNE_EPOCHS)
        tuned_s = time.perf_counter() - t0
        cmp = compare(('float32', model), {'int8': q, 'pruned 50% + fine-tune': tuned}, (X_test, y_test))
        print(f"\n== {name}: trained {EPOCHS} epochs (Adam, cosine from {LR:g}) in {trained_s:.1f} s; graph(x) == model(x) bit-exact on the test "
              f"split: {same}; fine-tune {TUNE_EPOCHS} epochs in {tuned_s:.1f} s")
        print(cmp.table())
        for label, m in (('float32', model), ('pruned', tuned), ('int8', q)):
            path = export_onnx(m, tmp / f"{name}_{label}.onnx", (1, 1, 8, 8))
            r = ort_agreement(m, path, X_test)
            detail = (f"relative error {r['rel_err']:.1e}" if 'lsb_within_1' not in r else
                      f"{r['lsb_equal']:.2%} equal, {r['lsb_within_1']:.2%} within 1 LSB, at most {r['max_lsb']} LSB")
            print(f"ONNX Runtime, {label}: {detail}; predicted class agrees on {r['class_agreement']:.2%}")
        print("int8 outputs that differ from ONNX Runtime's, node by node: " + '; '.join(per_layer_lsb(q, path)))
    io = np.load(HERE / 'data' / 'torch_resnet_io.npz', allow_pickle=False)
    imported = import_onnx(HERE / 'data' / 'torch_resnet.onnx')
    with no_grad(): out = imported(Tensor(io['inputs'])).data
    print(f"\n== PyTorch's ResNet (tests/data/torch_resnet.onnx): imported as a {type(imported).__name__} of "
          f"{len(imported)} nodes; largest difference from PyTorch's outputs {np.abs(out - io['outputs']).max():.1e} "
          f"(relative {np.abs(out - io['outputs']).max() / np.abs(io['outputs']).max():.1e}); test accuracy "
          f"{acc(imported):.4f} here, {float(io['test_accuracy']):.4f} in PyTorch")


if __name__ == '__main__':
    sys.exit(main())
