"""Benchmark (not collected by pytest): activation memory of a float32 model at batch 64, eagerly (module 03's
`peak_memory_mb` of a forward), frozen (`tinycomp.deploy.freeze`: its planned arena, and the peak of its first call,
which allocates the arena) and in ONNX Runtime (the resident memory its session gains on the first run and after six,
in a child process of its own, one thread); then what 50 calls of the frozen models, float32 and int8, allocate in the
steady state (`steady_state_allocations`, with tracemalloc). Needs the `onnx` extra. Run from the repository:
`python tests/bench_memory.py [MODEL ...]` (default: digits_cnn_wide resnet8 mobilenet_v2_tiny; about a minute)."""
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tinycomp.data import load_shipped
from tinycomp.deploy.runtime import freeze, steady_state_allocations
from tinycomp.models import load_pretrained, model_data
from tinycomp.onnx.export import export_onnx
from tinycomp.profiling.hardware import peak_memory_mb
from tinycomp.quantization.models import quantize_static

ORT_CHILD = r'''
import sys, numpy as np, onnxruntime as ort
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096      # resident bytes (Linux)
x = np.load(sys.argv[2])
so = ort.SessionOptions()
so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 1, 1, 3
session = ort.InferenceSession(sys.argv[1], so, providers=['CPUExecutionProvider'])
feed = {session.get_inputs()[0].name: x}
before = rss()
session.run(None, feed)
first = rss()
for _ in range(5): session.run(None, feed)
print(first - before, rss() - before)
'''


def measure(name, batch=64) -> dict:
    model = load_pretrained(name)
    X = load_shipped(model_data(name), 'test')[0][:batch]
    eager = peak_memory_mb(model, X)
    frozen = freeze(model, X[:4])
    arena = frozen.memory_plan(batch).arena_bytes / 1e6
    first_call = peak_memory_mb(freeze(model, X[:4]), X, warmup=False)
    with tempfile.TemporaryDirectory() as d:
        path = export_onnx(model, Path(d) / 'model.onnx', (1,) + X.shape[1:])
        np.save(Path(d) / 'x.npy', X)
        r = subprocess.run([sys.executable, '-c', ORT_CHILD, str(path), str(Path(d) / 'x.npy')], capture_output=True,
                           text=True, check=True)
    ort_first, ort_six = (int(v) / 1e6 for v in r.stdout.split())
    return dict(eager=eager, arena=arena, first_call=first_call, ort_first=ort_first, ort_six=ort_six)


if __name__ == '__main__':
    names = sys.argv[1:] or ['digits_cnn_wide', 'resnet8', 'mobilenet_v2_tiny']
    print(f"{'model (float32, batch 64)':26s} {'eager peak':>11s} {'frozen arena':>13s} {'frozen 1st call':>16s} "
          f"{'ORT 1st run':>12s} {'ORT 6 runs':>11s}   (MB)")
    for name in names:
        m = measure(name)
        print(f"{name:26s} {m['eager']:11.2f} {m['arena']:13.2f} {m['first_call']:16.2f} {m['ort_first']:+12.2f} "
              f"{m['ort_six']:+11.2f}")
    print("\nsteady state, 50 calls after a warm-up: NumPy array bytes kept / most bytes held at any moment")
    for name in names:
        model = load_pretrained(name)
        X = load_shipped(model_data(name), 'test')[0][:64]
        q = quantize_static(model, load_shipped(model_data(name), 'train')[0][:256])
        for precision, m in (('float32', model), ('int8', q)):
            frozen = freeze(m, X[:4])
            cells = [steady_state_allocations(frozen, X[:b], 50) for b in (1, 64)]
            print(f"{name:18s} {precision:8s} " + '   '.join(f"batch {b}: {c['array_bytes']} / {c['peak_bytes']:,}"
                                                          for b, c in zip((1, 64), cells)))
