"""Benchmark (not collected by pytest): `compare` run twice on the same models (digits_cnn_wide float32 against
int8, 50 % channel-pruned and an identical copy): do the speedup intervals of the two runs overlap, and which medians
have a coefficient of variation above 10 %? Run from the repository: `python tests/bench_compare_twice.py`."""
import copy
from tinycomp.benchmarking import compare
from tinycomp.data import load_digits
from tinycomp.models import load_pretrained
from tinycomp.pruning import prune_channels
from tinycomp.quantization import quantize_static
wide = load_pretrained('digits_cnn_wide'); test = load_digits('test')
cands = {'int8': quantize_static(wide, load_digits('train')[0][:256]), 'pruned50': prune_channels(wide, 0.5, input_shape=(1, 1, 8, 8)),
         'identical copy': copy.deepcopy(wide)}
runs = [compare(('float32', wide), cands, test, seed=s) for s in (0, 1)]
print(runs[0].table())
for name in cands:
    for b in (1, 64):
        s1, s2 = (r.row(name)['speedup'][b] for r in runs)
        ok = s1['ci_low'] <= s2['ci_high'] and s2['ci_low'] <= s1['ci_high']
        print(f"{name:15s} b{b:<3d} run1 {s1['ratio']:.3f} [{s1['ci_low']:.3f}, {s1['ci_high']:.3f}]  "
              f"run2 {s2['ratio']:.3f} [{s2['ci_low']:.3f}, {s2['ci_high']:.3f}]  {'overlap' if ok else 'NO OVERLAP'}")
cvs = [(k, b, r.result(k).latency[b]['cv']) for r in runs for k in r.results for b in (1, 64)]
print('CV of every median: max {:.1%}; above 10 %: {}'.format(max(c for *_, c in cvs), [(k, b, round(c, 3)) for k, b, c in cvs if c > 0.1]))
