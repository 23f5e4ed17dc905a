"""The real-size models (resnet8, mobilenet_v2_tiny, ds_cnn) on the shipped MNIST digits through every tool of the
course: shipped weights, int8, channel pruning, distillation, the compression pipeline, ONNX and ONNX Runtime, the
harness, the tour, the commands and a leaderboard task; and PyTorch's ResNet-8 and MobileNetV2-style exports."""
import json
from pathlib import Path

import numpy as np
import pytest

from tinycomp.benchmarking import compare, compress
from tinycomp.data import DataLoader, load_mnist5k, load_splits
from tinycomp.distillation import cache_teacher_logits, distill
from tinycomp.errors import TinycompError, TinycompWarning
from tinycomp.io import load, read_manifest, save
from tinycomp.models import (MODELS, ResNet, evaluate, load_pretrained, model_data, pretrained_info, pretrained_path,
                             resnet8)
from tinycomp.nn import parameter_counts
from tinycomp.optim import Adam
from tinycomp.pruning import prune_channels
from tinycomp.quantization import quantize_static
from tinycomp.tensor import Tensor, manual_seed, no_grad

NAMES = ('resnet8', 'mobilenet_v2_tiny', 'ds_cnn')
DATA = Path(__file__).parent / 'data'


@pytest.fixture(scope='module')
def mnist():
    return load_splits('mnist5k')


def _subset(splits, n_train=700, n_test=300):
    "The first images of each split (the splits are shuffled within each class, so every digit appears)."
    return {'train': tuple(a[:n_train] for a in splits['train']), 'val': tuple(a[:200] for a in splits['val']),
            'test': tuple(a[:n_test] for a in splits['test'])}


@pytest.mark.parametrize('name', NAMES)
def test_shipped_weights_reach_97_percent_on_the_mnist_test_split(name, mnist):
    model = load_pretrained(name)
    acc = evaluate(model, mnist['test']).accuracy
    assert acc >= 0.97, f"{name}: {acc:.2%}"
    info = pretrained_info(name)
    assert info['test_accuracy'] == pytest.approx(acc) and info['training_config']['data'] == 'mnist5k'
    assert len(info['history']['epoch']) == info['training_config']['epochs']
    assert model_data(name) == model_data(pretrained_path(name)) == 'mnist5k'


def test_parameter_counts_and_shapes():
    counts = {n: parameter_counts(MODELS[n]()).parameters for n in NAMES}
    assert 77_000 < counts['resnet8'] < 79_000 and 30_000 < counts['mobilenet_v2_tiny'] < 50_000 and 15_000 < counts['ds_cnn'] < 25_000
    for n in NAMES:
        with no_grad(): assert MODELS[n]()(Tensor(np.zeros((2, 1, 28, 28), np.float32))).shape == (2, 10)


def test_model_data_of_names_files_and_everything_else(tmp_path):
    assert [model_data(n) for n in ('digits_cnn', 'digits_cnn_wide')] == ['digits', 'digits']
    plain = save(resnet8(), tmp_path / 'plain.npz')
    tagged = save(resnet8(), tmp_path / 'tagged.npz', metadata={'data': 'mnist5k'})
    odd = save(resnet8(), tmp_path / 'odd.npz', metadata={'data': 'imagenet'})
    (tmp_path / 'junk.npz').write_bytes(b'not a model')
    assert model_data(tagged) == 'mnist5k' and model_data(str(tagged)) == 'mnist5k'
    for other in (plain, odd, tmp_path / 'junk.npz', tmp_path / 'missing.npz', 'no_such_model', resnet8()):
        assert model_data(other) == 'digits'


def test_a_pruned_mobilenet_rebuilds_from_its_config(tmp_path):
    "Pruned channel counts are not multiples of 8: the saved config must rebuild exactly those layers."
    model = load_pretrained('mobilenet_v2_tiny')
    pruned = prune_channels(model, 0.3, input_shape=(1, 1, 28, 28)).eval()
    x = load_mnist5k('test')[0][:8]
    again = load(save(pruned, tmp_path / 'p.npz')).eval()
    with no_grad(): np.testing.assert_array_equal(again(Tensor(x)).data, pruned(Tensor(x)).data)


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_int8_is_within_one_point(name, mnist):
    model = load_pretrained(name)
    q = quantize_static(model, mnist['train'][0][:256])
    float_acc, int8_acc = evaluate(model, mnist['test']).accuracy, evaluate(q, mnist['test']).accuracy
    assert int8_acc >= float_acc - 0.01, f"{name}: float {float_acc:.2%}, int8 {int8_acc:.2%}"


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_half_the_channels_pruned_by_dependency_groups_then_fine_tuned(name, mnist):
    model = load_pretrained(name)
    pruned = prune_channels(model, 0.5, input_shape=(1, 1, 28, 28))
    assert parameter_counts(pruned).parameters < 0.45 * parameter_counts(model).parameters
    _, report = compress(pruned, [{'fine_tune': {'epochs': 2, 'lr': 1e-3}}], mnist, measure=False, progress=False)
    before, after = report.rows[0]['accuracy'], report.rows[-1]['accuracy']      # half of every group gone: the cut costs a lot
    assert after >= 0.8 and after > before + 0.3, (before, after)                 # two epochs win most of it back


@pytest.mark.slow
def test_resnet8_distilled_into_a_thinner_resnet8(mnist):
    teacher = load_pretrained('resnet8')
    manual_seed(0)
    student = ResNet((8, 16, 32))
    assert parameter_counts(student).parameters < parameter_counts(teacher).parameters / 3
    X, y = mnist['train']
    history = distill(teacher, student, DataLoader(X, y, batch_size=64, shuffle=True, seed=0), None, epochs=3, T=4.0,
                      alpha=0.5, optimizer=Adam(student.parameters(), lr=3e-3), progress=False,
                      teacher_logits=cache_teacher_logits(teacher, X))
    assert history['train_loss'][-1] < history['train_loss'][0] / 2
    assert evaluate(student, mnist['test']).accuracy >= 0.9


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_export_to_onnx_agrees_with_onnx_runtime(name, mnist, tmp_path):
    pytest.importorskip('onnxruntime', reason='needs the onnx extra')   # CI installs every extra and fails on skips
    from tinycomp.onnx import export_onnx, ort_agreement
    model = load_pretrained(name)
    X = mnist['test'][0][:64]
    r = ort_agreement(model, export_onnx(model, tmp_path / 'f.onnx', (1, 1, 28, 28)), X)
    assert r['rel_err'] < 1e-4 and r['class_agreement'] == 1.0
    q = quantize_static(model, mnist['train'][0][:256])
    r = ort_agreement(q, export_onnx(q, tmp_path / 'q.onnx', (1, 1, 28, 28)), X)
    # ORT requantizes in float where we round TFLite's way (twice in an add): one step per layer at most, which
    # compounds over mobilenet_v2_tiny's 25 int8 layers and 5 adds; the classes still agree
    assert r['class_agreement'] >= 0.98 and r['rel_err'] < 0.1, r
    assert r['lsb_within_1'] >= (0.6 if name == 'mobilenet_v2_tiny' else 0.9), r


@pytest.mark.slow
def test_the_harness_compares_float_and_int8(mnist):
    model = load_pretrained('ds_cnn')
    q = quantize_static(model, mnist['train'][0][:256])
    test = tuple(a[:200] for a in mnist['test'])
    c = compare(('float32', model), {'int8': q}, test, batch_sizes=(1, 8), rounds=3, calls=1, threads=1)
    row = c.result('int8')
    assert row.file_bytes < c.result('float32').file_bytes / 2 and set(row.latency) == {1, 8}


def test_profile_command_on_resnet8(tmp_path, capsys):
    from tinycomp.cli import main
    assert main(['profile', 'resnet8', '--batch', '2', '--repeats', '2', '--out', str(tmp_path), '--trace', '--roofline']) == 0
    out = capsys.readouterr().out
    assert 'layer3.conv2' in out and 'tinycomp profile resnet8 on mnist5k test images: batch 2' in out and 'bound' in out
    rows = (tmp_path / 'operator_profile.csv').read_text()
    assert 'layer1.conv1' in rows and 'layer2.downsample.0' in rows
    events = json.loads((tmp_path / 'trace.json').read_text())['traceEvents']
    assert any(e.get('name', '').startswith('layer3.') for e in events)
    assert (tmp_path / 'roofline.png').stat().st_size > 1000
    assert main(['profile', 'ds_cnn', '--batch', '2', '--repeats', '2', '--out', str(tmp_path), '--shape', '1,8,8']) == 0
    capsys.readouterr()
    with pytest.warns(TinycompWarning, match='digits_cnn was trained on digits'):
        assert main(['profile', 'digits_cnn', '--data', 'mnist5k', '--batch', '2', '--repeats', '2', '--out', str(tmp_path)]) == 2
    assert 'does not accept inputs of shape (1, 28, 28)' in capsys.readouterr().err


@pytest.mark.slow
def test_tour_on_resnet8_runs_on_the_mnist_digits(tmp_path, capsys):
    from tinycomp.tour import tour
    recipe = tmp_path / 'int8.json'
    recipe.write_text(json.dumps([{'quantize_static': {}}]))
    figures = tour(out=tmp_path / 'out', model='resnet8', recipe=str(recipe), rounds=2, progress=False)
    out = capsys.readouterr().out
    assert 'resnet8 on the MNIST digits (28x28)' in out
    assert figures['data'] == 'mnist5k' and figures['accuracy'] >= figures['original_accuracy'] - 0.01
    saved = tmp_path / 'out' / 'resnet8_compressed.npz'
    assert read_manifest(saved)[0]['metadata'] == {'data': 'mnist5k'} and model_data(saved) == 'mnist5k'


@pytest.mark.slow
def test_compress_command_takes_the_model_data_and_records_it(tmp_path, capsys):
    from tinycomp.benchmarking.compression import compress_command
    recipe = tmp_path / 'r.json'
    recipe.write_text(json.dumps([{'quantize_static': {}}]))
    result = compress_command(str(recipe), 'ds_cnn', tmp_path / 'out', progress=False, rounds=2, calls=1)
    assert result['data'] == 'mnist5k' and 'ds_cnn, mnist5k test split' in capsys.readouterr().out
    saved = tmp_path / 'out' / 'ds_cnn_compressed.npz'
    assert model_data(saved) == 'mnist5k' and result['rows'][0]['accuracy'] >= 0.97
    assert result['rows'][-1]['file_bytes'] == saved.stat().st_size                # the report's bytes are the file's
    with pytest.raises(TinycompError, match='cannot take the data'), pytest.warns(TinycompWarning, match='trained on digits'):
        compress_command(str(recipe), 'digits_cnn', tmp_path / 'out2', progress=False, rounds=2, calls=1, data='mnist5k')


@pytest.mark.slow
def test_a_leaderboard_task_on_the_mnist_digits(tmp_path):
    from tinycomp.leaderboard import open_store
    from tinycomp.leaderboard.worker import measure_next
    store = open_store(tmp_path / 'class.db', create=True)
    info = store.init(dict(shipped='mnist-resnet8'))
    assert (info['name'], info['samples'], info['baseline']) == ('mnist-resnet8', 1000, 'resnet8.npz')
    token = store.issue_token('ada')
    q = quantize_static(load_pretrained('resnet8'), load_mnist5k('train')[0][:256])
    store.accept(token, save(q, tmp_path / 'q.npz').read_bytes())
    assert measure_next(store) is not None
    (seconds,), = [tuple(r.values()) for r in store.query("SELECT seconds FROM measurements")]
    lb = store.leaderboard()
    row, = lb['tracks']['closed']
    assert row['name'] == 'ada' and row['accuracy'] >= 0.97 and lb['samples'] == 500, row
    assert seconds < 30, f"measuring one submission took {seconds:.1f} s"        # the job: child start, accuracy, harness
    with pytest.raises(TinycompError, match="unknown shipped task 'cifar'"):
        open_store(tmp_path / 'other.db', create=True).init(dict(shipped='cifar'))


@pytest.mark.parametrize('stem', ['torch_resnet8', 'torch_mobilenet'])
def test_pytorch_exports_import_and_match_pytorch(stem):
    from tinycomp.onnx import import_onnx
    io = np.load(DATA / f'{stem}_io.npz', allow_pickle=False)
    assert np.array_equal(io['inputs'], load_mnist5k('test')[0][:len(io['inputs'])])
    model = import_onnx(DATA / f'{stem}.onnx').eval()
    with no_grad(): out = model(Tensor(io['inputs'])).data
    np.testing.assert_allclose(out, io['outputs'], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('stem', ['torch_resnet8', 'torch_mobilenet'])
def test_pytorch_exports_go_through_the_pipeline_and_back_to_onnx_runtime(stem, mnist, tmp_path):
    pytest.importorskip('onnxruntime', reason='needs the onnx extra')
    from tinycomp.onnx import export_onnx, import_onnx, ort_agreement
    model = import_onnx(DATA / f'{stem}.onnx').eval()
    data = _subset(mnist, 700, 300)
    recipe = [{'prune_channels': {'ratio': 0.25}}, {'fine_tune': {'epochs': 1}}, {'quantize_static': {}}]
    final, report = compress(model, recipe, data, measure=False, progress=False)
    assert report.rows[-1]['accuracy'] >= report.rows[0]['accuracy'] - 0.05
    X = mnist['test'][0][:64]
    r = ort_agreement(final, export_onnx(final, tmp_path / 'c.onnx', (1, 1, 28, 28)), X)
    assert r['class_agreement'] >= 0.95 and r['lsb_within_1'] >= (0.7 if 'mobilenet' in stem else 0.9), r


@pytest.mark.slow
def test_every_configuration_of_the_default_sweep_builds_on_resnet8(mnist):
    "The strategies benchmark's recipes (channels, distillation, sparsity, int8 and their mixes) on a residual model."
    from tinycomp.benchmarking.sweep import default_configurations
    data = _subset(mnist, 200, 100)
    for name, recipe in default_configurations(1).items():
        final, report = compress('resnet8', recipe, data, measure=False, progress=False)
        assert len(report.rows) == len(recipe) + 1, name
        with no_grad(): assert final(Tensor(data['test'][0][:2])).shape == (2, 10), name


def test_bench_strategies_takes_the_model_data(monkeypatch, tmp_path, capsys):
    from tinycomp.benchmarking import sweep
    monkeypatch.setattr(sweep, 'default_configurations', lambda epochs: {'int8': [{'quantize_static': {}}]})
    result = sweep.strategies_benchmark('ds_cnn', threads=1, progress=False, rounds=2, calls=1)
    assert result['data'] == 'mnist5k' and 'ds_cnn, mnist5k test split' in capsys.readouterr().out
    assert [r['name'] for r in result['sweep']['rows']] == ['original', 'int8']


def test_leaderboard_init_with_the_mnist_task(tmp_path, capsys):
    from tinycomp.cli import main
    from tinycomp.leaderboard import open_store
    assert main(['leaderboard', 'init', '--db', str(tmp_path / 'c.db'), '--task', 'mnist-resnet8']) == 0
    assert "task 'mnist-resnet8', 1000 evaluation samples (500 public, 500 private), baseline resnet8.npz" in capsys.readouterr().out
    s = open_store(tmp_path / 'c.db').settings
    assert (s['rounds'], s['calls']) == (10, 3)                          # the task's own settings keep a job short
    assert main(['leaderboard', 'init', '--db', str(tmp_path / 'd.db'), '--task', 'mnist-resnet8', '--rounds', '6']) == 0
    assert open_store(tmp_path / 'd.db').settings['rounds'] == 6          # what the instructor says wins
    assert main(['leaderboard', 'init', '--db', str(tmp_path / 'e.db'), '--task', 'mnist-resnet8',
                 '--task-data', str(tmp_path / 'x.npz'), '--baseline', 'b.npz']) == 2
    assert 'give --task or --task-data, not both' in capsys.readouterr().err and not (tmp_path / 'e.db').exists()


def test_export_command_builds_the_graph_for_the_model_data(tmp_path, capsys):
    pytest.importorskip('onnx', reason='needs the onnx extra')
    from tinycomp.cli import main
    assert main(['export', 'ds_cnn', '--out', str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ", 1, 28, 28] float32)" in out and 'Conv x9' in out, out                      # four depthwise, four pointwise, the stem


def test_a_loaded_model_carries_its_data_and_its_file_size(tmp_path):
    from tinycomp.io import carried_metadata, model_size
    model = load_pretrained('resnet8')
    assert carried_metadata(model) == {'data': 'mnist5k'} and model_data(model) == 'mnist5k'
    assert model_size(model) == pretrained_path('resnet8').stat().st_size        # the report's bytes are the file's
    again = load(save(model, tmp_path / 'again.npz'))
    assert model_data(again) == 'mnist5k' and (tmp_path / 'again.npz').stat().st_size == model_size(model)


def test_asking_for_other_data_than_the_model_was_trained_on_warns():
    from tinycomp.models import data_choice
    assert data_choice('resnet8') == 'mnist5k' and data_choice('digits_cnn', None) == 'digits'
    with pytest.warns(TinycompWarning, match='resnet8 was trained on mnist5k; using digits as asked'):
        assert data_choice('resnet8', 'digits') == 'digits'
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert data_choice(resnet8(), 'digits') == 'digits'           # a model that records nothing: no warning
