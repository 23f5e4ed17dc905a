"""A layer type defined here, outside the package, joins every tool through the methods each tool asks of a layer:
profiled (`cost`), saved and loaded (`register_layer`, `config`), pruned across (`channel_flow`, `keep_channels`),
quantized (no `int8_plan`: it stays float32 with a warning) and exported to ONNX (`export_onnx`), without a line of the
package changed."""
import warnings

import numpy as np
import pytest

from tinycomp import io as tio
from tinycomp.conv import Conv2d
from tinycomp.data import load_digits
from tinycomp.errors import TinycompWarning
from tinycomp.files import register_layer
from tinycomp.graph import trace
from tinycomp.nn.modules import Flatten, Linear, Module, Parameter, ReLU, Sequential
from tinycomp.pooling import MaxPool2d
from tinycomp.tensor import Tensor, manual_seed, no_grad


@register_layer
class ChannelScale(Module):
    "y[:, c] = x[:, c] * scale[c]: a learned gain per channel (what a BatchNorm is without its statistics)."
    def __init__(self, channels):
        super().__init__()
        self.scale = Parameter(np.linspace(0.5, 1.5, int(channels)).astype(np.float32))

    def config(self): return dict(channels=len(self.scale.data))
    def forward(self, x): return x * self.scale.reshape(1, -1, 1, 1)

    # what the tools ask of a layer type
    def cost(self, in_shape):                                        # profiling: one multiply per value
        return dict(output_shape=tuple(in_shape), flops=int(np.prod(in_shape)), params=self.scale.data.size, output_itemsize=None)
    def channel_flow(self, in_shape): return 'same'                  # structured pruning: channel c in, channel c out (0 stays 0)
    def keep_channels(self, in_keeps, out_keep):
        new = ChannelScale(len(out_keep))
        new.scale.data = self.scale.data[out_keep].copy()
        return new
    def export_onnx(self, g, x):                                     # ONNX: a Mul by the gains, one per channel
        return g.node('Mul', [x, g.const('scale', self.scale.data.reshape(1, -1, 1, 1))])


def model():
    manual_seed(0)
    return Sequential(Conv2d(1, 8, 3, padding=1), ChannelScale(8), ReLU(), Conv2d(8, 8, 3, padding=1), ChannelScale(8),
                      ReLU(), MaxPool2d(2), Flatten(), Linear(8 * 16, 10)).eval()


X = load_digits('test')[0][:32]


def run(m, x=X):
    with no_grad(): return m(Tensor(x)).data


def test_a_new_layer_type_is_traced_profiled_saved_and_loaded(tmp_path):
    from tinycomp.profiling.counting import profile_model
    m = model()
    assert [n.op for n in trace(m, X[:1])][:3] == ['Conv2d', 'ChannelScale', 'ReLU']
    rows = profile_model(m, X[:4], repeats=2, warmup=1).rows
    row = next(r for r in rows if r['type'] == 'ChannelScale')
    assert row['flops'] == 4 * 8 * 8 * 8 and row['params'] == 8
    back = tio.load(tio.save(m, tmp_path / 'm.npz')).eval()
    np.testing.assert_array_equal(run(back), run(m))


def test_a_new_layer_type_is_pruned_across():
    from tinycomp.pruning.structured import channel_plan, prune_channels
    m = model()
    new = prune_channels(m, 0.5, input_shape=(1, 1, 8, 8))
    assert [len(l.scale.data) for l in new if isinstance(l, ChannelScale)] == [4, 4] and new[3].in_channels == 4
    plan = channel_plan(m, 0.5, input_shape=(1, 1, 8, 8))
    off = lambda c, keep: np.setdiff1d(np.arange(c), keep)
    ref = model()                                                    # the original with the removed channels switched off
    for i in (0, 3):
        ref[i].weight.data[off(8, plan[str(i)])] = 0
        ref[i].bias.data[off(8, plan[str(i)])] = 0
    np.testing.assert_allclose(run(new), run(ref), rtol=1e-5, atol=1e-5)


def test_a_new_layer_type_is_kept_float_by_quantization_with_a_note():
    from tinycomp.quantization import quantize_static
    m = model()
    with pytest.warns(TinycompWarning, match=r"'1' \(ChannelScale\) stays float32"):
        q = quantize_static(m, load_digits('train')[0][:128])
    kinds = [type(l).__name__ for l in q]
    assert kinds.count('ChannelScale') == 2 and kinds.count('QuantizedConv2d') == 2 and kinds[-2] == 'QuantizedLinear'
    assert (run(q).argmax(1) == run(m).argmax(1)).mean() >= 0.9


def test_a_new_layer_type_is_exported_to_onnx(tmp_path):
    from tinycomp.onnx import export_onnx, ort_agreement
    m = model()
    p = export_onnx(m, tmp_path / 'm.onnx', (1, 1, 8, 8))
    r = ort_agreement(m, p, X)
    assert r['rel_err'] <= 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', TinycompWarning)
        from tinycomp.quantization import quantize_static
        q = quantize_static(m, load_digits('train')[0][:128])
    r = ort_agreement(q, export_onnx(q, tmp_path / 'q.onnx', (1, 1, 8, 8)), X)
    assert r['class_agreement'] >= 0.95
