"""Tests for the compression pipeline of module 07: tinycomp.benchmarking.stages (stages, recipes), .compression
(stage_table, compress and its report, the CLI) and .sweep (sweeps and recommend)."""
import copy
import json
import math
import sys

import numpy as np
import pytest

from tinycomp.benchmarking.compression import compress, compress_command, stage_table
from tinycomp.io import model_size
from tinycomp.models import resolve_model
from tinycomp.nn import parameter_counts
from tinycomp.benchmarking.stages import (DEFAULT_RECIPE, STAGES, Stage, check_data, load_recipe, make_context, model_kind,
                                          run_stage, stages_help)
from tinycomp.benchmarking.sweep import default_configurations, example_budgets, recommend, strategy_sweep
from tinycomp.cli import BENCHMARKS, COMMANDS, build_parser, main, registered
from tinycomp.data import DataLoader, load_digits
from tinycomp.distillation import tiny_cnn
from tinycomp.errors import ShapeError, TinycompError
from tinycomp.io import load, save
from tinycomp.models import evaluate, fit
from tinycomp.optim import Adam
from tinycomp.tensor import manual_seed

pytestmark = pytest.mark.module07

FAST = dict(rounds=2, calls=1)


def snapshot(m): return {k: v.copy() for k, v in m.state_dict().items()}


def same_state(a, b): return list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope='module')
def data():
    return {s: (X[:160], y[:160]) for s, (X, y) in ((s, load_digits(s)) for s in ('train', 'val', 'test'))}


@pytest.fixture(scope='module')
def model(data):
    "A tiny CNN trained for 2 epochs on the slice: good enough to have an accuracy worth keeping."
    manual_seed(0)
    m = tiny_cnn(8)
    fit(m, DataLoader(*data['train'], batch_size=32, shuffle=True, seed=0), epochs=2,
        optimizer=Adam(m.parameters(), lr=1e-2), progress=False)
    return m.eval()


@pytest.fixture(scope='module')
def ctx(model, data): return make_context(model, data)


@pytest.fixture(scope='module')
def quantized(model, ctx): return run_stage('quantize_static', model, {'calibration_size': 32}, ctx)


@pytest.fixture(scope='module')
def sparse(model, ctx): return run_stage('prune', model, {'epochs': 0, 'amount': 0.8}, ctx)


def listing(tmp_path): return sorted(p.name for p in tmp_path.iterdir())


# --- recipes ------------------------------------------------------------------------------------------------------
def test_default_recipe_filled_in():
    r = load_recipe('default')
    assert [next(iter(i)) for i in r] == ['prune_channels', 'distill', 'quantize_static']
    assert r[0]['prune_channels'] == {'ratio': 0.5, 'importance': 'l1'}
    assert r[1]['distill'] == {'teacher': 'original', 'epochs': 8, 'T': 4.0, 'alpha': 0.5, 'lr': 1e-3}
    assert r[2]['quantize_static'] == {'per_channel': True, 'observer': 'minmax', 'weight_bits': 8, 'calibration_size': 256}
    assert load_recipe(DEFAULT_RECIPE) == r
    assert DEFAULT_RECIPE[0] == {"prune_channels": {"ratio": 0.5}}          # the constant is not filled in place


def test_recipe_input_not_modified():
    src = [{'fine_tune': {'epochs': 3}}, {'quantize_dynamic': None}]
    before = copy.deepcopy(src)
    r = load_recipe(src)
    assert src == before
    assert r == [{'fine_tune': {'epochs': 3, 'lr': 1e-3}}, {'quantize_dynamic': {}}]


def test_empty_recipe():
    with pytest.raises(TinycompError, match='the recipe is empty.*valid stages: prune_channels, prune, fine_tune, distill'):
        load_recipe([])


def test_unknown_stage_lists_valid_ones():
    with pytest.raises(TinycompError) as e: load_recipe([{'quantise_static': {}}])
    msg = str(e.value)
    assert "recipe item 1: unknown stage 'quantise_static'" in msg and "did you mean 'quantize_static'" in msg
    for name in STAGES: assert name in msg


def test_unknown_option_lists_accepted_ones():
    with pytest.raises(TinycompError) as e: load_recipe([{'fine_tune': {}}, {'distill': {'temperature': 3}}])
    msg = str(e.value)
    assert "recipe item 2: stage 'distill' has no option 'temperature'" in msg
    for opt in ("teacher (default 'original'", 'epochs (default 8', 'T (default 4.0', 'alpha (default 0.5', 'lr (default 0.001'):
        assert opt in msg
    with pytest.raises(TinycompError, match="stage 'quantize_dynamic' has no option 'bits'; it accepts: no options"):
        load_recipe([{'quantize_dynamic': {'bits': 8}}])


@pytest.mark.parametrize('item, words', [
    ({'prune_channels': {'ratio': 1.0}}, "'ratio' must be a number in (0, 1), got 1.0"),
    ({'prune_channels': {'ratio': 0}}, "'ratio' must be a number in (0, 1)"),
    ({'prune_channels': {'ratio': 'half'}}, "'ratio' must be a number"),
    ({'prune_channels': {'importance': 'l3'}}, "'importance' must be one of 'l1', 'l2', 'bn_gamma'"),
    ({'prune': {'epochs': -1}}, "'epochs' must be an integer >= 0"),
    ({'prune': {'sparse': 'yes'}}, "'sparse' must be true or false"),
    ({'prune': {'method': 'random'}}, "'method' must be one of 'global', 'l1'"),
    ({'fine_tune': {'epochs': 1.5}}, "'epochs' must be an integer >= 1"),
    ({'fine_tune': {'epochs': True}}, "'epochs' must be an integer"),
    ({'fine_tune': {'lr': 0}}, "'lr' must be a number in (0, 1]"),
    ({'fine_tune': {'lr': float('nan')}}, "'lr' must be a number"),
    ({'distill': {'T': -1}}, "'T' must be a number > 0"),
    ({'distill': {'alpha': 1.5}}, "'alpha' must be a number in [0, 1]"),
    ({'distill': {'teacher': 3}}, "'teacher' must be a string"),
    ({'quantize_static': {'per_channel': 1}}, "'per_channel' must be true or false"),
    ({'quantize_static': {'observer': 'max'}}, "'observer' must be one of 'minmax', 'moving_average'"),
    ({'quantize_static': {'weight_bits': 5}}, "'weight_bits' must be one of 2, 3, 4, 8"),
    ({'quantize_static': {'calibration_size': 0}}, "'calibration_size' must be an integer >= 1"),
    ({'fine_tune': [1]}, "options must be a dict"),
])
def test_bad_options(item, words):
    with pytest.raises(TinycompError) as e: load_recipe([item])
    assert words in str(e.value)
    assert f"stage {next(iter(item))!r}" in str(e.value)


@pytest.mark.parametrize('source, words', [
    ({'prune': {}}, 'a recipe is a list'),
    ([{'prune': {}, 'fine_tune': {}}], 'recipe item 1 must be a one-key dict'),
    (['prune'], 'recipe item 1 must be a one-key dict'),
    (42, 'a recipe is a list'),
])
def test_malformed_recipes(source, words):
    with pytest.raises(TinycompError, match=words): load_recipe(source)


def test_recipe_order_checked_before_running():
    with pytest.raises(TinycompError) as e: load_recipe([{'quantize_static': {}}, {'prune': {'sparse': False}}])
    msg = str(e.value)
    assert "recipe stage 2: stage 'prune' cannot run on a quantized model" in msg
    assert 'made by stage 1, quantize_static' in msg and 'put quantization last' in msg
    with pytest.raises(TinycompError, match="stage 'distill' cannot run on a sparse model.*sparse=false"):
        load_recipe([{'prune': {}}, {'distill': {}}])
    with pytest.raises(TinycompError, match="stage 'quantize_static' cannot run on a quantized model"):
        load_recipe([{'quantize_dynamic': {}}, {'quantize_static': {}}])
    # what the advice says works
    load_recipe([{'prune': {'sparse': False}}, {'distill': {}}, {'to_sparse': {}}])
    load_recipe([{'prune': {'sparse': False}}, {'quantize_static': {}}])
    load_recipe([{'prune': {}}, {'quantize_dynamic': {}}])


def test_json_and_toml_recipes(tmp_path):
    (tmp_path / 'r.json').write_text(json.dumps([{'prune_channels': {'ratio': 0.25}}, {'fine_tune': {'epochs': 1}}]))
    (tmp_path / 'r.toml').write_text('[[stage]]\nname = "prune_channels"\nratio = 0.25\n\n[[stage]]\nname = "fine_tune"\nepochs = 1\n')
    a, b = load_recipe(tmp_path / 'r.json'), load_recipe(str(tmp_path / 'r.toml'))
    assert a == b == [{'prune_channels': {'ratio': 0.25, 'importance': 'l1'}}, {'fine_tune': {'epochs': 1, 'lr': 1e-3}}]


@pytest.mark.parametrize('name, text, words', [
    ('bad.json', '[{"prune": {}', 'not valid JSON'),
    ('bad.toml', 'stage = [', 'not valid TOML'),
    ('noname.toml', '[[stage]]\nratio = 0.5\n', '[[stage]] number 1 has no name key'),
    ('keys.toml', 'prune = 1\n', 'a TOML recipe is a list of [[stage]] tables'),
    ('r.yaml', '- prune: {}\n', "unknown file type '.yaml'"),
    ('empty.json', '[]', 'the recipe is empty'),
    ('unknown.toml', '[[stage]]\nname = "shrink"\n', "unknown stage 'shrink'"),
])
def test_bad_recipe_files(tmp_path, name, text, words):
    (tmp_path / name).write_text(text)
    with pytest.raises(TinycompError) as e: load_recipe(tmp_path / name)
    assert words in str(e.value)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(TinycompError, match='does not exist'): load_recipe(tmp_path / 'nope.json')


def test_toml_without_tomllib(tmp_path, monkeypatch):
    "Python 3.10 has no tomllib: a clear message saying to use JSON."
    (tmp_path / 'r.toml').write_text('[[stage]]\nname = "fine_tune"\n')
    monkeypatch.setitem(sys.modules, 'tomllib', None)
    with pytest.raises(TinycompError, match=r'Python 3\.11 or later \(tomllib\); write the recipe as JSON'):
        load_recipe(tmp_path / 'r.toml')


# --- stages -------------------------------------------------------------------------------------------------------
def test_registry_shape():
    assert {'prune_channels', 'prune', 'fine_tune', 'distill', 'quantize_static', 'quantize_dynamic'} <= set(STAGES)
    for name, s in STAGES.items():
        assert s.name == name and callable(s.fn) and s.doc and '\n' not in s.doc
        for o in s.options.values(): assert o.check(name, 'x', o.default) == o.default
    assert STAGES['prune_channels'].options['ratio'].default == 0.5
    assert STAGES['prune'].options['sparse'].default is True
    help_text = stages_help()
    assert all(name in help_text for name in STAGES)


@pytest.mark.parametrize('name, opts, kind', [
    ('prune_channels', {'ratio': 0.5}, 'float'),
    ('prune', {'epochs': 1, 'amount': 0.7}, 'sparse'),
    ('prune', {'epochs': 0, 'amount': 0.7, 'sparse': False}, 'float'),
    ('fine_tune', {'epochs': 1}, 'float'),
    ('distill', {'epochs': 1}, 'float'),
    ('distill', {'epochs': 1, 'teacher': 'digits_cnn'}, 'float'),
    ('quantize_static', {'calibration_size': 16, 'weight_bits': 4, 'per_channel': False, 'observer': 'percentile'}, 'quantized'),
    ('quantize_dynamic', {}, 'quantized'),
])
def test_stage_returns_new_model_input_untouched(model, ctx, name, opts, kind):
    before, training = snapshot(model), model.training
    new = run_stage(name, model, opts, ctx)
    assert new is not model and same_state(before, snapshot(model)) and model.training == training
    assert model_kind(new)[0] == kind
    assert not new.training
    acc = evaluate(new, ctx['data']['test']).accuracy
    assert 0 <= acc <= 1


def test_stage_results(model, ctx, quantized, sparse):
    small = run_stage('prune_channels', model, {'ratio': 0.75}, ctx)
    assert small[0].out_channels == 2 and small[-1].in_features == 2 * 16          # physically smaller
    masked = run_stage('prune', model, {'epochs': 0, 'amount': 0.8, 'sparse': False}, ctx)
    w = np.concatenate([m.weight.data.ravel() * m.weight_mask.ravel() for m in masked.modules() if hasattr(m, 'weight_mask')])
    assert abs((w == 0).mean() - 0.8) < 0.01
    assert model_size(sparse) < model_size(model)                                   # stored sparse: the file shrinks
    # masked layers fold into int8 zeros; the masks survive fine-tuning
    tuned = run_stage('fine_tune', masked, {'epochs': 1}, ctx)
    assert parameter_counts(tuned)[1] == parameter_counts(masked)[1]
    assert model_kind(run_stage('quantize_static', tuned, {'calibration_size': 16}, ctx))[0] == 'quantized'
    assert model_kind(run_stage('to_sparse', tuned, {}, ctx))[0] == 'sparse'


def test_training_stages_are_deterministic(model, ctx):
    a = run_stage('fine_tune', model, {'epochs': 1}, ctx)
    b = run_stage('fine_tune', model, {'epochs': 1}, ctx)
    assert same_state(snapshot(a), snapshot(b))
    assert not same_state(snapshot(a), snapshot(model))


@pytest.mark.parametrize('name', ['prune_channels', 'prune', 'fine_tune', 'distill', 'quantize_static', 'quantize_dynamic', 'to_sparse'])
def test_stage_after_quantization_names_the_layer(quantized, ctx, name):
    with pytest.raises(TinycompError) as e: run_stage(name, quantized, {}, ctx)
    msg = str(e.value)
    assert f"stage {name!r} cannot run on a quantized model: layer '0' is a QuantStub" in msg
    assert 'put quantization last' in msg


@pytest.mark.parametrize('name', ['prune_channels', 'prune', 'fine_tune', 'distill', 'quantize_static', 'to_sparse'])
def test_stage_after_sparse_names_the_layer(sparse, ctx, name):
    layer = model_kind(sparse)[1]
    with pytest.raises(TinycompError, match=f"cannot run on a sparse model: layer '{layer}' is a Sparse.*sparse=false"):
        run_stage(name, sparse, {}, ctx)


def test_quantize_dynamic_without_linear(ctx):
    from tinycomp.conv import Conv2d
    from tinycomp.nn import Sequential
    conv_only = Sequential(Conv2d(1, 10, 8))
    with pytest.raises(TinycompError, match='no float Linear layer'):
        run_stage('quantize_dynamic', conv_only, {}, ctx)


def test_run_stage_errors(model, ctx):
    with pytest.raises(TinycompError, match='unknown stage .*valid stages: prune_channels'): run_stage('shrink', model, {}, ctx)
    with pytest.raises(TinycompError, match="has no option 'ratios'"): run_stage('prune_channels', model, {'ratios': 0.5}, ctx)
    with pytest.raises(TinycompError, match='expected a tinycomp Module'): run_stage('fine_tune', 'model', {}, ctx)


def test_teachers(model, ctx, tmp_path):
    save(model, tmp_path / 't.npz')
    a = run_stage('distill', model, {'epochs': 1, 'teacher': str(tmp_path / 't.npz')}, ctx)
    b = run_stage('distill', model, {'epochs': 1, 'teacher': 'original'}, ctx)
    assert same_state(snapshot(a), snapshot(b))                # the same teacher, from a file or from the context
    with pytest.raises(TinycompError, match="'.*missing.npz' is neither a shipped model"):
        run_stage('distill', model, {'epochs': 1, 'teacher': str(tmp_path / 'missing.npz')}, ctx)


def test_resolve_model(model, tmp_path):
    assert resolve_model(model) is model
    assert resolve_model('digits_cnn')[0].out_channels == 16
    save(model, tmp_path / 'm.npz')
    assert same_state(snapshot(resolve_model(tmp_path / 'm.npz')), snapshot(model))
    with pytest.raises(TinycompError, match='digits_cnn, digits_cnn_wide'): resolve_model('resnet50')
    with pytest.raises(TinycompError): resolve_model(3)


# --- data -------------------------------------------------------------------------------------------------------
def test_check_data(model, data):
    d = check_data(model, data)
    assert set(d) == {'train', 'val', 'test'} and d['train'][0].dtype == np.float32 and d['train'][1].dtype == np.int64
    no_val = check_data(model, {'train': data['train'], 'test': data['test']})
    assert set(no_val) == {'train', 'test'}
    assert check_data(model)['test'][0].shape == load_digits('test')[0].shape


@pytest.mark.parametrize('make, words', [
    (lambda d: [d['train'], d['test']], 'data must be a dict'),
    (lambda d: {'train': d['train']}, "missing ['test']"),
    (lambda d: dict(d, extra=d['test']), "unknown ['extra']"),
    (lambda d: dict(d, test=d['test'][0]), "data['test'] must be a pair"),
    (lambda d: dict(d, test=(d['test'][0], d['test'][1][:5])), 'one label per sample'),
    (lambda d: dict(d, test=(d['test'][0], d['test'][1].astype(np.float32))), 'labels must be class indices'),
    (lambda d: dict(d, test=(np.full_like(d['test'][0], np.nan), d['test'][1])), 'NaN'),
    (lambda d: dict(d, train=(d['train'][0][:, :, :4], d['train'][1])), 'samples of different shapes'),
    (lambda d: dict(d, test=(d['test'][0], d['test'][1] + 10)), 'the labels go up to 19'),
])
def test_bad_data(model, data, make, words):
    with pytest.raises(TinycompError) as e: check_data(model, make(data))
    assert words in str(e.value)


def test_data_shape_mismatch_fails_before_training(model, monkeypatch):
    big = {s: (np.zeros((8, 1, 28, 28), np.float32), np.arange(8) % 10) for s in ('train', 'test')}
    monkeypatch.setattr('tinycomp.benchmarking.compression.run_stage', lambda *a, **k: pytest.fail('a stage ran before the data was checked'))
    with pytest.raises(ShapeError, match=r'the model cannot take the data: its samples have shape \(1, 28, 28\)'):
        compress(model, [{'fine_tune': {'epochs': 1}}], big, progress=False)


def test_missing_teacher_fails_before_training(model, quantized, data, tmp_path, monkeypatch):
    monkeypatch.setattr('tinycomp.benchmarking.compression.run_stage', lambda *a, **k: pytest.fail('a stage ran before the teacher was checked'))
    with pytest.raises(TinycompError, match='neither a shipped model'):
        compress(model, [{'fine_tune': {}}, {'distill': {'teacher': str(tmp_path / 'x.npz')}}], data, progress=False)
    with pytest.raises(TinycompError, match='layer .0. is a QuantStub'):      # the real model's kind is checked too
        compress(quantized, [{'fine_tune': {}}], data, progress=False)


# --- stage_table --------------------------------------------------------------------------------------------------
def rows3():
    return [dict(stage='original', accuracy=0.9, file_bytes=1000, latency_s={1: 0.004, 8: 0.02, 64: 0.1}),
            dict(stage='a', accuracy=0.8, file_bytes=250, latency_s={1: 0.002, 8: 0.004, 64: 0.05}),
            dict(stage='b', accuracy=0.95, file_bytes=500, latency_s={1: 0.001, 8: 0.008, 64: 0.025})]


def test_stage_table_values():
    m = rows3()
    before = copy.deepcopy(m)
    t = stage_table(m)
    assert m == before
    assert [r['stage'] for r in t] == ['original', 'a', 'b']
    assert [r['compression'] for r in t] == [1.0, 4.0, 2.0]
    assert [r['step_compression'] for r in t] == [1.0, 4.0, 0.5]                 # b is bigger than a
    assert t[2]['speedup'] == {1: 4.0, 8: 2.5, 64: 4.0}
    assert t[2]['step_speedup'] == {1: 2.0, 8: 0.5, 64: 2.0}                    # b is slower than a at batch 8
    assert t[0]['speedup'] == t[0]['step_speedup'] == {1: 1.0, 8: 1.0, 64: 1.0}
    assert np.allclose([r['dacc_points'] for r in t], [0, -10, 5])
    assert all(isinstance(r['compression'], float) and isinstance(r['dacc_points'], float) for r in t)
    t[1]['latency_s'][1] = 99
    assert m[1]['latency_s'][1] == 0.002                                         # copies, not the input's dicts
    # cumulative = product of steps
    assert math.isclose(t[2]['compression'], t[1]['step_compression'] * t[2]['step_compression'])


@pytest.mark.parametrize('make, words', [
    (lambda m: [], 'non-empty list'),
    (lambda m: 'x', 'non-empty list'),
    (lambda m: [{k: v for k, v in m[0].items() if k != 'accuracy'}], "lacks ['accuracy']"),
    (lambda m: [m[0], dict(m[1], file_bytes=0)], 'file_bytes must be positive'),
    (lambda m: [m[0], dict(m[1], file_bytes=-3)], 'file_bytes must be positive'),
    (lambda m: [m[0], dict(m[1], latency_s={1: 0.0, 8: 1, 64: 1})], 'positive seconds'),
    (lambda m: [m[0], dict(m[1], latency_s={1: -1.0, 8: 1, 64: 1})], 'positive seconds'),
    (lambda m: [m[0], dict(m[1], latency_s={1: 1.0, 8: 1})], 'same batch sizes'),
    (lambda m: [m[0], dict(m[1], accuracy=1.5)], 'accuracy must be a fraction'),
])
def test_stage_table_errors(make, words):
    with pytest.raises(TinycompError, match=words.replace('[', r'\[').replace(']', r'\]')): stage_table(make(rows3()))


# --- compress -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def compressed(model, data):
    before = snapshot(model)
    final, rep = compress(model, [{'prune_channels': {'ratio': 0.5}}, {'fine_tune': {'epochs': 1}},
                                    {'fine_tune': {'epochs': 1}}, {'quantize_static': {'calibration_size': 64}}],
                            data, progress=False, **FAST)
    assert same_state(before, snapshot(model))
    return final, rep


def test_report_rows(compressed, data):
    final, rep = compressed
    assert [r['stage'] for r in rep.rows] == ['original', 'prune_channels', 'fine_tune', 'fine_tune#2', 'quantize_static']
    assert rep.measured and rep.batch_sizes == (1, 64)
    assert model_kind(final)[0] == 'quantized'
    assert math.isclose(rep.rows[-1]['accuracy'], evaluate(final, data['test']).accuracy)
    assert rep.rows[0]['options'] is None and rep.rows[1]['options'] == {'ratio': 0.5, 'importance': 'l1'}
    assert rep.rows[0]['seconds'] == 0.0 and all(r['seconds'] >= 0 for r in rep.rows)
    assert rep.recipe[2] == {'fine_tune': {'epochs': 1, 'lr': 1e-3}}


def test_report_matches_harness(compressed):
    _, rep = compressed
    cmp = rep.comparison
    assert list(cmp.results) == [r['stage'] for r in rep.rows]                   # one comparison, every stage
    for r in rep.rows:
        h, res = cmp.row(r['stage']), cmp.result(r['stage'])
        assert r['file_bytes'] == h['file_bytes'] == res.file_bytes
        assert math.isclose(r['compression'], h['compression'])
        assert math.isclose(r['accuracy'], h['accuracy']) and math.isclose(r['dacc_points'], h['dacc_points'], abs_tol=1e-9)
        assert r['p_value'] == h['p_value'] and r['significant'] == h['significant']
        assert (r['params'], r['nonzero_params']) == (res.params, res.nonzero_params)
        for b in (1, 64):
            assert math.isclose(r['latency_ms'][b], h['latency_ms'][b])
            assert math.isclose(r['speedup'][b], h['speedup'][b]['ratio'])
            assert r['speedup_ci'][b] == (h['speedup'][b]['ci_low'], h['speedup'][b]['ci_high'])
            assert r['noisy'][b] == h['noisy'][b]
    for prev, r in zip(rep.rows, rep.rows[1:]):
        assert math.isclose(r['step_compression'], prev['file_bytes'] / r['file_bytes'])
        for b in (1, 64): assert math.isclose(r['step_speedup'][b], prev['latency_ms'][b] / r['latency_ms'][b])


def test_report_outputs(compressed, tmp_path):
    _, rep = compressed
    text = rep.table()
    assert 'speedup = baseline latency / candidate latency (>1 = faster' in text
    assert 'compression = baseline bytes / candidate bytes (>1 = smaller)' in text
    assert 'b64 speedup [95% CI]' in text and 'fine_tune#2' in text
    d = json.loads(json.dumps(rep.to_dict()))
    assert [r['stage'] for r in d['rows']] == [r['stage'] for r in rep.rows]
    assert d['rows'][1]['speedup']['64'] == rep.rows[1]['speedup'][64]
    fig = rep.plot(tmp_path / 'r.png')
    assert (tmp_path / 'r.png').stat().st_size > 1000 and len(fig.axes) == 3
    import matplotlib.pyplot as plt
    plt.close(fig)
    assert rep.row('fine_tune#2')['stage'] == 'fine_tune#2'
    with pytest.raises(TinycompError, match='no stage'): rep.row('distill')


def test_compress_without_measuring(model, data):
    final, rep = compress(model, [{'prune_channels': {'ratio': 0.25}}, {'quantize_dynamic': {}}], data,
                            measure=False, progress=False)
    assert not rep.measured and rep.comparison is None
    assert rep.rows[2]['latency_ms'] is None and rep.rows[2]['speedup'] is None
    assert rep.rows[2]['file_bytes'] == model_size(final)
    assert (rep.rows[2]['params'], rep.rows[2]['nonzero_params']) == parameter_counts(final)
    assert math.isclose(rep.rows[2]['compression'], rep.rows[0]['file_bytes'] / model_size(final))
    assert 'latency not measured' in rep.table()
    json.dumps(rep.to_dict())
    import matplotlib.pyplot as plt
    plt.close(rep.plot())


def test_compress_is_deterministic(model, data):
    r = [{'prune_channels': {'ratio': 0.5}}, {'distill': {'epochs': 1}}]
    a, _ = compress(model, r, data, measure=False, progress=False, seed=3)
    b, _ = compress(model, r, data, measure=False, progress=False, seed=3)
    assert same_state(snapshot(a), snapshot(b))


# --- CLI ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def model_file(model, tmp_path):
    save(model, tmp_path / 'm.npz')
    return tmp_path / 'm.npz'


def test_cli_registered():
    assert registered(COMMANDS)['compress'].value == 'tinycomp.benchmarking.compression:add_cli'
    assert registered(BENCHMARKS)['strategies'].value == 'tinycomp.benchmarking.sweep:add_bench_cli'
    parser = build_parser()
    args = parser.parse_args(['compress', 'default', '--model', 'digits_cnn', '--threads', '1'])
    assert (args.recipe, args.model, args.out, args.threads, args.seed, args.no_progress) == ('default', 'digits_cnn', 'tinycomp_compress', 1, 0, False)
    args = parser.parse_args(['bench', 'strategies', '--epochs', '2', '--out', 'runs'])
    assert (args.epochs, args.out, args.model) == (2, 'runs', 'digits_cnn_wide')
    assert parser.parse_args(['bench', 'strategies']).out == 'tinycomp_bench'


def test_cli_compress_writes_three_files_into_its_folder(model_file, tmp_path, writes_only, capsys):
    (tmp_path / 'r.toml').write_text('[[stage]]\nname = "fine_tune"\nepochs = 1\n\n[[stage]]\nname = "quantize_static"\n')
    code = main(['compress', str(tmp_path / 'r.toml'), '--model', str(model_file), '--no-progress'])   # --out tinycomp_compress
    assert code == 0
    out = capsys.readouterr().out
    assert writes_only.check(out, 'tinycomp_compress') == ['tinycomp_compress/compression_report.json',
                                                           'tinycomp_compress/compression_report.png', 'tinycomp_compress/m_compressed.npz']
    assert 'quantize_static' in out and 'speedup = baseline latency / candidate latency' in out
    folder = writes_only.cwd / 'tinycomp_compress'
    m = load(folder / 'm_compressed.npz')
    assert model_kind(m)[0] == 'quantized'
    rep = json.loads((folder / 'compression_report.json').read_text())
    assert [r['stage'] for r in rep['rows']] == ['original', 'fine_tune', 'quantize_static']
    assert rep['rows'][-1]['file_bytes'] == (folder / 'm_compressed.npz').stat().st_size
    assert rep['model_file'] == 'tinycomp_compress/m_compressed.npz'
    assert (folder / 'compression_report.png').read_bytes()[:4] == b'\x89PNG'


def test_compress_command_names_its_files_after_the_model(model_file, tmp_path):
    r = compress_command([{'quantize_dynamic': {}}], model_file, tmp_path / 'runs' / 'q', progress=False, **FAST)
    assert listing(tmp_path / 'runs' / 'q') == ['compression_report.json', 'compression_report.png', 'm_compressed.npz']
    assert r['model_file'] == str(tmp_path / 'runs' / 'q' / 'm_compressed.npz') and r['model'] == str(model_file)
    compress_command([{'quantize_dynamic': {}}], 'digits_cnn', tmp_path / 'runs' / 'q', progress=False, **FAST)
    assert 'digits_cnn_compressed.npz' in listing(tmp_path / 'runs' / 'q')       # a pretrained model: its name


@pytest.mark.parametrize('argv, words', [
    (['[]'], 'empty'),
    (['[{"shrink": {}}]'], "unknown stage 'shrink'"),
    (['[{"quantize_static": {}}, {"prune_channels": {}}]'], 'put quantization last'),
])
def test_cli_bad_recipe_leaves_nothing(model_file, tmp_path, capsys, argv, words):
    (tmp_path / 'r.json').write_text(argv[0])
    code = main(['compress', str(tmp_path / 'r.json'), '--model', str(model_file), '--out', str(tmp_path / 'o'), '--no-progress'])
    assert code == 2 and words in capsys.readouterr().err
    assert listing(tmp_path) == ['m.npz', 'r.json']


def test_cli_bad_paths(model_file, tmp_path, capsys):
    assert main(['compress', 'default', '--model', str(model_file), '--out', str(model_file)]) == 2
    assert 'exists and is not a directory' in capsys.readouterr().err
    assert main(['compress', 'default', '--model', 'nomodel', '--out', str(tmp_path / 'o')]) == 2
    assert 'neither a shipped model' in capsys.readouterr().err
    assert main(['compress', str(tmp_path / 'missing.json'), '--model', str(model_file), '--out', str(tmp_path / 'no' / 'o')]) == 2
    assert 'does not exist' in capsys.readouterr().err
    assert listing(tmp_path) == ['m.npz']


def test_cli_error_while_writing_leaves_nothing(model_file, tmp_path, monkeypatch, capsys):
    def broken(fig, path): raise TinycompError('disk full')
    monkeypatch.setattr('tinycomp.benchmarking.compression._save_figure', broken)                   # the PNG is written after the model's temp file
    (tmp_path / 'r.json').write_text('[{"quantize_dynamic": {}}]')
    code = main(['compress', str(tmp_path / 'r.json'), '--model', str(model_file), '--out', str(tmp_path / 'o'), '--no-progress'])
    assert code == 2 and 'disk full' in capsys.readouterr().err
    assert listing(tmp_path) == ['m.npz', 'r.json']                 # the model's temporary file is gone too


def test_cli_error_in_a_stage_leaves_nothing(model_file, tmp_path, monkeypatch, capsys):
    def boom(model, o, ctx): raise TinycompError('training diverged')
    monkeypatch.setitem(STAGES, 'fine_tune', Stage('fine_tune', boom, STAGES['fine_tune'].options, 'boom'))
    (tmp_path / 'r.json').write_text('[{"fine_tune": {}}]')
    assert main(['compress', str(tmp_path / 'r.json'), '--model', str(model_file), '--out', str(tmp_path / 'o'), '--no-progress']) == 2
    assert 'training diverged' in capsys.readouterr().err
    assert listing(tmp_path) == ['m.npz', 'r.json']


# --- sweep and recommend --------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def sweep(model, data):
    configs = {'int8': [{'quantize_static': {'calibration_size': 64}}],
               'half': [{'prune_channels': {'ratio': 0.5}}, {'fine_tune': {'epochs': 1}}],
               'half int8': [{'prune_channels': {'ratio': 0.5}}, {'distill': {'epochs': 1}}, {'quantize_static': {}}]}
    return strategy_sweep(model, data, configs, progress=False, **FAST)


def test_sweep_rows_and_front(sweep):
    from tinycomp.benchmarking.evaluation import knee_point, pareto_front
    assert [r['name'] for r in sweep.rows] == ['original', 'int8', 'half', 'half int8']
    assert list(sweep.comparison.results) == ['original', 'int8', 'half', 'half int8']          # one compare
    pts = np.array([[r['accuracy'], r['latency_ms'][1], r['file_bytes']] for r in sweep.rows])
    assert sweep.front == list(pareto_front(pts, (True, False, False)))
    assert sweep.knee == knee_point(pts, (True, False, False)) and sweep.knee in sweep.front
    assert [r['on_front'] for r in sweep.rows] == [i in sweep.front for i in range(4)]
    assert sum(r['knee'] for r in sweep.rows) == 1
    for r in sweep.rows:
        h = sweep.comparison.row(r['name'])
        assert r['file_bytes'] == h['file_bytes'] and r['accuracy'] == h['accuracy']
    assert sweep.row('half int8')['recipe'][1]['distill']['epochs'] == 1
    assert sweep.row('original')['build_seconds'] == 0.0
    text = sweep.table()
    assert 'K' in text and 'Pareto front' in text and 'speedup = baseline latency / candidate latency' in text
    json.dumps(sweep.to_dict())


def test_sweep_plot(sweep, tmp_path):
    import matplotlib.pyplot as plt
    fig = sweep.plot(tmp_path / 'p.png')
    assert (tmp_path / 'p.png').stat().st_size > 1000
    plt.close(fig)
    with pytest.raises(TinycompError, match='not 8'): sweep.plot(batch_size=8)


def test_sweep_bad_configurations(model, data):
    with pytest.raises(TinycompError, match="configuration 'x': the recipe is empty"): strategy_sweep(model, data, {'x': []})
    with pytest.raises(TinycompError, match="configuration 'bad': recipe stage 2"):
        strategy_sweep(model, data, {'bad': [{'quantize_static': {}}, {'fine_tune': {}}]})
    with pytest.raises(TinycompError, match='non-empty dict'): strategy_sweep(model, data, {})
    with pytest.raises(TinycompError, match="'original' is the name"): strategy_sweep(model, data, {'original': [{'fine_tune': {}}]})


def test_default_configurations():
    c = default_configurations(epochs=3)
    assert len(c) >= 8 and 'int8' in c
    assert c['channels 50% + distill + int8'][0] == {'prune_channels': {'ratio': 0.5}}
    for name, recipe in c.items(): load_recipe(recipe)
    ratios = {i['prune_channels']['ratio'] for r in c.values() for i in r if 'prune_channels' in i}
    assert ratios == {0.25, 0.5, 0.75}


def test_recommend_on_sweep(sweep):
    o = sweep.row('original')
    limit = sorted(r['file_bytes'] for r in sweep.rows)[1]             # the two smallest fit
    rec = recommend(sweep, max_bytes=limit)
    feasible = [r for r in sweep.rows if r['file_bytes'] <= limit]
    assert len(feasible) == 2 and set(rec['feasible']) == {r['name'] for r in feasible}
    best = max(feasible, key=lambda r: (r['accuracy'], -r['file_bytes'], -r['latency_ms'][1]))
    assert rec['choice'] == best['name'] and 'original' in rec['rejected']
    assert f"{o['file_bytes']:,} bytes is" in rec['rejected']['original'][0]
    rec64 = recommend(sweep, max_latency_ms=1e9, batch_size=64)
    assert rec64['batch_size'] == 64 and 'at batch 64' in rec64['explanation']
    with pytest.raises(TinycompError, match='not 8'): recommend(sweep, batch_size=8)
    with pytest.raises(TinycompError, match='no configuration meets'): recommend(sweep, max_bytes=10)


ROWS = [dict(name='original', accuracy=0.99, latency_ms=2.0, file_bytes=400_000),
        dict(name='a', accuracy=0.98, latency_ms=1.0, file_bytes=100_000),
        dict(name='b', accuracy=0.98, latency_ms=0.8, file_bytes=100_000),
        dict(name='c', accuracy=0.98, latency_ms=0.5, file_bytes=120_000),
        dict(name='d', accuracy=0.90, latency_ms=0.2, file_bytes=20_000)]


def test_recommend_ties_and_explanation():
    r = recommend(ROWS, max_bytes=150_000, min_accuracy=0.95)
    assert r['choice'] == 'b'                                   # a, b, c equally accurate: smaller file, then faster
    assert r['feasible'] == ['b', 'a', 'c']
    assert "'a' is as accurate and as large, but slower (1.000 ms)" in r['explanation']
    assert r['rejected'] == {'original': ['file 400,000 bytes is 250,000 over the 150,000-byte limit'],
                             'd': ['accuracy 90.00% is 5.00 points under 95.00%']}
    assert r['constraints'] == dict(max_latency_ms=None, max_bytes=150_000.0, min_accuracy=0.95)
    r = recommend(ROWS, max_latency_ms=0.6)
    assert r['choice'] == 'c' and "next: 'd', 8.00 points lower" in r['explanation']
    assert 'latency 2.000 ms is 1.400 ms over the 0.600 ms limit' in r['rejected']['original'][0]
    assert recommend(ROWS, max_latency_ms=0.3)['explanation'].split('\n')[0].endswith('it is the only configuration that does.')
    assert recommend(ROWS)['choice'] == 'original'
    rows_dict = [dict(r, latency_ms={1: r['latency_ms'], 64: 10 * r['latency_ms']}) for r in ROWS]
    assert recommend(rows_dict, max_latency_ms=5, batch_size=64)['choice'] == 'c'


def test_recommend_impossible_names_closest():
    with pytest.raises(TinycompError) as e: recommend(ROWS, max_latency_ms=0.1, min_accuracy=0.985)
    msg = str(e.value)
    assert 'no configuration meets latency at batch 1 <= 0.100 ms, accuracy >= 98.50%' in msg
    assert "the closest is 'd': latency 0.200 ms is 0.100 ms over the 0.100 ms limit; accuracy 90.00% is 8.50 points under" in msg
    assert 'Relax max_latency_ms and min_accuracy' in msg


@pytest.mark.parametrize('kw, words', [
    (dict(max_latency_ms=-1), 'max_latency_ms must be positive'),
    (dict(max_latency_ms=0), 'max_latency_ms must be positive'),
    (dict(max_bytes=-100), 'max_bytes must be positive'),
    (dict(max_bytes=float('inf')), 'max_bytes must be a finite number'),
    (dict(min_accuracy=98.5), 'write 0.985 for 98.5 %'),
    (dict(min_accuracy=-0.1), 'min_accuracy must be a fraction in [0, 1]'),
    (dict(min_accuracy=150), 'min_accuracy must be a fraction'),
    (dict(min_accuracy=True), 'finite number'),
    (dict(max_bytes='1MB'), 'finite number'),
])
def test_recommend_bad_constraints(kw, words):
    with pytest.raises(TinycompError) as e: recommend(ROWS, **kw)
    assert words in str(e.value)


def test_recommend_bad_results():
    with pytest.raises(TinycompError, match='SweepResult or a non-empty list'): recommend([])
    with pytest.raises(TinycompError, match='SweepResult or a non-empty list'): recommend('rows')


def test_example_budgets():
    b = example_budgets(dict(accuracy=0.99, latency_ms={1: 2.0, 64: 20.0}, file_bytes=400_000))
    kws = list(b.values())
    assert kws[0] == dict(max_bytes=100_000.0, min_accuracy=pytest.approx(0.98))
    assert kws[1] == dict(max_latency_ms=1.0, min_accuracy=pytest.approx(0.985))


def test_bench_strategies(model_file, tmp_path, writes_only, monkeypatch, capsys):
    "The command on a tiny model with two configurations (the default sweep is what `tinycomp bench strategies` runs)."
    small = {'int8': [{'quantize_static': {}}], 'half': [{'prune_channels': {'ratio': 0.5}}, {'fine_tune': {'epochs': 1}}]}
    monkeypatch.setattr('tinycomp.benchmarking.sweep.default_configurations', lambda epochs: small)
    code = main(['bench', 'strategies', '--model', str(model_file), '--epochs', '1', '--json', 's.json', '--no-progress'])
    assert code == 0                                                            # the plot goes to the default --out, tinycomp_bench
    out = capsys.readouterr().out
    assert writes_only.check(out, 'tinycomp_bench', 's.json') == ['s.json', 'tinycomp_bench/strategies_pareto.png']
    assert 'budget: a quarter of the file' in out and 'budget: twice as fast at batch 1' in out and 'K' in out
    d = json.loads((writes_only.cwd / 's.json').read_text())
    assert [r['name'] for r in d['sweep']['rows']] == ['original', 'int8', 'half'] and len(d['budgets']) == 2
    assert (writes_only.cwd / 'tinycomp_bench' / 'strategies_pareto.png').read_bytes()[:4] == b'\x89PNG'
    assert main(['bench', 'strategies', '--model', str(model_file), '--out', 's.json']) == 2
    assert 'exists and is not a directory' in capsys.readouterr().err
    assert main(['bench', 'strategies', '--model', str(model_file), '--json', str(tmp_path / 'no' / 's.json')]) == 2
    assert 'does not exist' in capsys.readouterr().err
    assert writes_only.files() == {'s.json', 'tinycomp_bench/strategies_pareto.png'}
